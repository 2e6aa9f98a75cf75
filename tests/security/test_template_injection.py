"""A job spec or profile from someone else must not run code on the coordinator.

StreamFlow renders every SLURM batch template with a plain ``jinja2.Template``: an expression
in it reaches Python (``lipsum.__globals__.os``). Two defences: the profile schema refuses a
Jinja2 statement in every line a site contributes (so ``{% endraw %}`` cannot leave the raw
block those lines sit in), and xffl's ``xffl-slurm`` connector renders in Jinja2's sandbox.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from jinja2.exceptions import SecurityError
from streamflow.deployment.connector.local import LocalConnector
from streamflow.deployment.template import CommandTemplateMap
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app
from xffl.workflows.extensions.connectors import XfflSlurmConnector

runner = CliRunner()


def _payload(marker: Path) -> str:
    return "{% endraw %}{{ lipsum.__globals__.os.system('touch " + str(marker) + "') }}{% raw %}"


def _template(marker: Path) -> str:
    """A batch template as xffl writes it, with the payload in a site's setup line."""
    return ("#!/bin/bash\n{% raw %}\nmodule load x\n" + _payload(marker) + "\n{% endraw %}\n"
            "{{streamflow_command}}\n")


def test_upstream_template_rendering_runs_the_payload(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    templates = CommandTemplateMap(default="{{streamflow_command}}",
                                   template_map={"train": _template(marker)})
    templates.get_command("echo hi", template="train")
    assert marker.exists()  # StreamFlow 0.2.0rc3: the coordinator ran `touch`


def test_xffl_slurm_renders_in_a_sandbox(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    (tmp_path / "train.j2").write_text(_template(marker))
    connector = XfflSlurmConnector(
        deployment_name="site", config_dir=str(tmp_path), service=None,
        connector=LocalConnector(deployment_name="login", config_dir=str(tmp_path)),
        services={"train": {"file": "train.j2"}})
    with pytest.raises(SecurityError):
        connector.template_map.get_command("echo hi", template="train")
    assert not marker.exists()
    # an honest template renders as StreamFlow's would
    (tmp_path / "ok.j2").write_text("#!/bin/bash\n{% raw %}echo {{ x }}{% endraw %}\n"
                                    "{{streamflow_command}}\n")
    honest = XfflSlurmConnector(
        deployment_name="site2", config_dir=str(tmp_path), service=None,
        connector=LocalConnector(deployment_name="login2", config_dir=str(tmp_path)),
        services={"ok": {"file": "ok.j2"}})
    assert honest.template_map.get_command("srun python", template="ok") == \
        "#!/bin/bash\necho {{ x }}\nsrun python"


@pytest.mark.parametrize("field", ["setup", "env", "extra", "job-override"])
def test_the_payload_is_refused_before_anything_is_written(tmp_path: Path, field: str) -> None:
    marker = tmp_path / "pwned"
    evil = _payload(marker)
    (tmp_path / "site_profiles").mkdir()
    profile: dict[str, object] = {
        "name": "cluster", "launcher": "srun", "slurm": {"partition": "debug"},
        "connector": {"type": "ssh", "host": "127.0.0.1", "known_hosts": str(tmp_path / "kh")}}
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["sites"] = spec["sites"][:1]
    spec["sites"][0]["profile"] = "cluster"
    if field == "setup":
        profile["setup"] = [evil]
    elif field == "env":
        profile["env"] = {"X": evil}
    elif field == "extra":
        profile["slurm"] = {"partition": "debug", "extra": [evil]}
    else:  # the job spec's own per-site override
        spec["sites"][0]["slurm"] = {"extra": [evil]}
    (tmp_path / "site_profiles" / "cluster.yaml").write_text(yaml.safe_dump(profile))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    for command in (["validate"], ["render", "-o", str(tmp_path / "plan")]):
        result = runner.invoke(app, [*command, str(tmp_path / "job.yaml")])
        assert result.exit_code == 2, result.output
        assert "Jinja2 statement" in result.stderr
    assert not (tmp_path / "plan").exists() and not marker.exists()
