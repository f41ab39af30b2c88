"""`wafer serve`: the daemon's command line. Flags override `WAFER_*` variables, which override
the `--config` file; `load_config` is the one reader of all three."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from host.daemon.config import LOG_FORMATS, LOG_LEVELS, DaemonConfig, load_config
from host.daemon.errors import DaemonConfigError, DaemonError
from host.sandbox.config import default_cache_dir

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

# flag -> config key; every flag defaults to None so that unset flags do not override anything.
_FLAGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("--host", "host", {"help": "listen address (default 127.0.0.1)"}),
    ("--port", "port", {"type": int, "help": "listen port (default 8000; 0 picks a free one)"}),
    ("--api-key", "api_keys", {"action": "append", "help": "accepted API key (repeatable)"}),
    (
        "--driver",
        "drivers",
        {
            "action": "append",
            "help": "dummy or torch (started and supervised; its own arguments may follow: "
            "'torch --device cuda:1'), unix:PATH or tcp:HOST:PORT; repeat for replicas",
        },
    ),
    ("--driver-arg", "driver_args", {"action": "append", "help": "one option for the driver process (repeatable)"}),
    ("--model", "model", {"help": "the torch driver's model: smollm2 (default), a .gguf file or a HF directory"}),
    ("--served-model-name", "served_model_name", {"help": "model id in the API (default: the driver's)"}),
    ("--speculation-depth", "speculation_depth", {"type": int, "help": "pre-fired decode steps (default 1; 0 off)"}),
    (
        "--max-decode-steps",
        "max_decode_steps",
        {"type": int, "help": "decode steps per pass of host-side generation (default 16; 1 off)"},
    ),
    (
        "--multi-step-budget-ms",
        "multi_step_budget_ms",
        {"type": float, "help": "how long one multi-step pass may hold the device (default 25; 0: one step)"},
    ),
    (
        "--prefix-match-unit",
        "prefix_match_unit",
        {"type": int, "help": "prefix reuse in whole pages of this size: the driver's page size (default 0: off)"},
    ),
    ("--max-concurrent-runs", "max_concurrent_runs", {"type": int, "help": "runs at once (default 64)"}),
    ("--run-memory-mib", "run_memory_mib", {"type": int, "help": "memory cap per run (default 256)"}),
    ("--run-timeout-s", "run_timeout_s", {"type": float, "help": "wall-clock budget per run (default 600)"}),
    ("--max-upload-bytes", "max_upload_bytes", {"type": int, "help": "largest inferlet upload"}),
    ("--max-request-bytes", "max_request_bytes", {"type": int, "help": "largest other request body"}),
    ("--data-dir", "data_dir", {"help": "where uploaded inferlets are kept"}),
    ("--log-level", "log_level", {"choices": LOG_LEVELS}),
    ("--log-format", "log_format", {"choices": LOG_FORMATS}),
)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_arg",
        nargs="?",
        metavar="MODEL",
        help="the model to serve: smollm2, a .gguf file or a Hugging Face directory (the same as --model; "
        "with no driver chosen, it implies --driver torch)",
    )
    parser.add_argument("--config", help="TOML configuration file (keys: see docs/operating.md)")
    for flag, key, options in _FLAGS:
        # A repeatable flag takes one item of its list key: --api-key API_KEY.
        metavar = None if "choices" in options else flag.removeprefix("--").replace("-", "_").upper()
        parser.add_argument(flag, dest=f"cfg_{key}", default=None, metavar=metavar, **options)


def config_of(ns: argparse.Namespace) -> DaemonConfig:
    """The daemon's configuration from `wafer serve`'s parsed command line (DaemonError if bad)."""
    flags = {name.removeprefix("cfg_"): value for name, value in vars(ns).items() if name.startswith("cfg_")}
    cache_dir = getattr(ns, "cache_dir", None)
    # `wafer --cache-dir` always has a value (its default); only a chosen one is a flag, so that
    # WAFER_CACHE_DIR and the file still apply otherwise.
    if cache_dir is not None and Path(cache_dir) != default_cache_dir():
        flags["cache_dir"] = str(cache_dir)
    if ns.model_arg is not None:
        if flags.get("model") not in (None, ns.model_arg):
            raise DaemonConfigError("model", f"two models: {ns.model_arg!r} and --model {flags['model']!r}")
        flags["model"] = ns.model_arg
    return load_config(flags, config_path=ns.config)


def cmd_serve(ns: argparse.Namespace) -> int:
    try:
        config = config_of(ns)
    except DaemonError as exc:
        print(f"wafer serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # Imported here: `wafer build` and `wafer run` need none of the HTTP stack.
    from host.daemon.server import serve

    try:
        serve(config)
    except DaemonError as exc:
        print(f"wafer serve: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def add_serve_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `wafer serve` beside the other subcommands (host/cli/commands.py calls this)."""
    parser = subparsers.add_parser("serve", help="run the daemon: OpenAI-compatible API and inferlet runs over HTTP")
    add_serve_arguments(parser)
    parser.set_defaults(func=cmd_serve)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m host.daemon [flags]`: the same as `wafer serve [flags]`."""
    parser = argparse.ArgumentParser(prog="python -m host.daemon", description="wafer's daemon")
    parser.add_argument("--cache-dir", default=None, help="where built and compiled inferlets are kept")
    add_serve_arguments(parser)
    return cmd_serve(parser.parse_args(argv))
