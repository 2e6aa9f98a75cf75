"""The exchange format's file names, in a module of their own: a launcher reads them without
importing the format's readers (pydantic, numpy: 0.2 CPU-s of each site job's launcher)."""

MANIFEST_FILE = "manifest.json"
