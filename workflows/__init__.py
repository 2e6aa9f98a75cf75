"""Compile a job into a cyclic CWL plan, run it with StreamFlow, validate it with cwltool."""
