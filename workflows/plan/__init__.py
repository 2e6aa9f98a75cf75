"""Compile a job into its plan: the CWL documents, StreamFlow deployments, batch scripts."""
