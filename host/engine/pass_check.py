"""Checks a forward pass where it enters the host, against the driver's handshake.

A pass that passes never gets an error reply for its shape or ranges, and always fits an empty
driver pass (so the scheduler never holds one it cannot place). Knows nothing of pages or runs.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from bridge_schema.batch import OutputSpec, Sampler, logit_mask_words
from bridge_schema.messages import MAX_DECODE_STEPS, SAMPLER_CHAIN, Handshake, Probe, SamplerKind
from host.engine.attention_masks import attends_within, window_rows
from host.engine.pages import HOLE
from host.engine.passes import Pass
from host.errors import InvalidRequest
from host.services import PassRequest


def _bounds(values: npt.NDArray[np.int64]) -> tuple[int, int]:
    """The least and the greatest value: in Python for a few (a decode step's one token), where
    two numpy reductions cost more than the list."""
    if len(values) <= 16:
        items = values.tolist()
        return min(items), max(items)
    return int(values.min()), int(values.max())


# The most logit-bias entries one output row may carry (OpenAI's and vLLM's limit is 300).
MAX_LOGIT_BIAS = 1024


def _check_chain(s: Sampler, h: Handshake) -> None:
    """The sampler chain's stages: a driver that runs them, finite values, a repetition penalty
    > 0, a bias of distinct tokens of the vocabulary in rising order, DRY's breakers tokens of it."""
    if SAMPLER_CHAIN not in h.capabilities:
        raise InvalidRequest(f"the {h.driver_kind} driver does not run sampler chains (penalties, logit bias, filters)")
    penalties = (s.repetition_penalty, s.presence_penalty, s.frequency_penalty)
    if not all(math.isfinite(p) for p in penalties) or not s.repetition_penalty > 0:
        raise InvalidRequest("penalties must be finite, and the repetition penalty > 0 (1 = off)")
    if min(s.penalty_from, s.repetition_from, s.penalty_last_n) < 0:
        raise InvalidRequest("penalty windows (from slots, last n) must be >= 0")
    if not (
        0 < s.typical_p <= 1
        and 0 <= s.top_n_sigma < math.inf
        and 0 <= s.xtc_probability <= 1
        and 0 <= s.xtc_threshold <= 1
        and 0 <= s.mirostat_tau < math.inf
        and 0 <= s.mirostat_eta <= 1
    ):
        raise InvalidRequest(
            "filters out of range: typical_p in (0, 1], top_n_sigma >= 0, xtc in [0, 1], "
            "mirostat tau >= 0 and eta in [0, 1]"
        )
    if s.has_dry and not (
        0 <= s.dry_multiplier < math.inf
        and 1 <= s.dry_base < math.inf
        and s.dry_allowed_length >= 0
        and s.dry_last_n >= 0
        and len(s.dry_breakers) <= MAX_LOGIT_BIAS
        and all(0 <= t < h.vocab_size for t in s.dry_breakers)
    ):
        raise InvalidRequest(
            f"DRY out of range: multiplier >= 0, base >= 1, allowed length and last n >= 0, at most "
            f"{MAX_LOGIT_BIAS} breakers, each a token of [0, {h.vocab_size})"
        )
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"a logit bias has at most {MAX_LOGIT_BIAS} tokens, got {len(s.logit_bias)}")
    previous = -1
    for token, bias in s.logit_bias:
        if not previous < token < h.vocab_size or not math.isfinite(bias):
            raise InvalidRequest(
                f"a logit bias lists distinct tokens of [0, {h.vocab_size}) in rising order, with finite values"
            )
        previous = token


