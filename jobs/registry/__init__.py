"""The run registry: the SQLite store of runs, rounds and sites, and their states.

Also the run folder's own records: its round lock and its resolved site profiles. Above the
job spec, below everything that reads or changes a run.
"""
