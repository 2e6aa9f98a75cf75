"""Adapter for StreamFlow 0.2.0rc3's command lines: environment values and workdirs quoted.

Every connector of StreamFlow builds the line it hands to a shell with
``streamflow.core.utils.create_command``, which writes ``cd {workdir} && export K="V" &&
...`` with neither quoted. The environment is a CWL tool's ``EnvVarRequirement`` (a site
profile's ``env``, xffl's own variables, and StreamFlow's ``HOME``/``TMPDIR``, which hold the
job's folder under the site's workdir); the workdir is the job's folder. A value holding a
backtick, ``"``, ``$`` or a newline therefore ran as commands: on the coordinator for a local
site, on the facility's login node or compute node otherwise. The batch templates'
``streamflow_environment`` is built the same way (``streamflow/deployment/template.py``).

:func:`create_command` is upstream's, with each value passed through ``shlex.quote`` (the
same quoting the batch script ``sbatch/<site>.sh`` shows for the profile's ``env``), and a
name that is not an identifier refused; :func:`install` (called by xffl's StreamFlow plugin)
puts it in place of upstream's, so every connector StreamFlow runs, xffl's and its own (the
coordinator's ``local`` deployment), gets it. Everything else of the line is upstream's.
``tests/security/test_shell_injection.py`` shows upstream running the payloads.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Mapping, MutableMapping, MutableSequence
from typing import Any

from streamflow.core.exception import WorkflowExecutionException

from xffl.site_profiles.schema import ENV_NAME_RE

_MARK = "_xffl_quoted"


def environment_words(environment: Mapping[str, str] | None) -> list[str]:
    """``export NAME='value'`` for each variable, the value shell-quoted, the name checked."""
    words = []
    for key, value in (environment or {}).items():
        if not ENV_NAME_RE.match(key):
            raise WorkflowExecutionException(
                f"refused to run a command with environment variable {key!r}: not a name")
        words.append(f"export {key}={shlex.quote(str(value))}")
    return words


def shell_prefix(environment: Mapping[str, str] | None, workdir: str | None) -> str:
    """What upstream puts before a command (``cd`` to the workdir, the exports), quoted."""
    words = ([f"cd {shlex.quote(workdir)}"] if workdir is not None else []) + \
        environment_words(environment)
    return "".join(f"{w} && " for w in words)


def upstream_create_command() -> Any:
    """StreamFlow's own ``create_command`` (the one :func:`install` replaced, if it did)."""
    from streamflow.core import utils

    return getattr(utils.create_command, "__wrapped__", utils.create_command)


def create_command(class_name: str, command: MutableSequence[str],
                   environment: MutableMapping[str, str] | None = None,
                   workdir: str | None = None, stdin: int | str | None = None,
                   stdout: int | str = asyncio.subprocess.STDOUT,
                   stderr: int | str = asyncio.subprocess.STDOUT) -> str:
    """Upstream's command line, with the workdir and every environment value shell-quoted."""
    rest: str = upstream_create_command()(class_name, command, None, None, stdin, stdout, stderr)
    return shell_prefix(environment, workdir) + rest


def install() -> None:
    """Put :func:`create_command` in place of ``streamflow.core.utils.create_command``."""
    from streamflow.core import utils

    if getattr(utils.create_command, _MARK, False):
        return

    def quoted(*args: Any, **kwargs: Any) -> str:
        return create_command(*args, **kwargs)

    setattr(quoted, _MARK, True)
    quoted.__wrapped__ = utils.create_command  # type: ignore[attr-defined]
    utils.create_command = quoted
