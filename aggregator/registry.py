"""Old name of :mod:`xffl.aggregator.strategy_catalog`, kept only while ``jobs/`` imports it."""

from xffl.aggregator.strategy_catalog import STRATEGIES, get, names

__all__ = ["STRATEGIES", "get", "names"]
