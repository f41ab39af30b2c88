"""The `wafer` command line: `main` (host.cli.commands) builds, runs, watches and serves; the
other modules are the engines and kept drivers the commands start."""

from host.cli.commands import main

__all__ = ["main"]
