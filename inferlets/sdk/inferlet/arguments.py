"""Command-line style arguments for inferlets: `argparse`, but errors end the run with the
message and usage as its error (a guest cannot print usage to a terminal and exit)."""

from __future__ import annotations

import argparse
import gettext  # noqa: F401 - argparse imports these lazily; the build must snapshot them
import locale  # noqa: F401
import shutil  # noqa: F401
import textwrap  # noqa: F401
from typing import NoReturn

from inferlet.errors import InferletError


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        kwargs.setdefault("add_help", False)  # -h would print to the guest's stderr and exit
        super().__init__(*args, **kwargs)

    def _get_formatter(self) -> argparse.HelpFormatter:
        # argparse builds a formatter on every add_argument, and a formatter without a width asks
        # the terminal for one: a WASI call each time, in a guest that has no terminal.
        return self.formatter_class(prog=self.prog, width=100)

    def error(self, message: str) -> NoReturn:
        raise InferletError(f"{self.prog}: {message}\n{self.format_usage().strip()}")


def _warm_up() -> None:
    """Run argparse's paths once at import, i.e. at build time, so every module they import
    lazily is in the snapshot (a module first imported at run time may not exist)."""
    parser = ArgumentParser(prog="warm-up")
    parser.add_argument("--number", type=int, default=1)
    parser.add_argument("--flag", action="store_true")
    parser.add_argument("--choice", choices=["a", "b"])
    parser.parse_args(["--number", "2", "--flag", "--choice", "a"])
    parser.format_help()
    for bad in (["--number", "x"], ["--unknown"], ["--choice", "c"]):
        try:
            parser.parse_args(bad)
        except InferletError:
            pass


_warm_up()
