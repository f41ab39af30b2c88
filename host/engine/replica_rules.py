"""What replicas must agree on, and how their answers become one (host.engine.replicas): the
model check, their counters and page pools summed, a group's answers in its order.
Knows nothing of placement or of how replicas are started."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from bridge_schema.messages import Handshake
from host.errors import HostError

if TYPE_CHECKING:
    from host.services import PassResult

_MUST_EQUAL = ("model_name", "vocab_size", "page_size", "tokenizer_kind", "tokenizer_data", "chat_template")


def disagreement(first: Handshake, other: Handshake) -> str:
    """What makes `other` unfit to serve beside `first` (another model, vocabulary, page size,
    tokenizer or stop tokens), or "" when nothing does."""
    for name in _MUST_EQUAL:
        mine, theirs = getattr(first, name), getattr(other, name)
        if mine != theirs:
            short = len(str(theirs)) + len(str(mine)) < 200
            shown = f"{name} {theirs!r} where the first replica serves {mine!r}" if short else f"another {name}"
            return f"serves {shown}: every replica must serve the same model"
    for name in ("stop_token_ids", "control_token_ids"):
        if list(getattr(first, name)) != list(getattr(other, name)):
            return f"has other {name} than the first replica: every replica must serve the same model"
    return ""


def summed(dicts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Counters of every replica added up, key by key."""
    out: dict[str, int] = {}
    for d in dicts:
        for key, value in d.items():
            out[key] = out.get(key, 0) + value
    return out


def in_group_order(
    refused: Sequence[HostError | None], answers: Iterable[PassResult | HostError]
) -> list[PassResult | HostError]:
    """A group's results in its order: where `refused` holds an error (a pass never sent), that
    error; elsewhere the replica's next answer."""
    it = iter(answers)
    return [why if why is not None else next(it) for why in refused]
