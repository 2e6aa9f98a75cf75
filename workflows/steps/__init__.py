"""The coordinator's steps of a round, run by the plan as command-line tools."""
