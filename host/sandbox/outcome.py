"""How a run ended, as the sandbox reports it to whoever started it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RunStatus(enum.Enum):
    OK = "ok"
    GUEST_ERROR = "guest_error"  # the inferlet returned an error or raised
    TRAPPED = "trapped"  # wasm trap: unreachable, stack overflow, out of memory...
    TIMED_OUT = "timed_out"  # inactivity watchdog or wall-clock budget
    LIMIT_EXCEEDED = "limit_exceeded"  # a byte limit (output, messages): the error names it
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class RunOutcome:
    run_id: int
    status: RunStatus
    output: str
    error: str | None = None
    stderr: str = ""
    num_leaked_resources: int = 0
    # What the run still held when it ended, before the host freed it: contexts it had not
    # released and the KV pages they held (pages shared by forks once; 0 when the services
    # cannot tell).
    held_contexts: int = 0
    held_pages: int = 0

    @property
    def is_ok(self) -> bool:
        return self.status is RunStatus.OK
