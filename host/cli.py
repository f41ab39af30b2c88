"""The `wafer` command line: `wafer build DIR`, `wafer run NAME_OR_PATH [--driver ...] -- ARGS`.

Subcommands register through `add_subcommands`, so the daemon can add `serve` beside these.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from host.build import BuildError, build, resolve_inferlet, rewrite_guest_paths, write_bindings
from host.daemon.cli import add_serve_command
from host.errors import HostError
from host.sandbox import BufferedRunIO, RunStatus, Sandbox, SandboxConfig, SandboxError
from host.sandbox.config import MIB, default_cache_dir

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _progress(message: str) -> None:
    print(f"wafer: {message}", file=sys.stderr, flush=True)


def _quiet(_message: str) -> None:
    pass


def cmd_build(ns: argparse.Namespace) -> int:
    try:
        if ns.bindings is not None:
            _progress(f"guest bindings written to {write_bindings(ns.bindings)}")
        result = build(ns.dir, ns.cache_dir, _progress, force=ns.force, snapshot=ns.snapshot)
        if ns.compile:  # now, with progress, rather than silently at the first run
            _compile_for_this_machine(result.wasm_path, ns.cache_dir)
    except (BuildError, SandboxError) as exc:
        print(f"wafer: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(result.wasm_path)
    return EXIT_OK


def _compile_for_this_machine(wasm_path: Path, cache_dir: Path) -> None:
    from host.sandbox.compile_cache import CompileCache
    from host.sandbox.engine import new_engine

    CompileCache(new_engine(), SandboxConfig(cache_dir=cache_dir).compiled_dir).load(wasm_path, _progress)


def _component_path(ns: argparse.Namespace) -> tuple[Path, Path | None]:
    """The component to run, and the inferlet folder it was built from (if it was)."""
    target = Path(ns.inferlet)
    if target.suffix == ".wasm" and target.is_file():
        return target, None
    result = build(
        ns.inferlet, ns.cache_dir, _progress if ns.verbose else _quiet, snapshot=ns.snapshot, slow=_progress
    )
    return result.wasm_path, resolve_inferlet(ns.inferlet)


def cmd_run(ns: argparse.Namespace) -> int:
    # Imported here: the engine pulls in the bridge and anyio, which `wafer build` does not need.
    from host.engine import Engine

    args: list[str] = ns.inferlet_args
    try:
        wasm_path, source_dir = _component_path(ns)
    except BuildError as exc:
        print(f"wafer: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    config = SandboxConfig(
        cache_dir=ns.cache_dir,
        memory_limit_bytes=ns.memory_mib * MIB,
        inactivity_timeout_s=ns.watchdog_s,
        wall_budget_s=ns.timeout_s,
    )

    def write(chunk: str) -> None:
        sys.stdout.write(chunk)
        sys.stdout.flush()

    def show_sent(message: str) -> None:
        sys.stderr.write(f"wafer: send: {message}\n")
        sys.stderr.flush()

    io = BufferedRunIO(on_chunk=write, on_send=show_sent)

    try:
        engine_start = Engine.start(
            driver=ns.driver,
            driver_args=ns.driver_arg,
            speculation_depth=ns.speculation_depth,
            max_decode_steps=ns.max_decode_steps,
            adapter_dir=ns.adapter_dir,
        )
        with Sandbox(config) as sandbox, engine_start as engine:
            component = sandbox.load(wasm_path, _progress)
            handle = sandbox.start(component, engine, args, io=io)
            if ns.stdin:
                _feed_stdin(io)
            try:
                outcome = handle.wait()
            except KeyboardInterrupt:
                handle.cancel()
                handle.wait()
                print("\nwafer: cancelled", file=sys.stderr)
                return EXIT_INTERRUPTED
    except (SandboxError, HostError, ValueError) as exc:
        print(f"wafer: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if outcome.output and not outcome.output.endswith("\n"):
        sys.stdout.write("\n")
    if outcome.status is not RunStatus.OK:
        error = outcome.error or ""
        if source_dir is not None:
            error = rewrite_guest_paths(error, source_dir)
        print(f"wafer: run {outcome.run_id} {outcome.status.value}: {error}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _feed_stdin(io: BufferedRunIO) -> None:
    """Each line of stdin becomes a message `receive()` returns (without its newline); end of
    input closes the client side, so `receive()` then returns None. A daemon thread: a run that
    ends before stdin does is not held up by it."""

    def feed() -> None:
        try:
            for line in sys.stdin:
                try:
                    io.push(line[:-1] if line.endswith("\n") else line)
                except SandboxError as exc:  # the inbox is full: this line is dropped
                    print(f"wafer: stdin: {exc}", file=sys.stderr)
        except (OSError, ValueError):  # stdin closed or unreadable
            pass
        io.close()

    threading.Thread(target=feed, name="wafer-stdin", daemon=True).start()


_SNAPSHOT_HELP = (
    "build a component of its own with the inferlet's modules imported at build time (about 10 s a build), "
    "instead of wafer's shared base plus the sources (a fraction of a second)"
)


def add_subcommands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p_build = subparsers.add_parser("build", help="build an inferlet folder into a component")
    p_build.add_argument("dir", help="inferlet folder (or the name of one under inferlets/)")
    p_build.add_argument("--force", action="store_true", help="rebuild even if a build is cached")
    p_build.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="do not compile the component for this machine now (the first run would)",
    )
    p_build.add_argument(
        "--bindings", type=Path, metavar="OUT_DIR", help="also write the generated guest bindings here (for editors)"
    )
    p_build.add_argument("--snapshot", action="store_true", help=_SNAPSHOT_HELP)
    p_build.set_defaults(func=cmd_build)

    p_run = subparsers.add_parser(
        "run",
        help="build (if needed) and run an inferlet, printing its output as it streams",
        usage="wafer run NAME_OR_PATH [options] -- ARGS...",
    )
    p_run.add_argument("inferlet", help="inferlet name, folder, or built .wasm component")
    p_run.add_argument(
        "--driver",
        default="dummy",
        help="dummy or torch (a subprocess), loopback (in-process), unix:PATH or tcp:HOST:PORT (default: dummy)",
    )
    p_run.add_argument(
        "--driver-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for the driver process, repeatable (e.g. --driver-arg=--model --driver-arg=smollm2)",
    )
    p_run.add_argument(
        "--speculation-depth", type=int, default=1, help="pre-fired decode steps per context, 0 = off (default: 1)"
    )
    p_run.add_argument(
        "--max-decode-steps",
        type=int,
        default=16,
        help="decode steps per pass of host-side generation while passes are short, 1 = off (default: 16)",
    )
    p_run.add_argument(
        "--adapter-dir",
        default="",
        help="where LoRA adapter names are resolved, on the driver's machine (default: adapters off)",
    )
    p_run.add_argument("--memory-mib", type=int, default=256, help="guest memory cap (default: 256)")
    p_run.add_argument("--timeout-s", type=float, default=600.0, help="wall-clock budget of the run")
    p_run.add_argument("--watchdog-s", type=float, default=5.0, help="max guest time between host calls")
    p_run.add_argument(
        "--no-stdin",
        dest="stdin",
        action="store_false",
        help="do not feed stdin lines to receive() (by default each line is a message; end of input closes)",
    )
    p_run.add_argument("-v", "--verbose", action="store_true", help="show build progress and host logs")
    p_run.add_argument("--snapshot", action="store_true", help=_SNAPSHOT_HELP)
    p_run.set_defaults(func=cmd_run)


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction[argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="wafer", description="wafer: a programmable LLM inference host")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="where built and compiled inferlets are kept (default: $XDG_CACHE_HOME/wafer or ~/.cache/wafer)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_subcommands(subparsers)
    add_serve_command(subparsers)
    return parser, subparsers


def main(argv: Sequence[str] | None = None) -> int:
    parser, _ = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` belongs to the inferlet, options included.
    split = argv.index("--") if "--" in argv else len(argv)
    ns = parser.parse_args(argv[:split])
    ns.inferlet_args = argv[split + 1 :]
    logging.basicConfig(
        level=logging.INFO if getattr(ns, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        code: int = ns.func(ns)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return code


if __name__ == "__main__":
    sys.exit(main())
