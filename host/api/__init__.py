"""Host side of the inferlet WIT world: one module per interface in `inferlets/wit/`.

Each module registers its functions on a Linker instance and translates WIT calls into
`host.services.Services` calls and WIT resources into ids. None of them knows about pages,
batching or the bridge.
"""

from __future__ import annotations

PACKAGE = "wafer:inferlet"
VERSION = "0.1.0"


def interface_name(name: str) -> str:
    """The fully qualified import name of interface `name`."""
    return f"{PACKAGE}/{name}@{VERSION}"
