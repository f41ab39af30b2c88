"""The `wafer` command line: `wafer build DIR`, `wafer run NAME_OR_PATH [--driver ...] -- ARGS`.

Subcommands register through `add_subcommands`, so the daemon can add `serve` beside these.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from host.build import BuildError, build, resolve_inferlet, rewrite_guest_paths, write_bindings
from host.cli import dev_loop
from host.daemon.cli import add_serve_command
from host.engine.config import MULTI_STEP_BUDGET_MS
from host.errors import HostError
from host.sandbox import BufferedRunIO, RunOutcome, RunStatus, Sandbox, SandboxConfig, SandboxError
from host.sandbox.config import MIB, default_cache_dir

if TYPE_CHECKING:
    from host.cli.dev_engines import DevEngines

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
    from host.sandbox.wasm_engine import new_engine

    CompileCache(new_engine(), SandboxConfig(cache_dir=cache_dir).compiled_dir).load(wasm_path, _progress)


def _component_path(ns: argparse.Namespace) -> tuple[Path, Path | None]:
    """The component to run, and the inferlet folder it was built from (if it was)."""
    target = Path(ns.inferlet)
    if target.suffix == ".wasm" and target.is_file():
        return target, None
    result = build(ns.inferlet, ns.cache_dir, _progress if ns.verbose else _quiet, snapshot=ns.snapshot, slow=_progress)
    return result.wasm_path, resolve_inferlet(ns.inferlet)


def _sandbox_config(ns: argparse.Namespace) -> SandboxConfig:
    return SandboxConfig(
        cache_dir=ns.cache_dir,
        memory_limit_bytes=ns.memory_mib * MIB,
        inactivity_timeout_s=ns.watchdog_s,
        wall_budget_s=ns.timeout_s,
    )


def _console_io() -> BufferedRunIO:
    """Output to stdout as it streams; each `send()` to stderr, marked."""

    def write(chunk: str) -> None:
        sys.stdout.write(chunk)
        sys.stdout.flush()

    def show_sent(message: str) -> None:
        sys.stderr.write(f"wafer: send: {message}\n")
        sys.stderr.flush()

    return BufferedRunIO(on_chunk=write, on_send=show_sent)


def _report(outcome: RunOutcome, source_dir: Path | None) -> int:
    """End the output's line; say how a run that did not end well ended (paths in its
    traceback mapped back to the inferlet's files). The exit code."""
    if outcome.output and not outcome.output.endswith("\n"):
        sys.stdout.write("\n")
        sys.stdout.flush()
    if outcome.status is RunStatus.OK:
        return EXIT_OK
    error = outcome.error or ""
    if source_dir is not None:
        error = rewrite_guest_paths(error, source_dir)
    print(f"wafer: run {outcome.run_id} {outcome.status.value}: {error}", file=sys.stderr)
    return EXIT_FAILED


