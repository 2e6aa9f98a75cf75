"""xffl's StreamFlow plugin: connectors, failure manager, data manager, adapters.

Loaded by StreamFlow (:mod:`xffl.workflows.extensions.plugin`); the plan names these
extensions in ``streamflow.yml`` by the names below, which the plugin registers.
"""

FAILURE_MANAGER = "xffl"
DATA_MANAGER = "xffl"
LOCAL_CONNECTOR = "xffl-local"
SSH_CONNECTOR = "xffl-ssh"


def queue_connector(scheduler: str) -> str:
    """The name of xffl's connector for a batch scheduler (``xffl-slurm``)."""
    return f"xffl-{scheduler}"
