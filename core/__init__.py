"""Shared foundations of xffl: errors with exit codes, YAML loading with line numbers, paths."""
