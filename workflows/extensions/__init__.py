"""xffl's StreamFlow plugin: connectors, failure manager, data manager, adapters.

Loaded by StreamFlow (:mod:`xffl.workflows.extensions.plugin`); the plan names these
extensions in ``streamflow.yml`` by the names below, which the plugin registers.
"""

FAILURE_MANAGER = "xffl"
DATA_MANAGER = "xffl"
SLURM_CONNECTOR = "xffl-slurm"
LOCAL_CONNECTOR = "xffl-local"
SSH_CONNECTOR = "xffl-ssh"
