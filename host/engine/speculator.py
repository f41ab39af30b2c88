"""The pass-level speculator (pure): which finished decode steps to pre-fire, and whether an
inferlet's next request may be served by a pre-fired ("staged") entry.

One table of request features, `RULES`, decides both sides: `evaluate_request_shape` (producer:
may we stage *from* this request?) and `entry_matches_request` (consumer: may a staged entry
*serve* this request?). A staged fire is built with an empty constraint surface, so a request
carrying any constraint (logit mask, grammar, attention mask, probes, ...) is never served by one.
Knows nothing about threads, the bridge or the clock.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bridge_schema.batch import OutputSpec, Sampler
from bridge_schema.messages import Probe


@dataclass(frozen=True, slots=True)
class RequestShape:
    """The features of one forward request that speculation cares about."""

    tokens: tuple[int, ...]
    position: int  # position of the first input token (explicit, or the context's length)
    outputs: tuple[OutputSpec, ...]
    adapter_id: int = -1
    has_grammar: bool = False
    has_attention_mask: bool = False
    explicit_positions_contiguous: bool = True  # False if explicit positions skip or repeat
    steps: int = 1  # decode steps of a multi-step request


@dataclass(frozen=True, slots=True)
class Rule:
    """A feature that forbids speculation: `applies(shape)` True means "not from, not served"."""

    reason: str
    applies: Callable[[RequestShape], bool]


def _one_sampler_on_last_row(s: RequestShape) -> bool:
    return len(s.outputs) == 1 and s.outputs[0].row == len(s.tokens) - 1


RULES: tuple[Rule, ...] = (
    Rule("logit_mask", lambda s: any(o.logit_mask is not None for o in s.outputs)),
    Rule("grammar", lambda s: s.has_grammar),
    Rule("attention_mask", lambda s: s.has_attention_mask),
    Rule("multi_token", lambda s: len(s.tokens) != 1),
    Rule("sampler_shape", lambda s: not _one_sampler_on_last_row(s)),
    Rule("probes", lambda s: any(o.probe != Probe.NONE for o in s.outputs)),
    Rule("positions", lambda s: not s.explicit_positions_contiguous),
    Rule("multi_step", lambda s: s.steps != 1),
)


def evaluate_request_shape(shape: RequestShape) -> str | None:
    """Producer side: None if a decode step may be staged after this request, else the reason."""
    for rule in RULES:
        if rule.applies(shape):
            return rule.reason
    return None


@dataclass(frozen=True, slots=True)
class StagedEntry:
    """A pre-fired single-token decode: `anchor` at `position`, sampled with `sampler`.

    `anchor` is None while the pass it follows is still in flight (the driver fills the token in
    itself, see `Forward.deferred`); an unresolved entry matches no request."""

    context_id: int
    anchor: int | None
    position: int
    sampler: Sampler
    adapter_id: int


# Fields a staged entry must equal, beyond passing every rule: (reason, entry value, request value).
MATCH_FIELDS: tuple[tuple[str, Callable[[StagedEntry], object], Callable[[RequestShape], object]], ...] = (
    ("anchor", lambda e: e.anchor, lambda s: s.tokens[0]),
    ("position", lambda e: e.position, lambda s: s.position),
    ("sampler", lambda e: e.sampler, lambda s: s.outputs[0].sampler),
    ("adapter", lambda e: e.adapter_id, lambda s: s.adapter_id),
)


def entry_matches_request(entry: StagedEntry, shape: RequestShape) -> str | None:
    """Consumer side: None if `entry` may serve `shape`, else the reason it may not."""
    reason = evaluate_request_shape(shape)
    if reason is not None:
        return reason
    for name, of_entry, of_request in MATCH_FIELDS:
        if of_entry(entry) != of_request(shape):
            return f"{name}_mismatch"
    return None


def next_entry(context_id: int, shape: RequestShape, sampled_token: int | None) -> StagedEntry:
    """The decode step that follows `shape` once it sampled `sampled_token`."""
    return StagedEntry(
        context_id=context_id,
        anchor=sampled_token,
        position=shape.position + len(shape.tokens),
        sampler=shape.outputs[-1].sampler,
        adapter_id=shape.adapter_id,
    )


@dataclass
class Speculator:
    """Chains of staged entries per context, at most `depth` long (0 disables speculation)."""

    depth: int = 1
    chains: dict[int, deque[StagedEntry]] = field(default_factory=dict)
    hits: int = 0
    misses: Counter[str] = field(default_factory=Counter)
    skips: Counter[str] = field(default_factory=Counter)

    def stage_after(self, context_id: int, shape: RequestShape, sampled_token: int | None) -> StagedEntry | None:
        """Producer: after `shape` (served cold or staged) sampled `sampled_token` (None: not
        back yet), the entry to pre-fire, or None (speculation off, the context's chain already
        continues past this request, or the request's shape forbids it)."""
        if self.depth <= 0:
            return None
        reason = evaluate_request_shape(shape)
        if reason is not None:
            self.skips[reason] += 1
            return None
        chain = self.chains.setdefault(context_id, deque())
        if chain:
            return None
        entry = next_entry(context_id, shape, sampled_token)
        chain.append(entry)
        return entry

    def stage_from_entry(self, entry: StagedEntry, sampled_token: int | None) -> StagedEntry | None:
        """Producer, deeper chains: extend a context's chain from its last staged entry, whose
        own sampled token is `sampled_token` (None: not back yet)."""
        chain = self.chains.get(entry.context_id)
        if not chain or chain[-1] is not entry or len(chain) >= self.depth:
            return None
        nxt = StagedEntry(entry.context_id, sampled_token, entry.position + 1, entry.sampler, entry.adapter_id)
        chain.append(nxt)
        return nxt

    def resolve(self, entry: StagedEntry, anchor: int) -> StagedEntry | None:
        """The pass `entry` follows sampled `anchor`: the entry with it filled in (it replaces
        `entry` in its chain), or None if `entry` is no longer staged."""
        chain = self.chains.get(entry.context_id, deque())
        for i, staged in enumerate(chain):
            if staged is entry:
                chain[i] = resolved = StagedEntry(
                    entry.context_id, anchor, entry.position, entry.sampler, entry.adapter_id
                )
                return resolved
        return None

    def take(self, context_id: int, shape: RequestShape) -> StagedEntry | None:
        """Consumer: the entry that serves `shape` (removed from its chain), or None, in which
        case the context's whole chain is discarded and the request goes the cold path."""
        chain = self.chains.get(context_id)
        if not chain:
            return None
        reason = entry_matches_request(chain[0], shape)
        if reason is None:
            self.hits += 1
            return chain.popleft()
        self.misses[reason] += 1
        self.invalidate(context_id)
        return None

    def invalidate(self, context_id: int) -> list[StagedEntry]:
        """Drop a context's chain (truncate, fork, release, cancel, run end); returns it."""
        return list(self.chains.pop(context_id, ()))

    def staged(self, context_id: int) -> Sequence[StagedEntry]:
        return tuple(self.chains.get(context_id, ()))
