"""Jobs and runs: the job spec, the run registry, tracking and reports; run control on top.

Sub-packages, each importing only those listed before it: ``spec/`` (the job spec),
``registry/`` (the run registry), ``tracking/`` (experiment tracking) and ``report/`` (a
run's numbers and drawing). The modules here control runs and read their state: status,
follow, cancel, cron schedules, the SLURM view and estimate, the credential gate.
"""