def cmd_run(ns: argparse.Namespace) -> int:
    from host.cli.cli_engines import start_engine  # the engine, which `wafer build` does not need

    try:
        wasm_path, source_dir = _component_path(ns)
    except BuildError as exc:
        print(f"wafer: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    io = _console_io()
    try:
        with Sandbox(_sandbox_config(ns)) as sandbox, start_engine(ns, _progress) as engine:
            component = sandbox.load(wasm_path, _progress)
            handle = sandbox.start(component, engine, ns.inferlet_args, io=io)
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
    return _report(outcome, source_dir)


def cmd_dev(ns: argparse.Namespace) -> int:
    """Run the inferlet, then again after every change to its files, on the same drivers (each
    lost one restarted before the next run)."""
    try:
        folder = resolve_inferlet(ns.inferlet)
    except BuildError as exc:
        print(f"wafer: error: {exc}", file=sys.stderr)
        return EXIT_FAILED

    def once(changed: Callable[[], bool], sandbox: Sandbox, engines: DevEngines) -> None:
        try:
            result = build(str(folder), ns.cache_dir, _quiet, snapshot=ns.snapshot, slow=_progress)
            loaded = sandbox.load(result.wasm_path, _progress)
        except (BuildError, SandboxError) as exc:
            print(f"wafer: error: {exc}", file=sys.stderr)
            return
        engine = engines.for_next_run()  # a driver lost since the last run is restarted first
        if engine is None:
            print("wafer: error: no model driver is up; trying again at the next change", file=sys.stderr)
            return
        io = _console_io()
        io.close()  # no client: receive() returns None
        handle = sandbox.start(loaded, engine, ns.inferlet_args, io=io)
        while not handle.is_done:
            if changed():
                handle.cancel()
                _progress("changed while running: cancelled")
            try:
                handle.wait(dev_loop.POLL_S)
            except TimeoutError:
                continue
        _report(handle.wait(), folder)

    from host.cli.cli_engines import engine_configs, fresh_configs  # the engine: `wafer build` needs none
    from host.cli.dev_engines import DevEngines

    try:
        configs = engine_configs(ns, _progress)
        with (
            Sandbox(_sandbox_config(ns)) as sandbox,
            DevEngines.start(configs, _progress, fresh_configs(ns, configs)) as engines,
        ):
            dev_loop.watch(folder, lambda changed: once(changed, sandbox, engines), _progress)
    except KeyboardInterrupt:
        print("\nwafer: dev stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (SandboxError, HostError, ValueError) as exc:
        print(f"wafer: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_driver(ns: argparse.Namespace) -> int:
    from host.cli import kept_drivers
    from host.driver_link import BUILTIN_DRIVERS

    try:
        if ns.action == "status":
            kept = kept_drivers.list_kept(ns.cache_dir)
            for k in kept:
                print(f"{k.name}\tpid {k.pid}\t{k.address}\targs {list(k.args)}\tlog {k.log_path}")
            if not kept:
                print("no kept drivers", file=sys.stderr)
            return EXIT_OK
        if ns.name not in BUILTIN_DRIVERS:
            print(f"wafer: error: unknown driver {ns.name!r}: use one of {', '.join(BUILTIN_DRIVERS)}", file=sys.stderr)
            return EXIT_USAGE
        if ns.action == "start":
            started = kept_drivers.start(
                ns.cache_dir, ns.name, f"drivers.{ns.name}", ns.inferlet_args, _progress, ns.timeout_s
            )
            _progress(f"the {ns.name} driver is kept at {started.address}: `wafer run --driver {ns.name}` uses it")
            return EXIT_OK
        stopped = kept_drivers.stop(ns.cache_dir, ns.name)
        said = f"stopped the kept {ns.name} driver (pid {stopped.pid})" if stopped else f"no {ns.name} driver is kept"
        _progress(said)
        return EXIT_OK
    except HostError as exc:
        print(f"wafer: error: {exc}", file=sys.stderr)
        return EXIT_FAILED


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


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inferlet", help="inferlet name, folder, or built .wasm component")
    parser.add_argument(
        "--driver",
        action="append",
        help="dummy or torch (a subprocess), loopback (in-process), unix:PATH or tcp:HOST:PORT (default: dummy); "
        "repeated: one replica per driver; a subprocess may carry its own arguments: "
        "'torch --device cuda:1' (docs/operating.md)",
    )
    parser.add_argument(
        "--driver-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for the driver process, repeatable (e.g. --driver-arg=--model --driver-arg=smollm2)",
    )
    parser.add_argument(
        "--model",
        default="",
        help="the torch driver's model: smollm2, a .gguf file or a Hugging Face directory "
        "(with no --driver, it implies --driver torch)",
    )
    parser.add_argument(
        "--speculation-depth", type=int, default=1, help="pre-fired decode steps per context, 0 = off (default: 1)"
    )
    parser.add_argument(
        "--max-decode-steps",
        type=int,
        default=16,
        help="decode steps per pass of host-side generation while passes are short, 1 = off (default: 16)",
    )
    parser.add_argument(
        "--multi-step-budget-ms",
        type=float,
        default=MULTI_STEP_BUDGET_MS,
        help="how long one multi-step pass may hold the device, 0 = one step (default: 25)",
    )
    parser.add_argument(
        "--adapter-dir",
        default="",
        help="where LoRA adapter names are resolved, on the driver's machine (default: adapters off)",
    )
    parser.add_argument("--memory-mib", type=int, default=256, help="guest memory cap (default: 256)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="wall-clock budget of the run")
    parser.add_argument("--watchdog-s", type=float, default=5.0, help="max guest time between host calls")
    parser.add_argument("-v", "--verbose", action="store_true", help="show build progress and host logs")
    parser.add_argument("--snapshot", action="store_true", help=_SNAPSHOT_HELP)
    parser.add_argument(
        "--fresh-driver",
        dest="kept",
        action="store_false",
        help="start a driver for this run even if one is kept (`wafer driver start`)",
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
    _add_run_options(p_run)
    p_run.add_argument(
        "--no-stdin",
        dest="stdin",
        action="store_false",
        help="do not feed stdin lines to receive() (by default each line is a message; end of input closes)",
    )
    p_run.set_defaults(func=cmd_run)

    p_dev = subparsers.add_parser(
        "dev",
        help="run an inferlet, then rebuild and run it again whenever one of its files changes",
        usage="wafer dev NAME_OR_PATH [options] -- ARGS...",
    )
    _add_run_options(p_dev)
    p_dev.set_defaults(func=cmd_dev)

    p_driver = subparsers.add_parser(
        "driver",
        help="keep a driver running for later runs (start, stop, status)",
        usage="wafer driver {start,stop,status} [NAME] [--timeout-s S] [-- DRIVER_ARGS...]",
    )
    p_driver.add_argument("action", choices=("start", "stop", "status"))
    p_driver.add_argument("name", nargs="?", default="torch", help="dummy or torch (default: torch)")
    p_driver.add_argument("--timeout-s", type=float, default=600.0, help="how long start waits for it to listen")
    p_driver.set_defaults(func=cmd_driver)


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
