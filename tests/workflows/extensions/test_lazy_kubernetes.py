"""StreamFlow's Kubernetes connectors stand in until used: a plan's streamflow.yml loads
without the Kubernetes client, and a kubernetes deployment still validates, is refused, and
is made as upstream's (each in a fresh interpreter, with and without the stand-in)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import QUICKSTART
from xffl.jobs.spec.load import load_job
from xffl.workflows.plan.compile import write_plan

# Validates two streamflow.yml files with StreamFlow's own validator, then makes a
# kubernetes connector through StreamFlow's connector table; prints what it saw as JSON.
PROBE = """
import json, sys
if sys.argv[1] == "stand-in":
    from xffl.workflows.extensions.lazy_kubernetes import install
    install()
from streamflow.config.validator import SfValidator
from streamflow.core.exception import WorkflowDefinitionException
seen = {"client_before": "kubernetes_asyncio" in sys.modules}
for name in ("good", "bad"):
    try:
        SfValidator().validate_file(sys.argv[2] + f"/{name}.yml")
        seen[name] = "valid"
    except WorkflowDefinitionException as exc:
        seen[name] = str(exc)
from streamflow.deployment.connector import connector_classes
conn = connector_classes["kubernetes"](deployment_name="k", config_dir=sys.argv[2],
                                       files=["deployment.yaml"])
seen["made"] = type(conn).__module__ + "." + type(conn).__qualname__
seen["client_after"] = "kubernetes_asyncio" in sys.modules
print(json.dumps(seen))
"""

CONFIG = """version: v1.0
workflows:
  w:
    type: cwl
    config: {{file: main.cwl}}
deployments:
  k:
    type: kubernetes
    config: {{files: [deployment.yaml]{extra}}}
"""


def _probe(mode: str, folder: Path) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", PROBE, mode, str(folder)], capture_output=True,
                          text=True, timeout=300, check=True)
    seen: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return seen


def test_a_kubernetes_deployment_is_upstreams(tmp_path: Path) -> None:
    (tmp_path / "good.yml").write_text(CONFIG.format(extra=""))
    (tmp_path / "bad.yml").write_text(CONFIG.format(extra=", noSuchOption: 1"))
    upstream, ours = _probe("upstream", tmp_path), _probe("stand-in", tmp_path)
    assert upstream["client_before"] and not ours["client_before"]
    assert ours == {**upstream, "client_before": False}
    assert upstream["good"] == "valid" and upstream["bad"] != "valid"
    assert ours["made"] == "streamflow.deployment.connector.kubernetes.KubernetesConnector"
    assert ours["client_after"]


def test_a_plan_loads_without_the_kubernetes_client(tmp_path: Path, xffl_home: Path) -> None:
    """xffl's own path (load_config: StreamFlow's validator and xffl's plugin) on a plan."""
    layout = write_plan(load_job(QUICKSTART), "qs-1", tmp_path / "plan")
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from xffl.workflows.streamflow_run import load_config\n"
            "config = load_config(Path(sys.argv[1]))\n"
            "print(sorted(config['deployments']), 'kubernetes_asyncio' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code, str(layout.streamflow)],
                          capture_output=True, text=True, timeout=300, check=True)
    deployments, client = done.stdout.strip().rsplit(" ", 1)
    assert "alpha" in deployments and client == "False"
