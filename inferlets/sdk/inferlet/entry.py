"""What the build wires to the component's `run` export: call the inferlet's `main(args)` and turn
an uncaught exception into the run's error, with the guest traceback in it.

Two builds use it. A component on wafer's shared base (the default) imports the inferlet's
modules when the run starts, from the sources the host hands over (`run_app`); a snapshot build
(`wafer build --snapshot`) imported them at build time and calls `run_main` with `app.main`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import traceback
from collections.abc import Callable, Sequence
from types import ModuleType

from componentize_py_types import Err
from wit_world.imports import runtime as _rt

from inferlet.errors import InferletError
from inferlet.runtime import args

APP_ROOT = "/app/"  # where the inferlet's files appear in tracebacks (the host maps it back)


def run_main(main: Callable[[list[str]], object]) -> None:
    try:
        main(args())
    except InferletError as e:
        raise Err(str(e)) from None
    except Err:
        raise
    except BaseException:  # the host must get the traceback, whatever it was
        raise Err(traceback.format_exc()) from None


class AppSources(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the inferlet's modules from their sources (a dict path -> text): `pkg.mod` from
    `pkg/mod.py` or `pkg/mod/__init__.py`. First on `sys.meta_path`, like the inferlet's folder
    first on the path in a snapshot build."""

    def __init__(self, files: Sequence[tuple[str, str]]) -> None:
        self._files = dict(files)

    def _path(self, fullname: str) -> tuple[str, bool] | None:
        rel = fullname.replace(".", "/")
        if f"{rel}/__init__.py" in self._files:
            return f"{rel}/__init__.py", True
        if f"{rel}.py" in self._files:
            return f"{rel}.py", False
        return None

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        found = self._path(fullname)
        if found is None:
            return None
        rel, is_package = found
        return importlib.util.spec_from_loader(fullname, self, origin=APP_ROOT + rel, is_package=is_package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        spec = module.__spec__
        assert spec is not None and spec.origin is not None
        module.__file__ = spec.origin
        code = compile(self._files[spec.origin[len(APP_ROOT) :]], spec.origin, "exec", dont_inherit=True)
        exec(code, module.__dict__)

    def get_source(self, fullname: str) -> str | None:  # for the source lines in tracebacks
        found = self._path(fullname)
        return None if found is None else self._files[found[0]]


class _MissingFromBase(importlib.abc.MetaPathFinder):
    """Last on `sys.meta_path`: a module that is neither the inferlet's nor in the base was not
    seen by the build (imported by a computed name); say how to get it."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if "." not in fullname:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: it is not in wafer's base, and the build did not see it "
                "imported (import it by name, with an import statement, or build with --snapshot)",
                name=fullname,
            )


def run_app() -> None:
    """Import `app` from the sources the host holds for this run, then run its main."""
    try:
        sys.meta_path.insert(0, AppSources(_rt.app_sources()))
        sys.meta_path.append(_MissingFromBase())
        app = importlib.import_module("app")
    except BaseException:
        raise Err(traceback.format_exc()) from None
    main = getattr(app, "main", None)
    if not callable(main):
        raise Err("app.py must define a function main(args: list[str]) -> None")
    run_main(main)
