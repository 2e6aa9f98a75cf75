"""A job spec's tracking server gets none of the user's MLflow credentials.

The attack: a shared job spec names ``tracking.mlflow: http://...``, a server its author runs,
while the user's environment holds MLFLOW_TRACKING_TOKEN/USERNAME/PASSWORD (and a
``~/.mlflow/credentials`` and ``~/.netrc`` for that host). A fake MLflow server on 127.0.0.1
logs every request's Authorization header: named by the spec alone it sees none; the same
server configured by the user (MLFLOW_TRACKING_URI, or ``mlflow_servers`` in the user's
``tracking.yaml``) sees them, which shows the test can fail.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from xffl.jobs.registry.records import RoundRecord, RunRecord
from xffl.jobs.registry.states import RoundState, RunState
from xffl.jobs.spec.tracking import TrackingSpec
from xffl.jobs.tracking.mlflow import gets_credentials, user_config_file
from xffl.jobs.tracking.rounds import log_round

pytestmark = pytest.mark.xdist_group("tracking")

TOKEN = "s3cr3t-token"
RUN_INFO = {"run_id": "r1", "run_uuid": "r1", "experiment_id": "1", "status": "RUNNING",
            "start_time": 0, "lifecycle_stage": "active"}


class _FakeMlflow(BaseHTTPRequestHandler):
    """Just enough of MLflow's REST API for one round to be logged; logs each request."""

    seen: ClassVar[list[tuple[str, str | None]]] = []

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append((self.path, self.headers.get("Authorization")))
        status, body = 200, {}
        if "experiments/get-by-name" in self.path:
            status, body = 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "none"}
        elif "experiments/create" in self.path:
            body = {"experiment_id": "1"}
        elif "runs/search" in self.path:
            body = {"runs": []}
        elif "runs/create" in self.path:
            body = {"run": {"info": RUN_INFO, "data": {}}}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer  # http.server's names

    def log_message(self, *args: Any) -> None:
        """Quiet."""


@pytest.fixture
def server() -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    """The fake server's URL and the (path, Authorization) of every request it answered."""
    seen: ClassVar[list[tuple[str, str | None]]] = []
    handler = type("Handler", (_FakeMlflow,), {"seen": seen})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        thread.join(timeout=10)


@pytest.fixture
def credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every credential MLflow would send: environment, ~/.mlflow/credentials, ~/.netrc."""
    home = tmp_path / "user"
    (home / ".mlflow").mkdir(parents=True)
    (home / ".mlflow" / "credentials").write_text(
        "[mlflow]\nmlflow_tracking_username = fileuser\nmlflow_tracking_password = filepw\n")
    (home / ".netrc").write_text("machine 127.0.0.1 login netrcuser password netrcpw\n")
    (home / ".netrc").chmod(0o600)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)


def _log(uri: str) -> list[str]:
    run = RunRecord("r-1", "shared-job", "job.yaml", "run", RunState.RUNNING, 2, 0, ["a"], 0.0,
                    0.0)
    record = RoundRecord(round=1, state=RoundState.COMPLETED, started=1.0, ended=2.0,
                         loss=1.5, sites=[])
    return log_round(TrackingSpec(mlflow=uri), run, {"rounds": 2}, record, [])


@pytest.mark.usefixtures("credentials")
@pytest.mark.parametrize("basic", [False, True])
def test_a_server_the_spec_names_gets_no_credential(
        server: tuple[str, list[tuple[str, str | None]]], monkeypatch: pytest.MonkeyPatch,
        basic: bool) -> None:
    url, seen = server
    if basic:  # MLflow sends basic auth instead of the token when both are set
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "envuser")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "envpw")
    assert _log(url) == []  # the round was logged ...
    paths = [p for p, _ in seen]
    assert any("runs/log-batch" in p for p in paths), paths
    assert [auth for _, auth in seen if auth is not None] == []  # ... with no credential
    assert os.environ["MLFLOW_TRACKING_TOKEN"] == TOKEN  # the environment is left as it was
    assert os.environ["HOME"].endswith("user") and "NETRC" not in os.environ


@pytest.mark.usefixtures("credentials")
def test_the_same_server_configured_by_the_user_gets_them(
        server: tuple[str, list[tuple[str, str | None]]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    url, seen = server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url + "/")  # the user's own setting
    assert _log(url) == []
    assert seen and all(auth is not None for _, auth in seen)  # the user's credentials


@pytest.mark.usefixtures("credentials")
def test_the_user_config_file_names_trusted_servers(
        server: tuple[str, list[tuple[str, str | None]]]) -> None:
    url, seen = server
    path = user_config_file()
    path.parent.mkdir(parents=True)
    path.write_text(f"mlflow_servers:\n  - {url}\n")
    assert _log(url) == []
    assert seen and all(auth is not None for _, auth in seen)  # the user's credentials
    # another port, path or scheme of the same host is another server
    host = url.rsplit(":", 1)[0]
    for other in (f"{host}:1", f"{url}/other", url.replace("http:", "https:"),
                  url.replace("127.0.0.1", "user@127.0.0.1") + "@evil.example"):
        assert not gets_credentials(other), other
    path.write_text("mlflow_servers: {a: 1}\n")
    with pytest.raises(ValueError, match=r"tracking\.yaml"):
        gets_credentials(url)
