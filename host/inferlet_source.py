"""What an inferlet folder holds, as the build sees it: where it is, its Python files (checked
for syntax), what `app` imports through them, and how guest paths in a traceback map back to them."""

from __future__ import annotations

import ast
import os
import re
import threading
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
INFERLETS_DIR = REPO_ROOT / "inferlets"
WIT_DIR = INFERLETS_DIR / "wit"
SDK_DIR = INFERLETS_DIR / "sdk"
APP_MODULE = "app"
SDK_PACKAGE = "inferlet"


class BuildError(Exception):
    """The inferlet cannot be built; the message says where and why."""


def resolve_inferlet(name_or_path: str) -> Path:
    """A folder path, or the name of a folder under `inferlets/`."""
    candidate = Path(name_or_path)
    if candidate.is_dir():
        return candidate.resolve()
    named = INFERLETS_DIR / name_or_path
    if os.sep not in name_or_path and named.is_dir() and name_or_path not in ("wit", "sdk"):
        return named
    raise BuildError(f"no inferlet folder {name_or_path!r} (not a directory, and not a name under {INFERLETS_DIR})")


def sources(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The files under `root` with one of `suffixes`. Any link under `root` that resolves outside
    it is a BuildError, whatever its suffix: a build reads only what the folder holds (a snapshot
    build runs the inferlet's code on the folder), so a link cannot carry another file of the
    machine into a component, nor to whoever it is uploaded to."""
    real_root = root.resolve()
    found = []
    for path in root.rglob("*"):  # does not descend into linked folders: the link itself is checked
        if "__pycache__" in path.parts:
            continue
        if path.is_symlink():
            try:
                target = path.resolve()
            except (OSError, RuntimeError) as exc:  # a link loop
                raise BuildError(f"{path} is a link that cannot be resolved ({exc}): remove it") from None
            if not target.is_relative_to(real_root):
                raise BuildError(
                    f"{path} links to {target}, outside {root}: a build takes only files inside the "
                    "inferlet's folder (copy the file in, or remove the link)"
                )
        if path.suffix in suffixes and path.is_file():
            found.append(path)
    return sorted(found)


def syntax_check(inferlet_dir: Path) -> None:
    """Catch syntax errors here, in a fraction of a second, before a multi-second build."""
    if not (inferlet_dir / f"{APP_MODULE}.py").is_file():
        raise BuildError(f"{inferlet_dir}: an inferlet needs an {APP_MODULE}.py defining main(args)")
    for path in sources(inferlet_dir, (".py",)):
        try:
            compile(path.read_bytes(), str(path), "exec")
        except SyntaxError as exc:
            where = f"{exc.filename}:{exc.lineno}" + (f":{exc.offset}" if exc.offset else "")
            line = (exc.text or "").rstrip()
            raise BuildError(f"{where}: SyntaxError: {exc.msg}" + (f"\n    {line}" if line else "")) from None


def inferlet_files(inferlet_dir: Path) -> tuple[tuple[str, str], ...]:
    """The inferlet's Python files: (path relative to its folder, with "/", source)."""
    return tuple((p.relative_to(inferlet_dir).as_posix(), p.read_text()) for p in sources(inferlet_dir, (".py",)))


def _module_path(files: dict[str, str], module: str) -> str | None:
    rel = module.replace(".", "/")
    return next((p for p in (f"{rel}/__init__.py", f"{rel}.py") if p in files), None)


# CPython 3.11 keeps the AST constructor's recursion depth in state shared by all threads: two
# threads parsing at once (one paused by a finalizer that releases the GIL) fail with
# "SystemError: AST constructor recursion depth mismatch". Builds run on threads side by side.
_parse_lock = threading.Lock()


def _parse(source: str, filename: str) -> ast.Module:
    with _parse_lock:
        return ast.parse(source, filename=filename)


def external_imports(files: tuple[tuple[str, str], ...]) -> set[str]:
    """Top-level names of the modules that `app` imports, directly or through its own modules,
    that are not the inferlet's own. Only modules reachable from `app` count, so a test file in the
    folder that imports pytest does not."""
    by_path = dict(files)
    external: set[str] = set()
    seen: set[str] = set()
    queue = [f"{APP_MODULE}.py"]
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        package = path.rsplit("/", 1)[0].replace("/", ".") if "/" in path else ""
        if path.endswith("/__init__.py"):
            package = path[: -len("/__init__.py")].replace("/", ".")
        for node in ast.walk(_parse(by_path[path], path)):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: inside the inferlet's own package
                    base_parts = package.split(".") if package else []
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)] if node.level > 1 else base_parts
                    prefix = ".".join([*base_parts, node.module] if node.module else base_parts)
                    names = [f"{prefix}.{alias.name}" if prefix else alias.name for alias in node.names]
                    if prefix:
                        names.append(prefix)
                else:
                    assert node.module is not None
                    names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            for name in names:
                parts = name.split(".")
                local = [_module_path(by_path, ".".join(parts[: i + 1])) for i in range(len(parts))]
                if local[0] is None:
                    external.add(parts[0])
                queue += [p for p in local if p is not None]
    return external


_GUEST_PATH = re.compile(r'"/(\d+|app)/([^"]+)"')


def _search_path(inferlet_dir: Path) -> list[Path]:
    """componentize-py mounts its `-p` folders in the guest as /0, /1, ... in this order."""
    return [Path("<generated entry>"), inferlet_dir, SDK_DIR]


def rewrite_guest_paths(text: str, inferlet_dir: Path) -> str:
    """Turn guest paths in a traceback back into the files they came from: "/app/x.py" (a
    module imported from the sources a base component carries) or "/1/x.py" (a snapshot's)."""
    roots = _search_path(inferlet_dir)

    def local(m: re.Match[str]) -> str:
        index = 1 if m.group(1) == "app" else int(m.group(1))
        return f'"{roots[index] / m.group(2)}"' if index < len(roots) else m.group(0)

    return _GUEST_PATH.sub(local, text)
