"""Limits and locations of the sandbox, built once at the edge and passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

MIB = 1024 * 1024
# What one table slot (a function reference) takes in wasmtime, measured: 6 tables of 50 M slots
# took 2,347 MiB.
TABLE_ELEMENT_BYTES = 8


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/wafer`, else `~/.cache/wafer`."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "wafer"


@dataclass(frozen=True, slots=True)
class RunHostLimits:
    """What one run may make the host hold or write outside its memory cap (the daemon's
    `run_max_*` keys): the bytes `runtime.log` and its stdout and stderr may put in the host's
    log (each stream on its own), and through the grammar interface, the grammars (count and
    compiled bytes) and matchers it holds and the accepted tokens its matchers keep (0.05-1.5 kB
    each on xgrammar, measured: a run of 400,000 accepts and 80 forks took 2.1 GiB)."""

    log_bytes: int = 1 * MIB
    stdio_log_bytes: int = 1 * MIB
    grammars: int = 64
    grammar_bytes: int = 256 * MIB
    matchers: int = 256
    matcher_tokens: int = 131_072

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """Per-run limits. `inactivity_timeout_s` bounds guest time between two host calls (the epoch
    watchdog); `wall_budget_s` bounds the whole run, host calls included; `max_output_bytes`
    bounds what the run emits and sends (UTF-8 bytes, together), `max_inbound_bytes` the client
    messages waiting for it: the host keeps both, outside the guest's memory cap.

    `memory_limit_bytes` is the run's whole budget for wasm state: its one linear memory gets
    what its tables may not take (`max_tables` x `max_table_elements` slots of
    TABLE_ELEMENT_BYTES). wasmtime caps each memory, not a Store, so a run gets one memory:
    a component with eight of them took eight times the cap."""

    cache_dir: Path
    memory_limit_bytes: int = 256 * MIB
    inactivity_timeout_s: float = 5.0
    wall_budget_s: float = 600.0
    epoch_tick_s: float = 0.01
    max_output_bytes: int = 64 * MIB
    max_inbound_bytes: int = 16 * MIB
    # componentize-py's guests use 1 memory, 2 tables of about 5,700 slots and 14 core instances.
    max_memories: int = 1
    max_tables: int = 4
    max_table_elements: int = 1 << 17
    max_instances: int = 32
    host_limits: RunHostLimits = field(default_factory=RunHostLimits)
    # The sandbox's: runs of one group (an API key) computing in guest code at once (0: no limit;
    # runs started without a group are never limited). See `compute_share`.
    group_compute_slots: int = 0
    # With compute shared by group: after a host call that took c seconds of its thread's CPU
    # (c >= 2 ms), a run waits host_pacing * c for each other group with a live run (0: never).
    host_pacing: float = 1.0
    # The sandbox's, not a run's: compiled components kept loaded in memory (least recently used
    # dropped past it; `compile_cache.CompileCache`).
    max_loaded_component_bytes: int = 1024 * MIB
    # The writable memory a component's compile may take, in a child process (0: compile in this
    # process, unbounded). Measured: the 18 MB chat inferlet's compile peaked at about 430 MiB.
    compile_memory_bytes: int = 2048 * MIB

    def __post_init__(self) -> None:
        # componentize-py's CPython needs about 12.3 MiB before running a line of user code.
        if self.memory_limit_bytes < 16 * MIB:
            raise ValueError(f"memory_limit_bytes must be at least 16 MiB, got {self.memory_limit_bytes}")
        if self.inactivity_timeout_s <= 0 or self.wall_budget_s <= 0 or self.epoch_tick_s <= 0:
            raise ValueError("timeouts and the epoch tick must be positive")
        if self.max_output_bytes <= 0 or self.max_inbound_bytes <= 0:
            raise ValueError("max_output_bytes and max_inbound_bytes must be positive")
        if self.host_pacing < 0:
            raise ValueError(f"host_pacing must be >= 0, got {self.host_pacing}")
        if self.group_compute_slots < 0:
            raise ValueError(f"group_compute_slots must be >= 0, got {self.group_compute_slots}")
        if min(self.max_memories, self.max_tables, self.max_table_elements, self.max_instances) < 1:
            raise ValueError("max_memories, max_tables, max_table_elements and max_instances must be at least 1")
        if self.memory_limit_bytes - self.table_bytes < 16 * MIB:
            raise ValueError(
                f"memory_limit_bytes leaves under 16 MiB of linear memory once the tables' "
                f"{self.table_bytes // MIB} MiB are set aside"
            )

    @property
    def table_bytes(self) -> int:
        """The most a run's tables may take, set aside from its memory budget."""
        return self.max_tables * self.max_table_elements * TABLE_ELEMENT_BYTES

    @property
    def linear_memory_bytes(self) -> int:
        """The cap on each of a run's linear memories: the budget less its tables' share, split
        between the memories it may have."""
        return (self.memory_limit_bytes - self.table_bytes) // self.max_memories

    @property
    def compiled_dir(self) -> Path:
        return self.cache_dir / "compiled"

    def ticks(self, seconds: float) -> int:
        """`seconds` as a whole number of epoch ticks (at least one)."""
        return max(1, int(seconds / self.epoch_tick_s + 0.999))
