"""The one protocol every driver implements; `drivers.serve` runs it behind the bridge.

Methods receive messages that already passed `bridge_schema` decoding (types, shapes, and ranges
against the driver's own handshake limits). They raise `drivers.errors.DriverError` subclasses
for requests they refuse; any other exception becomes an INTERNAL error reply.

Optionally, a driver that models a device queue sets an attribute `reply_at` (a
`time.perf_counter()` time, or None) in `forward`: the serve loop then sends that reply at that
time, never earlier (on Linux within microseconds: `drivers.timing.DueTimer`), from a writer
task, and meanwhile goes on reading and handling the frames behind it (the dummy driver's
simulated pass latency works this way).
"""

from __future__ import annotations

from typing import Protocol

from bridge_schema.messages import Adapter, Copy, Forward, ForwardResult, Handshake, Hello


class Driver(Protocol):
    def handshake(self, hello: Hello) -> Handshake:
        """Resolve the host's requested configuration (allocate page memory once) and describe it.
        Called once per connection; the limits it returns are used to validate later frames."""
        ...

    def forward(self, request: Forward) -> ForwardResult:
        """Run one batch and return one output entry per requested output row."""
        ...

    def copy(self, request: Copy) -> None:
        """Copy whole KV pages src -> dst."""
        ...

    def adapter(self, request: Adapter) -> None:
        """Load or unload a LoRA adapter."""
        ...

    def health(self) -> dict[str, int | float | str]:
        """Counters for the `HealthReply`."""
        ...
