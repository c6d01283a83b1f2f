"""The package's import structure: no module imports one that imports it back (directly or around a
circle), and each layer imports only the layers below it:

    asyncgrpo/run/        the run directory, file operations, hosts, liveness
    asyncgrpo/jobqueue/   the queue protocol            asyncgrpo/weights/   the weight transports
    asyncgrpo/ (the rest) config, inputs, events, tasks
    ps/  worker/  queue_tools/   the processes

Imports inside functions count: a lazy import hides a circle, it does not remove it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("asyncgrpo", "ps", "worker", "queue_tools")


def module_files() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that ``name`` imports: ``from pkg import sub`` names the submodule when there is one."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
    return {m for m in found if m in modules and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (circle := visit(node)):
            return circle
    return None


def test_the_graph_sees_the_imports(graph):
    # The checks below are only as good as the graph: it must see plain, from-package and lazy imports.
    assert "asyncgrpo.run.fileops" in graph["asyncgrpo.run.rundir"]  # from asyncgrpo.run import fileops
    assert "asyncgrpo.run.rundir" in graph["asyncgrpo.jobqueue.names"]
    assert "queue_tools.trace" in graph["queue_tools.report"]
    assert "queue_tools.plots" in graph["queue_tools.report"]  # imported inside a function (matplotlib is optional)


def test_find_circle_finds_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle(graph):
    # A package's __init__ re-exports its modules; importing the package from inside it would be a circle.
    assert find_circle(graph) is None, " -> ".join(find_circle(graph))


LAYER_RULES = [  # (modules under, may not import anything under)
    ("asyncgrpo.run", ("asyncgrpo.jobqueue", "asyncgrpo.weights", "asyncgrpo.config", "asyncgrpo.config_parser",
                       "asyncgrpo.inputs", "asyncgrpo.tasks", "ps", "worker", "queue_tools")),
    ("asyncgrpo.weights", ("asyncgrpo.jobqueue", "ps", "worker", "queue_tools")),
    ("asyncgrpo.jobqueue", ("asyncgrpo.weights", "ps", "worker", "queue_tools")),
    ("asyncgrpo", ("ps", "worker", "queue_tools")),
    ("ps", ("worker", "queue_tools")),
    ("worker", ("ps", "queue_tools")),
    ("queue_tools", ("ps", "worker")),
]


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize(("layer", "forbidden"), LAYER_RULES, ids=[rule[0] for rule in LAYER_RULES])
def test_each_layer_imports_only_the_layers_below(graph, layer, forbidden):
    crossing = sorted(f"{m} imports {dep}" for m, deps in graph.items() if under(m, layer)
                      for dep in deps if any(under(dep, f) for f in forbidden))
    assert not crossing, crossing


# The worker's decoding: the loop around it (claims, scoring, publishing) is a layer above, never imported by it.
DECODING_LOOP = ("worker.loop", "worker.generation", "worker.generate", "worker.results", "worker.deadline")
DECODING_DEPTH = 5  # the longest chain of imports inside worker/decoding, in modules


def decoding_chain(graph: dict[str, set[str]], module: str) -> list[str]:
    """The longest chain of imports from ``module`` through worker/decoding's modules (its package's __init__, the
    interface they all import, aside)."""
    inside = sorted(m for m in graph[module] if under(m, "worker.decoding") and m != "worker.decoding")
    return [module, *max((decoding_chain(graph, m) for m in inside), key=len, default=[])]


def test_decoding_imports_are_shallow_and_never_reach_up_to_the_loop(graph):
    decoding = [m for m in graph if under(m, "worker.decoding")]
    longest = max((decoding_chain(graph, m) for m in decoding), key=len)
    assert len(longest) <= DECODING_DEPTH, " -> ".join(longest)
    upward = sorted(f"{m} imports {dep}" for m in decoding for dep in graph[m] if dep in DECODING_LOOP)
    assert not upward, upward
    # (the chain is seen: build imports the decoders, the engine its parts)
    assert len(decoding_chain(graph, "worker.decoding.build")) >= 3
