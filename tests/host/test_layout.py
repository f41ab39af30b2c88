"""The shape of the host's code, checked like its imports are (pyproject's import contracts):
no module too long to read whole, and no class's private state read from another module."""

from __future__ import annotations

import ast
from pathlib import Path

HOST = Path(__file__).resolve().parents[2] / "host"
MAX_MODULE_LINES = 500  # STYLE.md: review a module at 400 lines, split it at 500


def _modules() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(HOST.rglob("*.py"))}


def _private_names_defined(tree: ast.Module) -> set[str]:
    """`_name`s a module gives its classes: `self._x = ...` and `def _x` inside a class."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in ast.walk(node):
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and _is_private(item.name):
                    names.add(item.name)
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    if _is_private(item.target.id):
                        names.add(item.target.id)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _foreign_reads(modules: dict[Path, ast.Module]) -> list[str]:
    defined = {path: _private_names_defined(tree) for path, tree in modules.items()}
    found = []
    for path, tree in modules.items():
        elsewhere = set().union(*(names for other, names in defined.items() if other != path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in elsewhere and node.attr not in defined[path]:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_host_module_is_longer_than_the_limit() -> None:
    long = {
        str(path.relative_to(HOST.parent)): n
        for path in sorted(HOST.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"host modules over {MAX_MODULE_LINES} lines (split them by responsibility): {long}"


def test_no_module_reads_another_modules_private_state() -> None:
    found = _foreign_reads(_modules())
    assert not found, "private attributes read from another module (add a verb or a public name):\n" + "\n".join(found)


def test_the_private_state_check_finds_a_foreign_read(tmp_path: Path) -> None:
    """The check itself: a module reading another's `_state` is found, its own is not."""
    owner = ast.parse("class Core:\n    def __init__(self):\n        self._state = 1\n")
    reader = ast.parse("def peek(core):\n    return core._state\n")
    twin = "class Twin:\n    def __init__(self):\n        self._n = 0\n    def copy(self, o):\n        o._n = 1\n"
    own = ast.parse(twin)
    found = _foreign_reads({tmp_path / "core.py": owner, tmp_path / "reader.py": reader, tmp_path / "twin.py": own})
    assert len(found) == 1 and "core._state" in found[0]
