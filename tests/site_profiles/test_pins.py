"""A site's install leaves the coordinator's own packages out, and the site's code needs none."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from xffl.site_profiles.pins import COORDINATOR_ONLY, pinned_requirements

# the import names of the distributions left out, and of what only they bring
BLOCKED = ("streamflow", "cwltool", "paramiko", "cryptography", "croniter", "crontab",
           "matplotlib", "schema_salad", "rdflib", "asyncssh", "kubernetes_asyncio")


def test_the_pins_leave_the_coordinators_packages_out() -> None:
    names = {p.split("==")[0] for p in pinned_requirements()}
    assert not names & COORDINATOR_ONLY
    assert not names & {"schema-salad", "rdflib", "asyncssh", "kubernetes-asyncio"}
    assert {"transformers", "tokenizers", "safetensors", "pydantic", "typer", "peft",
            "datasets", "pyarrow"} <= names


def test_what_a_site_runs_imports_none_of_them() -> None:
    """The ranks' module, the launcher, the evaluation, `xffl data prepare` and the version
    probe, in a Python where importing any left-out package fails (as in a site's venv)."""
    script = textwrap.dedent(f"""
        import importlib, sys
        BLOCKED = {BLOCKED!r}
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError("a site has no " + name)
        sys.meta_path.insert(0, Block())
        for mod in ("xffl.training.__main__", "xffl.training.launch", "xffl.training.trainer",
                    "xffl.training.evaluate_models", "xffl.training.prepare",
                    "xffl.training.round_state", "xffl.site_profiles.versions"):
            importlib.import_module(mod)
        from xffl.cli.app import main
        sys.argv = ["xffl", "data", "prepare", "--help"]
        try:
            main()
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        print("site imports ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "site imports ok" in done.stdout
