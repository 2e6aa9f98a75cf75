"""StreamFlow listing a Directory on a ``no_listing`` port: upstream, and with xffl's adapter."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest


def _update_file_token(fn: Any, folder: Path) -> Any:
    from streamflow.core.deployment import ExecutionLocation
    from streamflow.cwl.utils import LoadListing
    from streamflow.deployment.connector.local import LocalConnector
    from streamflow.main import build_context

    async def call() -> Any:
        context = build_context({"database": {"type": "default", "config": {
            "connection": str(folder.parent / "sf.db")}}})
        try:
            connector = LocalConnector(deployment_name="__LOCAL__", config_dir=str(folder))
            location = ExecutionLocation(name="__LOCAL__", deployment="__LOCAL__", local=True)
            token = {"class": "Directory", "path": str(folder), "basename": folder.name,
                     "location": f"file://{folder}"}
            return await fn(context, connector, "v1.2", location, token, None,
                            LoadListing.no_listing)
        finally:
            await context.close()

    return asyncio.run(call())


@pytest.fixture
def update(tmp_path: Path) -> Path:
    """A site's update folder holding a model file and a dangling symbolic link."""
    folder = tmp_path / "update"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    os.symlink(tmp_path / "gone", folder / "dangling")
    return folder


def test_upstream_lists_and_checksums_a_no_listing_directory(update: Path) -> None:
    import streamflow.cwl.utils as sf_cwl_utils

    from xffl.workflows.extensions.listing import install

    install()
    upstream = sf_cwl_utils.update_file_token.__wrapped__  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="dangling does not exist"):
        _update_file_token(upstream, update)
    (update / "dangling").unlink()
    listed = _update_file_token(upstream, update)
    (entry,) = listed["listing"]  # listed, and the file hashed, although no_listing
    assert entry["basename"] == "model.safetensors" and entry["checksum"].startswith("sha1$")


def test_xffl_leaves_a_no_listing_directory_unlisted(update: Path) -> None:
    import streamflow.cwl.utils as sf_cwl_utils

    from xffl.workflows.extensions.listing import install

    install()
    token = _update_file_token(sf_cwl_utils.update_file_token, update)
    assert token["path"] == str(update) and "listing" not in token
