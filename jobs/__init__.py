"""xffl.jobs."""