def check_request(request: PassRequest, kv_start: int, h: Handshake, adapters: set[int]) -> Pass:
    """Validate a pass where it enters the host, against the driver's handshake, so the driver
    never sees a request it must refuse (and the scheduler never holds one it cannot place)."""
    tokens = np.asarray(request.tokens, dtype=np.int64).reshape(-1)
    num = len(tokens)
    if num == 0:
        raise InvalidRequest("a forward pass needs at least one input token")
    low, high = _bounds(tokens)
    if low < 0 or high >= h.vocab_size:
        raise InvalidRequest(f"input token out of range [0, {h.vocab_size})")
    if request.positions is None:
        positions = np.arange(kv_start, kv_start + num, dtype=np.int64)
    else:
        positions = np.asarray(request.positions, dtype=np.int64).reshape(-1)
        if len(positions) != num:
            raise InvalidRequest(f"{len(positions)} positions given for {num} input tokens")
    low, high = _bounds(positions)
    if low < 0 or high >= h.max_context:
        raise InvalidRequest(f"position out of range [0, {h.max_context}) (the model's context length)")
    if request.adapter_id != -1 and request.adapter_id not in adapters:
        raise InvalidRequest(f"adapter {request.adapter_id} is not loaded by this run")
    outputs = tuple(request.outputs)
    words = logit_mask_words(h.vocab_size)
    row_words = [0] * num  # u32 mask words each row brings into a pass
    for i, o in enumerate(outputs):
        if not 0 <= o.row < num or (i and o.row <= outputs[i - 1].row):
            raise InvalidRequest(f"output rows must be strictly increasing and within the {num} input tokens")
        s = o.sampler
        if s.kind == SamplerKind.RANDOM and not s.temperature > 0:
            raise InvalidRequest("temperature must be > 0 for random sampling (use greedy for 0)")
        if not (0 < s.top_p <= 1 and 0 <= s.min_p < 1 and s.top_k >= 0 and s.seed >= -1):
            raise InvalidRequest("sampler out of range: top_p in (0, 1], min_p in [0, 1), top_k >= 0, seed >= -1")
        if s.has_chain:
            _check_chain(s, h)
        if not 0 <= o.probe_k <= h.max_probe_k:
            raise InvalidRequest(f"probe_k must be in [0, {h.max_probe_k}] (model_info().max_probe_k)")
        if o.score_token >= h.vocab_size or (o.score_token >= 0 and Probe.LOGPROBS not in o.probe):
            raise InvalidRequest(f"a scored token must be in [0, {h.vocab_size}) on a row with the logprobs probe")
        if o.logit_mask is not None:
            if len(o.logit_mask) != words:
                raise InvalidRequest(f"a logit mask has {words} words for a vocabulary of {h.vocab_size}")
            row_words[o.row] += words
    mask_rows = None
    if request.attention_window or request.attention_sinks:
        if request.mask_rows is not None:
            raise InvalidRequest("give explicit attention mask rows or a window, not both")
        if request.attention_window < 1 or request.attention_sinks < 0:
            raise InvalidRequest("an attention window covers at least 1 key, and sinks are >= 0")
        request = replace(
            request, mask_rows=window_rows(kv_start, num, request.attention_window, request.attention_sinks)
        )
    if request.mask_rows is not None:
        mask_rows = [[int(r) for r in row] for row in request.mask_rows]
        kv_len = kv_start + num
        if len(mask_rows) != num:
            raise InvalidRequest(f"{len(mask_rows)} attention mask rows for {num} input tokens")
        for i, row in enumerate(mask_rows):
            if any(r < 0 for r in row) or sum(row) != kv_len:
                raise InvalidRequest(f"attention mask row {i} must cover the pass's {kv_len} keys exactly")
            if not any(row[1::2]):  # runs alternate: masked, attended, masked, ...
                raise InvalidRequest(
                    f"attention mask row {i} attends to no key: each query must attend to at least one "
                    "(usually itself); its attention would be undefined"
                )
            row_words[i] += len(row)
    if h.max_mask_bytes and 4 * max(row_words) > h.max_mask_bytes:
        raise InvalidRequest(f"one row's masks exceed the driver's {h.max_mask_bytes} mask bytes per pass")
    steps = 1 if request.steps == 1 else _check_steps(request, positions, outputs, mask_rows, h)
    return Pass(
        tokens=tokens.astype(np.uint32),
        positions=positions.astype(np.uint32),
        outputs=outputs,
        mask_rows=mask_rows,
        adapter_id=request.adapter_id,
        has_grammar=request.has_grammar,
        steps=steps,
    )


def _check_steps(
    request: PassRequest,
    positions: npt.NDArray[np.int64],
    outputs: tuple[OutputSpec, ...],
    mask_rows: list[list[int]] | None,
    h: Handshake,
) -> int:
    """A multi-step request is plain decoding: the steps it may run (at least 1)."""
    if not 1 <= request.steps <= MAX_DECODE_STEPS:
        raise InvalidRequest(f"a request runs 1 to {MAX_DECODE_STEPS} decode steps")
    if len(positions) != 1 or len(outputs) != 1 or outputs[0].row != 0:
        raise InvalidRequest("a multi-step request has one input token and one output, on it")
    if outputs[0].probe != Probe.NONE or outputs[0].logit_mask is not None or mask_rows is not None:
        raise InvalidRequest("a multi-step request carries no probes, logit mask or attention mask")
    return min(request.steps, h.max_context - int(positions[0]))  # positions stay in the context


def check_holes_masked(checked: Pass, pages: tuple[int, ...], page_size: int) -> None:
    """A context with released pages (holes) may only run passes whose masks exclude them."""
    if checked.mask_rows is None:
        raise InvalidRequest(
            "this context released pages from its middle: its passes need an attention mask "
            "(e.g. a window with sinks) that excludes them"
        )
    for index, page in enumerate(pages):
        if page == HOLE and attends_within(checked.mask_rows, index * page_size, (index + 1) * page_size):
            raise InvalidRequest(f"the attention mask reaches into released page {index} of the context")
