"""Every module of runner/ reads in one sitting, and the Accelerator is a front whose verbs delegate."""

import ast
import inspect
from pathlib import Path

from runner.engine import Accelerator

RUNNER = Path(__file__).resolve().parents[2] / "runner"
MAX_MODULE_LINES = 450
MAX_VERB_LINES = 25  # a verb's code, after its docstring


def _long_functions(path: Path, limit: int) -> list[str]:
    long = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0]
            documented = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and len(node.body) > 1
            start = node.body[1].lineno if documented else first.lineno
            if node.end_lineno - start + 1 > limit:
                long.append(f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - start + 1} lines)")
    return long


def test_no_module_of_runner_is_over_450_lines():
    sizes = {path.relative_to(RUNNER).as_posix(): len(path.read_text().splitlines()) for path in RUNNER.rglob("*.py")}
    assert len(sizes) > 100 and sizes["engine/accelerator.py"] > 300  # the walk sees the package
    assert {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES} == {}


def test_the_accelerator_is_a_front_of_short_verbs():
    parts = [cls for cls in Accelerator.__mro__ if cls.__module__.startswith("runner.")]
    assert [cls.__name__ for cls in parts] == [
        "Accelerator", "ProcessVerbs", "ProcessPlacement", "CheckpointVerbs", "TrackingVerbs"
    ]  # fmt: skip
    files = [Path(inspect.getfile(cls)) for cls in parts]
    assert [file.relative_to(RUNNER).as_posix() for file in files] == [
        "engine/accelerator.py", "engine/processes.py", "engine/placement.py", "engine/checkpoint/verbs.py",
        "engine/tracking/verbs.py",
    ]  # fmt: skip
    assert [long for file in files for long in _long_functions(file, MAX_VERB_LINES)] == []


def test_a_long_function_is_found(tmp_path):
    module = tmp_path / "module.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(26))
    module.write_text(f'def long():\n    """Docs are not counted."""\n{body}\n\ndef short():\n    return 1\n')
    assert _long_functions(module, MAX_VERB_LINES) == ["module.py:1 long (26 lines)"]
    assert _long_functions(module, 26) == []
