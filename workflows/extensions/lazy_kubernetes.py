"""StreamFlow's Kubernetes and Helm connectors, imported only when a deployment makes one.

StreamFlow 0.2.0rc3's connector package (``streamflow/deployment/connector/__init__.py``)
imports its ``kubernetes`` module unconditionally, to list the three classes in
``connector_classes``; that module imports ``kubernetes_asyncio``: 0.2 CPU-s in every process
that loads StreamFlow's connectors (the supervisor, each ``xffl round``), for deployments xffl
never writes. :func:`install`, called before StreamFlow is imported, puts a stand-in for
that module in ``sys.modules``: its three classes answer ``get_schema`` from upstream's own
schema files (what StreamFlow's config validator asks of every connector class), and making
one, or reading any other name of the module, imports upstream's module and hands over to
it. A ``kubernetes`` or ``helm`` deployment in a ``streamflow.yml`` therefore validates and
deploys as upstream's would (``tests/workflows/extensions/test_lazy_kubernetes.py``).
"""

from __future__ import annotations

import importlib
import sys
from importlib.resources import files
from types import ModuleType
from typing import Any, ClassVar

NAME = "streamflow.deployment.connector.kubernetes"
SCHEMAS = {"KubernetesConnector": "kubernetes.json", "Helm3Connector": "helm3.json",
           "Helm4Connector": "helm4.json"}


def upstream() -> ModuleType:
    """Upstream's module, imported now in place of the stand-in."""
    if getattr(sys.modules.get(NAME), "STAND_IN", False):
        del sys.modules[NAME]
    return importlib.import_module(NAME)


class Deferred:
    """One of upstream's connector classes, standing in until a deployment makes one."""

    upstream_name: ClassVar[str]
    schema_file: ClassVar[str]

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Upstream's connector (its ``__init__`` run with these arguments)."""
        return getattr(upstream(), cls.upstream_name)(*args, **kwargs)

    @classmethod
    def get_schema(cls) -> str:
        """Upstream's schema of the connector, read from upstream's own file."""
        folder = files("streamflow.deployment.connector").joinpath("schemas")
        return folder.joinpath(cls.schema_file).read_text("utf-8")


def _attribute(name: str) -> Any:
    """Any other name of the module: upstream's (PEP 562). The import system's own questions
    (``__path__``, ``__spec__``, ...) are not a use: the stand-in has no such name."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(upstream(), name)


def install() -> None:
    """Stand in for upstream's module, unless StreamFlow's connectors are imported already."""
    if NAME in sys.modules or "streamflow.deployment.connector" in sys.modules:
        return
    stand_in = ModuleType(NAME, __doc__)
    stand_in.STAND_IN = True  # type: ignore[attr-defined]
    for name, schema in SCHEMAS.items():
        setattr(stand_in, name, type(name, (Deferred,), {
            "upstream_name": name, "schema_file": schema, "__module__": NAME}))
    stand_in.__getattr__ = _attribute  # type: ignore[method-assign]
    sys.modules[NAME] = stand_in
