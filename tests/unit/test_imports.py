"""No import cycles in runner/: every import between its modules, at the top of a file or inside a function, points
one way."""

import ast
from pathlib import Path

RUNNER = Path(__file__).resolve().parents[2] / "runner"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(RUNNER.rglob("*.py")):
        parts = list(path.relative_to(RUNNER.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The runner modules ``name`` imports (a package's own submodules importing it do not count: it is loading)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return groups


def test_runner_has_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "runner.engine.data.dispatch" in graph["runner.engine.data.loaders"]  # the walk sees imports
    assert _cycles(graph) == []


def test_a_cycle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The lifetimes, from the top: the command line, a sweep, the processes of a run; below them the training
# helpers, the config and the engine. A module imports from its own layer or those below it. The entry modules
# (python -m runner, runner.report, runner.checkpoints) only point at their command.
_LAYERS = ("runner.cli", "runner.sweeps", "runner.launch")
_ENTRY_MODULES = {"runner.__main__", "runner.report", "runner.checkpoints"}


def _layer(module: str) -> int:
    """0 for runner.cli, 1 for runner.sweeps, 2 for runner.launch, 3 for everything below them."""
    return next((i for i, top in enumerate(_LAYERS) if module == top or module.startswith(top + ".")), len(_LAYERS))


def _upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted(
        (module, target)
        for module, targets in graph.items()
        if module not in _ENTRY_MODULES
        for target in targets
        if _layer(target) < _layer(module)
    )


def test_no_module_imports_from_a_layer_above_it():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "runner.launch.elastic" in graph["runner.cli.app"]  # the walk sees the layers' imports
    assert _upward_imports(graph) == []
    engine = {(m, t) for m, ts in graph.items() if m.startswith("runner.engine") for t in ts}
    assert {t for _, t in engine if not t.startswith("runner.engine")} <= {"runner.files"}  # the engine stands alone


def test_an_upward_import_is_found():
    graph = {"runner.launch.worker": {"runner.cli.app", "runner.config"}, "runner.cli.app": {"runner.launch.worker"}}
    assert _upward_imports(graph) == [("runner.launch.worker", "runner.cli.app")]
