"""Limits and locations of the sandbox, built once at the edge and passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/wafer`, else `~/.cache/wafer`."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "wafer"


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """Per-run limits. `inactivity_timeout_s` bounds guest time between two host calls (the epoch
    watchdog); `wall_budget_s` bounds the whole run, host calls included; `max_output_bytes`
    bounds what the run emits and sends (UTF-8 bytes, together), `max_inbound_bytes` the client
    messages waiting for it: the host keeps both, outside the guest's memory cap."""

    cache_dir: Path
    memory_limit_bytes: int = 256 * MIB
    inactivity_timeout_s: float = 5.0
    wall_budget_s: float = 600.0
    epoch_tick_s: float = 0.01
    max_output_bytes: int = 64 * MIB
    max_inbound_bytes: int = 16 * MIB
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

    @property
    def compiled_dir(self) -> Path:
        return self.cache_dir / "compiled"

    def ticks(self, seconds: float) -> int:
        """`seconds` as a whole number of epoch ticks (at least one)."""
        return max(1, int(seconds / self.epoch_tick_s + 0.999))
