"""Old name of :mod:`xffl.aggregator.exchange_spec`, kept only while ``jobs/`` imports it."""

from xffl.aggregator.exchange_spec import LORA_CONTEXT, ExchangeSpec

__all__ = ["LORA_CONTEXT", "ExchangeSpec"]
