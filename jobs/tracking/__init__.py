"""Experiment tracking: each completed round logged to the trackers the job names.

One interface (``tracker``), TensorBoard and MLflow behind it, the rounds read from the
registry (``rounds``). Above the registry.
"""
