"""Reading server-sent events from an httpx streaming response (for the run endpoints)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx


def events(response: httpx.Response) -> Iterator[tuple[str, Any]]:
    """(event name, parsed data) for each event; the name is "message" when none was given."""
    name, data = "message", []
    for line in response.iter_lines():
        if not line:
            if data:
                yield name, json.loads("\n".join(data))
            name, data = "message", []
        elif line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").strip())
