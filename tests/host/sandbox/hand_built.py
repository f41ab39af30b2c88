"""Components written by hand in the component model's text format, as a hostile tenant would
build them (no componentize-py): any WASI version, many memories, big tables."""

from __future__ import annotations

from pathlib import Path

import wasmtime

PAGE_BYTES = 64 * 1024


def clock_sleeper(version: str, sleep_s: float) -> str:
    """Subscribes to `wasi:clocks/monotonic-clock@VERSION` for `sleep_s` and blocks on it."""
    return f"""
(component
  (import "wasi:io/poll@{version}" (instance $poll
    (export "pollable" (type (sub resource)))
    (export "[method]pollable.block" (func (param "self" (borrow 0))))
  ))
  (alias export $poll "pollable" (type $pollable))
  (import "wasi:clocks/monotonic-clock@{version}" (instance $clock
    (alias outer 1 $pollable (type $p))
    (export "pollable" (type $pe (eq $p)))
    (export "subscribe-duration" (func (param "when" u64) (result (own $pe))))
  ))
  (alias export $poll "[method]pollable.block" (func $block))
  (alias export $clock "subscribe-duration" (func $sub))
  (core func $block_lowered (canon lower (func $block)))
  (core func $sub_lowered (canon lower (func $sub)))
  (core module $m
    (import "host" "sub" (func $sub (param i64) (result i32)))
    (import "host" "block" (func $block (param i32)))
    (func (export "run")
      i64.const {int(sleep_s * 1e9)}
      call $sub
      call $block)
  )
  (core instance $host (export "sub" (func $sub_lowered)) (export "block" (func $block_lowered)))
  (core instance $i (instantiate $m (with "host" (instance $host))))
  (func (export "run") (canon lift (core func $i "run")))
)
"""


def _instances(module: str, count: int) -> str:
    """A component instantiating the core `module` `count` times (each runs its start function)."""
    instances = "\n".join(f"  (core instance $i{n} (instantiate $m))" for n in range(count))
    return f"""
(component
  (core module $m {module})
{instances}
  (core module $r (func (export "run")))
  (core instance $run (instantiate $r))
  (func (export "run") (canon lift (core func $run "run")))
)
"""


def many_memories(count: int, mib_each: int) -> str:
    """`count` core instances, each with a linear memory of `mib_each` MiB that it fills."""
    pages = mib_each * 1024 * 1024 // PAGE_BYTES
    module = f"""(memory {pages})
    (func $fill (memory.fill (i32.const 0) (i32.const 1) (i32.const {pages * PAGE_BYTES})))
    (start $fill)"""
    return _instances(module, count)


def many_tables(count: int, elements_each: int) -> str:
    """`count` core instances, each with a funcref table of `elements_each` slots it fills."""
    module = f"""(table {elements_each} funcref)
    (func $f)
    (elem declare func $f)
    (func $fill (table.fill 0 (i32.const 0) (ref.func $f) (i32.const {elements_each})))
    (start $fill)"""
    return _instances(module, count)


def many_instances(count: int) -> str:
    """`count` core instances of an empty module (besides the one that exports `run`)."""
    return _instances("(func)", count)


def importing(name: str) -> str:
    """A component that imports an instance `name` exporting nothing, and does nothing."""
    return f"""
(component
  (import "{name}" (instance))
  (core module $r (func (export "run")))
  (core instance $run (instantiate $r))
  (func (export "run") (canon lift (core func $run "run")))
)
"""


def write(text: str, path: Path) -> Path:
    path.write_bytes(wasmtime.wat2wasm(text))
    return path


def misdeclared_host_call(name: str) -> str:
    """Imports wafer's `NAME` from the inference interface as a function of no arguments that
    returns a u32 (the real one takes arguments), and calls it."""
    return f"""
(component
  (import "wafer:inferlet/inference@0.1.0" (instance $inf
    (export "{name}" (func (result u32)))
  ))
  (alias export $inf "{name}" (func $f))
  (core func $f_lowered (canon lower (func $f)))
  (core module $m
    (import "host" "f" (func $f (result i32)))
    (func (export "run") call $f drop)
  )
  (core instance $host (export "f" (func $f_lowered)))
  (core instance $i (instantiate $m (with "host" (instance $host))))
  (func (export "run") (canon lift (core func $i "run")))
)
"""
