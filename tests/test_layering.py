"""The import graph of ``ragen``: no cycles, and the layers import one way.

Every ``import`` of a ``ragen`` module is read with ``ast``, lazy ones inside
functions included, so a cycle hidden behind a function-level import counts.
Layers (docs/layout.md), bottom first: ``ragen.env`` and ``ragen.llm``, then
``ragen.serving``, ``ragen.gateway``, ``ragen.agents``, ``ragen.rollout``, ``ragen.viewer``, ``ragen.trainer``,
``ragen.tools`` and ``ragen.llm_agent`` (RAGEN's names); a layer never imports
one above it. And one name per thing: ``ContextManager`` in ``ragen`` is
``ragen.rollout.context.ContextManager``, never ``typing.ContextManager``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is_package) for every ``.py`` under ``root/ragen/``."""
    modules = {}
    for path in sorted((root / "ragen").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = (path, is_package)
    return modules


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the ``ragen`` modules it imports (at any depth of its code)."""
    modules = _modules(root)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in modules.items():
        package = module if is_package else module.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(owner(alias.name) for alias in node.names if alias.name.split(".")[0] == "ragen")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from ..y import z
                    parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parent + ([base] if base else []))
                if base.split(".")[0] != "ragen":
                    continue
                for alias in node.names:  # `from pkg import submodule` imports the submodule
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else owner(base))
        targets.discard(None)
        targets.discard(module)
        graph[module] = targets  # type: ignore[assignment]
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


@pytest.mark.timeout(60)
def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) == []


@pytest.mark.timeout(60)
def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    package = tmp_path / "ragen"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import b\n")
    (package / "a.py").write_text("import ragen.sub.b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ragen.a import x\n    from ..c import y\n")
    (package / "c.py").write_text("import os\n")
    graph = import_graph(tmp_path)
    assert graph == {"ragen": set(), "ragen.sub": {"ragen.sub.b"}, "ragen.a": {"ragen.sub.b"},
                     "ragen.sub.b": {"ragen.a", "ragen.c"}, "ragen.c": set()}
    assert import_cycles(graph) == [["ragen.a", "ragen.sub.b"]]


@pytest.mark.timeout(60)
def test_no_import_cycle_among_ragen_modules():
    assert import_cycles(import_graph()) == []


# Each layer, bottom first, and the packages above it that it never imports.
LAYERS = ["ragen.env", "ragen.llm", "ragen.serving", "ragen.gateway", "ragen.agents", "ragen.rollout",
          "ragen.viewer", "ragen.trainer", "ragen.verl", "ragen.tools", "ragen.llm_agent"]
ABOVE = {
    "ragen.env": LAYERS[2:],
    "ragen.llm": LAYERS[2:],
    "ragen.serving": LAYERS[3:],
    "ragen.gateway": LAYERS[4:],  # the OpenAI-compatible gateway on the shared engine
    "ragen.agents": LAYERS[5:],  # agent programs: their contract and the runner of one episode
    "ragen.rollout": LAYERS[6:],
    "ragen.viewer": LAYERS[7:],
    "ragen.trainer": LAYERS[8:],
    "ragen.verl": LAYERS[9:],
    "ragen.tools": LAYERS[10:],
}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.timeout(60)
def test_layers_import_one_way():
    wrong = []
    for module, deps in import_graph().items():
        for layer, above in ABOVE.items():
            if _in(module, layer):
                wrong += [f"{module} -> {dep}" for dep in sorted(deps) if any(_in(dep, a) for a in above)]
    assert wrong == []


# Inside the rollout (docs/layout.md): an episode plays one env and knows nothing of the
# scheduler that drives it, its batching policies, clients or workers; the policies know
# nothing of the scheduler either.
EPISODE_DOES_NOT_IMPORT = {
    "ragen.rollout.episode": ("ragen.serving", "ragen.rollout.scheduler", "ragen.rollout.batching",
                              "ragen.rollout.backends", "ragen.rollout.workers"),
    "ragen.rollout.env_calls": ("ragen.serving", "ragen.rollout.scheduler", "ragen.rollout.batching",
                                "ragen.rollout.episode", "ragen.rollout.turn", "ragen.rollout.backends"),
    # the turn applies an answer; the episode, not the turn, decides that it ends
    "ragen.rollout.turn": ("ragen.serving", "ragen.rollout.scheduler", "ragen.rollout.batching",
                           "ragen.rollout.episode", "ragen.rollout.backends"),
    "ragen.rollout.episode_state": ("ragen.serving", "ragen.rollout.scheduler", "ragen.rollout.batching",
                                    "ragen.rollout.episode", "ragen.rollout.env_calls", "ragen.rollout.turn",
                                    "ragen.rollout.backends"),
    "ragen.rollout.batching": ("ragen.serving.client", "ragen.serving.transport", "ragen.rollout.scheduler", "ragen.rollout.episode",
                               "ragen.rollout.backends"),
}


@pytest.mark.timeout(60)
def test_an_episode_knows_nothing_of_its_scheduler():
    graph = import_graph()
    wrong = [f"{module} -> {dep}" for module, banned in EPISODE_DOES_NOT_IMPORT.items()
             for dep in sorted(graph[module]) if any(_in(dep, b) for b in banned)]
    assert wrong == []


# The functions allowed past LONGEST lines: the env checker's list of checks, read top to
# bottom, and the Sokoban searches, each one loop over a search's state.
LONGEST = 60
LONG_BY_NATURE = {"ragen.env.check.checker._run_checks", "ragen.env.sokoban.ragen_rooms._reverse_search",
                  "ragen.env.sokoban.solver.solve", "ragen.env.sokoban.generator._reverse_search"}


@pytest.mark.timeout(60)
def test_no_function_of_ragen_is_longer_than_sixty_lines():
    long = []
    for module, (path, _) in _modules(ROOT).items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST and f"{module}.{node.name}" not in LONG_BY_NATURE:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert long == []


@pytest.mark.timeout(60)
def test_every_module_sits_in_a_layer():
    """A new top-level package is placed in LAYERS (or is one of the shared helpers below every package)."""
    helpers = {"ragen", "ragen.pickling", "ragen.config_files", "ragen.config_reader", "ragen.utils",
               "ragen.send_queue", "ragen.progress", "ragen.errors",
               "ragen.allocator"}  # train.py's malloc: imports nothing of ragen, loaded before the rest
    loose = [m for m in import_graph() if m not in helpers and not any(_in(m, layer) for layer in LAYERS)]
    assert loose == []


@pytest.mark.timeout(60)
def test_contextmanager_names_only_ragens_class():
    clashes = []
    for module, (path, _) in _modules(ROOT).items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module in ("typing", "contextlib", "typing_extensions"):
                clashes += [f"{module}: from {node.module} import {a.name}" for a in node.names
                            if (a.asname or a.name) == "ContextManager"]
    assert clashes == []


@pytest.mark.timeout(60)
def test_the_error_family_sits_below_every_module():
    """``ragen.errors`` imports nothing of ragen, so every layer (and the config reader) can raise its errors."""
    assert import_graph()["ragen.errors"] == set()


@pytest.mark.timeout(60)
def test_a_public_class_name_names_one_class():
    """One name per thing: a reader (or an import) that finds a class by its name finds one."""
    known = {"Reply"}  # serving.hooks' handler reply and env.remote.protocol's observation reply: not yet renamed
    where: dict[str, list[str]] = {}
    for module, (path, _) in _modules(ROOT).items():
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(module)
    assert {name: modules for name, modules in where.items() if len(modules) > 1 and name not in known} == {}
