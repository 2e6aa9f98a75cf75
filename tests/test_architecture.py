"""The layout tells the architecture, and this test keeps it telling the truth.

xffl's subpackages form layers; a module may import its own package and the layers below:

    core <- schedulers <- aggregator <- training <- site_profiles <- jobs <- workflows <- cli

(``schedulers`` is the batch schedulers' dialect behind one protocol, SLURM its one
implementation, used by the site's trainer and by the coordinator alike; ``aggregator`` owns
the exchange format that training writes; ``jobs`` is the job spec, the
run registry and the run's state; ``workflows`` compiles and runs the plan, and submits and
resumes runs.) ``jobs`` is itself layered by concern:

    jobs.spec  <-  jobs.registry  <-  jobs.tracking  <-  jobs.report  <-  jobs

(the job spec, which knows nothing of runs; the run registry and the run folder's records;
experiment tracking of the recorded rounds; a run's numbers and report; run control: status,
follow, cancel, cron, the SLURM view.) ``workflows`` is layered by the process its code runs in:

    workflows.steps  <-  workflows.extensions  <-  workflows.plan  <-  workflows

(the coordinator's per-round tools, run by the plan; the StreamFlow plugin, loaded by
StreamFlow; the plan's compiler, at submit and render; the run control: submit, supervisor,
resume, evaluate, export, simulate.)

Checked on every import, function-level ones included: no module imports a higher layer
(``python -m`` entry points, ``__main__`` modules, are command lines and may use ``cli``), no
import circle between modules, and no private name (``_x``) is imported from another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

LAYERS = ["core", "schedulers", "aggregator", "training", "site_profiles",
          "jobs.spec", "jobs.registry", "jobs.tracking", "jobs.report", "jobs",
          "workflows.steps", "workflows.extensions", "workflows.plan", "workflows", "cli"]


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in LAYERS:
        for file in sorted((REPO / pkg.replace(".", "/")).glob("*.py")):
            out[f"xffl.{pkg}" + ("" if file.stem == "__init__" else f".{file.stem}")] = file
    return out


def _layer(module: str) -> int:
    """The layer of ``xffl.<package>.<module>``: its package's place in LAYERS."""
    package = module.removeprefix("xffl.")
    while package not in LAYERS:
        package = package.rsplit(".", 1)[0]
    return LAYERS.index(package)


def _imports(file: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported xffl module, names taken from it) for every import statement in ``file``."""
    found = []
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("xffl"):
            names = [a.name for a in node.names]
            submodules = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in modules]
            for sub in submodules:
                found.append((sub, []))
            found.append((node.module, [n for n in names if f"{node.module}.{n}" not in modules]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("xffl.")]
    return found


def test_no_module_imports_a_higher_layer_or_a_private_name() -> None:
    modules = _modules()
    assert len(modules) > 80
    problems = []
    for name, file in modules.items():
        layer = _layer(name) if file.stem != "__init__" else _layer(f"{name}.x")
        for target, names in _imports(file, modules):
            if target not in modules:
                continue
            other = _layer(target) if modules[target].stem != "__init__" \
                else _layer(f"{target}.x")
            if other > layer and not name.endswith(".__main__"):
                problems.append(f"{name} imports {target} (a higher layer)")
            private = [n for n in names if n.startswith("_")]
            if private and target != name:
                problems.append(f"{name} imports private {', '.join(private)} from {target}")
    assert problems == []


def test_no_import_circles() -> None:
    modules = _modules()
    graph = {name: {t for t, _ in _imports(file, modules) if t in modules and t != name}
             for name, file in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert circles == []


def test_the_repository_stands_alone() -> None:
    """No code or doc refers to design notes that live outside the repository."""
    offenders = [str(p.relative_to(REPO)) for pattern in ("*.py", "*.md", "*.sh", "*.j2")
                 for p in REPO.rglob(pattern)
                 if ".venv" not in p.parts and "build" not in p.parts
                 and p != Path(__file__)
                 and any(ref in p.read_text(errors="ignore")
                         for ref in ("DESIGN.md", "STACK.md", "../shared/"))]
    assert offenders == []
