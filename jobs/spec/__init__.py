"""The job spec: the schema of job.yaml, its loading and checks, and the consent its Python needs.

The lowest layer of ``jobs/``: it knows the site profiles and the training and aggregation
settings a job names, and nothing of runs.
"""
