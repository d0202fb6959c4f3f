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
    assert "runner.engine.loaders.dispatch" in graph["runner.engine.loaders.prepare"]  # the walk sees imports
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


# A room is a package of runner.engine (checkpoint, data, parallel, tracking) or of runner (cli, launch, sweeps, data,
# models); any other module is a room of its own. A room's private names (a leading underscore) are its own business.
def _room(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["runner", "engine"] and len(parts) > 3:
        return ".".join(parts[:3])
    if len(parts) > 2 and parts[1] != "engine":
        return ".".join(parts[:2])
    return module


def _private_reads(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """``module: target._name`` for each private name ``name`` imports from, or reads off, another room's module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    aliases, found = {}, []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
                elif base in modules and alias.name.startswith("_") and not alias.name.startswith("__"):
                    if _room(base) != _room(name):
                        found.append(f"{name}: {base}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            target = aliases.get(node.value.id) if isinstance(node.value, ast.Name) else None
            if target is None and isinstance(node.value, ast.Attribute):
                target = ast.unparse(node.value) if ast.unparse(node.value) in modules else None
            if target is not None and _room(target) != _room(name):
                found.append(f"{name}: {target}.{node.attr}")
    return found


def test_no_module_reads_another_rooms_private_names():
    modules = _modules()
    reads = [read for name, path in modules.items() for read in _private_reads(name, path, modules)]
    assert reads == []


def test_a_private_read_across_rooms_is_found(tmp_path):
    module = tmp_path / "worker.py"
    module.write_text(
        "from runner.engine.loaders import loader\n"
        "from runner.engine.checkpoint.staging import _write\n"
        "from runner.engine.checkpoint.loading import _read\n"
        "import runner.engine.ops as ops\n"
        "loader._batches, ops._group, ops.__name__\n"
    )
    modules = {
        "runner.engine.loaders.loader": None, "runner.engine.checkpoint.staging": None,
        "runner.engine.checkpoint.loading": None, "runner.engine.ops": None,
    }  # fmt: skip
    found = _private_reads("runner.engine.checkpoint.verbs", module, modules)
    assert found == ["runner.engine.checkpoint.verbs: runner.engine.loaders.loader._batches",
                     "runner.engine.checkpoint.verbs: runner.engine.ops._group"]  # fmt: skip
    assert _room("runner.engine.checkpoint.staging") == "runner.engine.checkpoint"
    assert _room("runner.engine.ops") == "runner.engine.ops" and _room("runner.cli.app") == "runner.cli"
