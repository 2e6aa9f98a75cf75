"""The data-prepare benchmark at 0.1 MB (one block of 1000 examples): it runs, and xffl and
datasets.map count the same tokens."""

from __future__ import annotations

import json

import pytest

from tests.bench.scripts import load_bench


def test_a_small_file_both_ways(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_bench("data_prepare").main(["--size-mb", "0.1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    # the same file rendered by the same template and tokenizer: the same tokens, both ways
    assert got["tokens"] == got["datasets_map"]["tokens"] > 0
    assert 0 < got["xffl"]["peak_rss_mb"] < 500 and got["ratio"] > 0
