"""The starter job specs that `xffl init` writes (YAML, read with importlib.resources).

Data, not code: this file makes the folder a package, so that an editable install finds it
as the wheel does.
"""
