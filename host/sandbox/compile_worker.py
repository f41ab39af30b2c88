"""Compiling a component in a child process, under a memory limit: `python -m
host.sandbox.compile_worker WASM OUT LIMIT_BYTES` writes the compiled component to OUT.

A compile of an 18 MB component takes hundreds of MiB for tens of seconds, and the allocator
keeps much of it after: in a child, the host's own memory never grows with an upload, and a
component too costly to compile fails there (its writable memory capped by RLIMIT_DATA) instead
of taking the host down. The child builds the same engine (`host.sandbox.wasm_engine.new_engine`), so
the host deserializes what it wrote.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

# The child reports a failure on stderr as one line starting with this; anything else it prints
# (a crash, the allocator's abort) is reported as the memory limit when it died of it.
_ERROR = "compile-error: "
EXIT_INVALID = 3  # the file is not a valid component
EXIT_NO_MEMORY = 4


class CompileFailed(Exception):
    """`is_memory` tells an over-budget compile from an invalid component."""

    def __init__(self, message: str, is_memory: bool) -> None:
        super().__init__(message)
        self.is_memory = is_memory


def compile_in_child(wasm_path: Path, out_path: Path, limit_bytes: int, timeout_s: float = 600.0) -> None:
    """Compile `wasm_path` to `out_path` (written whole, or not at all) in a child process whose
    writable memory is capped at `limit_bytes`."""
    cmd = [sys.executable, "-m", "host.sandbox.compile_worker", str(wasm_path), str(out_path), str(limit_bytes)]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired:
        raise CompileFailed(f"compiling took longer than {timeout_s:g} s", is_memory=False) from None
    if done.returncode == 0:
        return
    lines = [line for line in done.stderr.splitlines() if line.startswith(_ERROR)]
    message = lines[-1][len(_ERROR) :] if lines else ""
    if done.returncode == EXIT_INVALID:
        raise CompileFailed(message or "not a valid component", is_memory=False)
    # Out of memory shows as a MemoryError (exit 4), an abort or a kill, depending on where the
    # allocation failed; anything else is a bug worth its own words.
    if done.returncode in (EXIT_NO_MEMORY, -6, -9, 134, 137) or "memory" in done.stderr.lower():
        raise CompileFailed(f"compiling it needs more than {limit_bytes / 2**20:g} MiB", is_memory=True)
    tail = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
    raise CompileFailed(f"the compile failed: {tail[0]}", is_memory=False)


def main(argv: list[str]) -> int:
    wasm_path, out_path, limit = Path(argv[0]), Path(argv[1]), int(argv[2])
    # Before importing wasmtime: its code and the interpreter's are mapped read-only, not
    # counted; the compiler's heap is.
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    try:
        import wasmtime
        from wasmtime.component import Component

        from host.app_bundle import BundleError, split_sources
        from host.sandbox.wasm_engine import new_engine

        try:
            component_bytes, _ = split_sources(wasm_path.read_bytes())  # the sources are not compiled
            component = Component(new_engine(), component_bytes)
        except BundleError as exc:
            print(_ERROR + str(exc)[:500], file=sys.stderr)
            return EXIT_INVALID
        except wasmtime.WasmtimeError as exc:
            text = " ".join(str(exc).split())
            print(_ERROR + text[:500], file=sys.stderr)
            return EXIT_NO_MEMORY if "out of memory" in text.lower() else EXIT_INVALID
        data = component.serialize()
    except MemoryError:
        print(_ERROR + "out of memory", file=sys.stderr)
        return EXIT_NO_MEMORY
    tmp = out_path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, out_path)  # atomic: concurrent writers leave one whole file
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
