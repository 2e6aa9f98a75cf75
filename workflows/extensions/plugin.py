"""xffl's StreamFlow plugin: the site failure manager, the data manager that times transfers,
the connectors for facilities (deadlines kept, transfers from untrusted sites extracted
safely), the directory-listing adapter, the translation adapter (each tool file parsed
once) and the command-line adapter (environment values and workdirs shell-quoted).

Loaded by StreamFlow through the entry point ``unito.streamflow.plugin`` (pyproject.toml), so
``streamflow run streamflow.yml`` in a plan directory finds the same extensions as
``xffl submit``; ``streamflow plugin list`` shows them.
"""

from __future__ import annotations

from streamflow.ext.plugin import StreamFlowPlugin

from xffl.workflows.extensions import (
    DATA_MANAGER,
    FAILURE_MANAGER,
    LOCAL_CONNECTOR,
    SSH_CONNECTOR,
    queue_connector,
)
from xffl.workflows.extensions.connectors import QUEUE_CONNECTORS, XfflLocalConnector
from xffl.workflows.extensions.failure import SiteFailureManager
from xffl.workflows.extensions.listing import install as install_listing_fix
from xffl.workflows.extensions.shell import install as install_shell_quoting
from xffl.workflows.extensions.ssh import XfflSshConnector
from xffl.workflows.extensions.transfers import TransferClock
from xffl.workflows.extensions.translate import install as install_translation_fix


class XfflPlugin(StreamFlowPlugin):
    """Registers xffl's failure manager and connectors with StreamFlow."""

    def register(self) -> None:
        """Called by StreamFlow when it loads its extensions."""
        install_listing_fix()
        install_shell_quoting()
        install_translation_fix()
        self.register_failure_manager(FAILURE_MANAGER, SiteFailureManager)
        self.register_data_manager(DATA_MANAGER, TransferClock)
        for scheduler, connector in QUEUE_CONNECTORS.items():  # xffl-slurm
            self.register_connector(queue_connector(scheduler), connector)
        self.register_connector(LOCAL_CONNECTOR, XfflLocalConnector)
        self.register_connector(SSH_CONNECTOR, XfflSshConnector)
