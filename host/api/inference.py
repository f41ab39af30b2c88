"""`wafer:inferlet/inference`: the `forward-pass` resource, built up by the guest and executed
through `Services.forward`; its methods, `decode`, and their registration on a Linker.

The pass's state and how it runs are `forward_pass`'s; `generate`'s host loop is `generation`'s.
Issue [speculator] adds attention masks, logit masks and grammar matchers as further methods
that fill more fields of `PassBuilder`, passed on in `forward_pass.pass_request`
(`PassRequest.mask_rows`, `OutputSpec.logit_mask` already exist). `decode` stays the
unconstrained one-token step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt
import wasmtime
from wasmtime.component import LinkerInstance, Record, ResourceAny, ResourceHost, ResourceType

from bridge_schema.batch import OutputSpec, Sampler, pack_allowed
from bridge_schema.messages import Probe, SamplerKind
from host.api import adapter as adapter_api
from host.api import generation
from host.api import grammar as grammar_api
from host.api.forward_pass import (
    KIND,
    PassBuilder,
    pass_builder,
    run_group,
    run_group_records,
    run_pass,
    run_pass_records,
)
from host.api.host_call import borrowed_rep, handle_id, host_function
from host.api.host_call import field as rec_field
from host.sandbox import raw_calls
from host.sandbox.resources import ResourceKind
from host.sandbox.run_state import RunState, current, current_or_none

INTERFACE = "inference"
# The hot one-token decode goes through a raw ctypes callback (see host.sandbox.raw_calls).
USE_RAW_DECODE = True
# Helper threads only wait on the engine; they never enter wasm.
_MAX_HELPER_THREADS = 256

_SAMPLER_KINDS = {"greedy": SamplerKind.GREEDY, "random": SamplerKind.RANDOM}
_PROBES = {"logprobs": Probe.LOGPROBS, "distribution": Probe.DISTRIBUTION}


# What the host holds per list element of a pass (a list slot and an int object): the unit that
# pass buffers are charged in, so that their budget bounds the memory they really take.
_ELEMENT_BYTES = 36


def _charge(run: RunState, builder: PassBuilder, num_bytes: int) -> None:
    run.charge_pass_buffers(num_bytes)
    builder.charged_bytes += num_bytes


def _sampler(rec: Any) -> Sampler:
    kind = _SAMPLER_KINDS.get(str(rec_field(rec, "kind")))
    if kind is None:
        raise wasmtime.WasmtimeError(f"unknown sampler kind {rec_field(rec, 'kind')!r}")
    return Sampler(
        kind=kind,
        temperature=float(rec_field(rec, "temperature")),
        top_k=int(rec_field(rec, "top_k")),
        top_p=float(rec_field(rec, "top_p")),
        min_p=float(rec_field(rec, "min_p")),
        seed=int(rec_field(rec, "seed")),
    )


def _probe(names: Any) -> Probe:
    probe = Probe.NONE
    for name in names or ():
        probe |= _PROBES[str(name)]
    return probe


@host_function
def new(run: RunState, ctx: ResourceAny) -> ResourceHost:
    context_rep = borrowed_rep(run, ctx)
    run.resources.get(ResourceKind.CONTEXT, context_rep)  # a live context, or a trap
    return ResourceHost.own(run.resources.add(KIND, PassBuilder(context_rep)), int(KIND))


@host_function
def input_tokens(run: RunState, handle: ResourceAny, tokens: list[int]) -> None:
    builder = pass_builder(run, handle)
    _charge(run, builder, len(tokens) * _ELEMENT_BYTES)
    builder.tokens.extend(tokens)


@host_function
def input_positions(run: RunState, handle: ResourceAny, positions: list[int]) -> None:
    builder = pass_builder(run, handle)
    _charge(run, builder, len(positions) * _ELEMENT_BYTES)
    if builder.positions is None:
        builder.positions = []
    builder.positions.extend(positions)  # in place: repeated calls stay linear


@host_function
def output(run: RunState, handle: ResourceAny, row: int, sampler: Any, probe: Any, probe_k: int) -> None:
    spec = OutputSpec(row=row, sampler=_sampler(sampler), probe=_probe(probe), probe_k=probe_k)
    pass_builder(run, handle).outputs.append(spec)


_PENALTY_FIELDS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "penalty_from",
    "repetition_from",
    "penalty_last_n",
)
_FILTER_FIELDS = ("typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "mirostat_tau", "mirostat_eta")


_DRY_FIELDS = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_last_n", "dry_breakers")


def _with_stages(
    sampler: Sampler,
    logit_bias: list[tuple[int, float]],
    penalties: tuple[Any, ...],
    filters: tuple[float, ...],
    dry: tuple[Any, ...] = (),
) -> Sampler:
    """`sampler` with a chain's stages: the bias pairs, and the penalties', filters' and DRY's
    record fields in WIT order (empty for none)."""
    stages: dict[str, Any] = {"logit_bias": tuple(sorted((int(t), float(b)) for t, b in logit_bias))}
    stages.update(zip(_PENALTY_FIELDS, penalties, strict=False))
    stages.update(zip(_FILTER_FIELDS, filters, strict=False))
    stages.update(zip(_DRY_FIELDS, dry, strict=False))
    return replace(sampler, **stages)


def _record(rec: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    return () if rec is None else tuple(rec_field(rec, name) for name in names)


_PENALTY_RECORD = ("repetition", "presence", "frequency", "since", "repetition_since", "last_n")
_FILTER_RECORD = _FILTER_FIELDS
_DRY_RECORD = ("multiplier", "base", "allowed_length", "last_n", "breakers")


def _dry(rec: Any) -> tuple[Any, ...]:
    values = _record(rec, _DRY_RECORD)
    return (*values[:4], tuple(sorted({int(t) for t in values[4]}))) if values else ()


@host_function
def sampler_stages(
    run: RunState, handle: ResourceAny, row: int, logit_bias: list[Any], penalties: Any, filters: Any, dry: Any
) -> None:
    builder = pass_builder(run, handle)
    breakers = 0 if dry is None else len(rec_field(dry, "breakers"))
    _charge(run, builder, (len(logit_bias) * 2 + breakers) * _ELEMENT_BYTES)
    for i, spec in enumerate(builder.outputs):
        if spec.row == row:
            stages = (logit_bias, _record(penalties, _PENALTY_RECORD), _record(filters, _FILTER_RECORD), _dry(dry))
            builder.outputs[i] = replace(spec, sampler=_with_stages(spec.sampler, *stages))
            return
    raise wasmtime.WasmtimeError(f"no output on row {row}: call output() for it first")


@host_function
def score(run: RunState, handle: ResourceAny, row: int, token: int, probe_k: int) -> None:
    """An output on `row` that reports the logprob of `token` (the row's continuation) and the
    top `probe_k`; the row samples greedily, so its token is the model's own first choice."""
    spec = OutputSpec(row=row, probe=Probe.LOGPROBS, probe_k=probe_k, score_token=token)
    pass_builder(run, handle).outputs.append(spec)


@host_function
def use_adapter(run: RunState, handle: ResourceAny, adapter_id: int) -> None:
    try:
        adapter = adapter_api.loaded_by_rep(run, adapter_id)
    except KeyError:
        raise wasmtime.WasmtimeError(f"no live adapter with id {adapter_id}") from None
    pass_builder(run, handle).adapter_id = adapter.adapter_id


@host_function
def attention_window(run: RunState, handle: ResourceAny, window: int, sinks: int) -> None:
    builder = pass_builder(run, handle)
    builder.window, builder.sinks = window, sinks


@host_function
def attention_rows(run: RunState, handle: ResourceAny, rows: list[list[int]]) -> None:
    builder = pass_builder(run, handle)
    _charge(run, builder, sum(len(r) + 2 for r in rows) * _ELEMENT_BYTES)
    builder.mask_rows = [list(r) for r in rows]


@host_function
def logit_mask(run: RunState, handle: ResourceAny, row: int, runs: list[int]) -> None:
    builder = pass_builder(run, handle)
    vocab_size = run.services.model.vocab_size
    if sum(runs) != vocab_size:
        raise wasmtime.WasmtimeError(f"a logit mask's runs must cover the vocabulary of {vocab_size} exactly")
    for i, spec in enumerate(builder.outputs):
        if spec.row == row:
            _charge(run, builder, vocab_size // 8)
            builder.outputs[i] = replace(spec, logit_mask=_bitmap(runs, vocab_size))
            return
    raise wasmtime.WasmtimeError(f"no output on row {row}: call output() for it first")


@host_function
def use_matcher(run: RunState, handle: ResourceAny, row: int, matcher_id: int) -> None:
    builder = pass_builder(run, handle)
    try:
        grammar_api.matcher_by_rep(run, matcher_id)
    except KeyError:
        raise wasmtime.WasmtimeError(f"no live matcher with id {matcher_id}") from None
    if not any(spec.row == row for spec in builder.outputs):
        raise wasmtime.WasmtimeError(f"no output on row {row}: call output() for it first")
    builder.matchers[row] = matcher_id


def _bitmap(runs: list[int], vocab_size: int) -> npt.NDArray[np.uint32]:
    """A BRLE vocabulary mask as the bridge's packed bitmap (bit j of word i = token 32i+j)."""
    allowed = np.repeat(np.arange(len(runs)) % 2 == 1, runs)
    return pack_allowed(vocab_size, np.flatnonzero(allowed))


@host_function
def submit(run: RunState, handle: ResourceAny) -> None:
    builder = pass_builder(run, handle)
    if builder.submitted is None and not builder.is_executed:
        # `Services.forward` blocks until its batch returns; a helper thread waits instead of the
        # run, so the run can submit more passes and the engine batches them together.
        builder.submitted = _helpers().submit(run_pass_records, run, builder)


@host_function
def execute(run: RunState, handle: ResourceAny) -> list[Record] | str:
    builder = pass_builder(run, handle)
    try:
        if builder.submitted is not None:
            future, builder.submitted = builder.submitted, None
            return future.result()
        return run_pass_records(run, builder)
    finally:
        run.check_can_continue()  # a run cancelled while its pass was in flight stops here


@host_function
def execute_all(run: RunState, ids: list[int]) -> list[list[Record] | str]:
    if len(set(ids)) != len(ids):
        raise wasmtime.WasmtimeError("execute-all: a forward pass may appear only once")
    builders = []
    for rep in ids:
        try:
            builder = run.resources.get(KIND, rep)
        except KeyError:
            raise wasmtime.WasmtimeError(f"execute-all: no live forward pass with id {rep}") from None
        assert isinstance(builder, PassBuilder)
        builders.append(builder)
    try:
        return run_group_records(run, builders)
    finally:
        run.check_can_continue()  # a run cancelled while its passes were in flight stops here


def decode(run: RunState, ctx_rep: int, tokens: list[int], sampler: Sampler) -> int | str:
    """`decode` for the stock path and the raw path alike."""
    builder = PassBuilder(ctx_rep, tokens=tokens)
    builder.outputs.append(OutputSpec(row=len(tokens) - 1, sampler=sampler))
    try:
        result = run_pass(run, builder)
    finally:
        run.check_can_continue()
    return result if isinstance(result, str) else int(result[0].token)


@host_function
def decode_stock(run: RunState, ctx: ResourceAny, tokens: list[int], sampler: Any) -> int | str:
    return decode(run, borrowed_rep(run, ctx), tokens, _sampler(sampler))


def _raw_sampler(val: Any) -> Sampler:
    kind, temperature, top_k, top_p, min_p, seed = raw_calls.record_values(val)
    sampler_kind = _SAMPLER_KINDS.get(raw_calls.enum_name(kind))
    if sampler_kind is None:
        raise wasmtime.WasmtimeError("unknown sampler kind")
    return Sampler(sampler_kind, temperature.of.f32, top_k.of.u32, top_p.of.f32, min_p.of.f32, seed.of.s64)


def _raw_host_call(handler: Callable[[RunState, Any, Any], Any]) -> raw_calls.RawHandler:
    """A raw callback that runs `handler(run, context, args)` as `host_function` runs a stock
    one: out of the guest's compute turn, with the watchdog rearmed and the call timed."""

    def call(context: Any, args: Any) -> Any:
        started_s, cpu_s = time.perf_counter(), time.thread_time()
        run = current()
        run.check_can_continue()
        run.leave_guest()
        try:
            return handler(run, context, args)
        finally:
            run.pace(time.thread_time() - cpu_s)
            run.enter_guest()
            run.rearm_watchdog()
            run.note_host_call(started_s)

    return call


@_raw_host_call
def _decode_raw(run: RunState, context: Any, args: Any) -> Any:
    sampler = _raw_sampler(args[2])
    result = decode(run, raw_calls.borrow_rep(context, args[0]), raw_calls.u32_list(args[1]), sampler)
    return raw_calls.err_string(result) if isinstance(result, str) else raw_calls.ok_u32(result)


@_raw_host_call
def _decode_chained_raw(run: RunState, context: Any, args: Any) -> Any:
    """`decode-chained` on the raw path: the stock glue's lifting of its bias list and option
    records cost ~2 ms of host time a token (8 runs at once, 2 cores)."""
    pairs = [raw_calls.tuple_values(item) for item in raw_calls.list_items(args[3])]
    penalties, filters = raw_calls.option_value(args[4]), raw_calls.option_value(args[5])
    penalty_values: tuple[Any, ...] = ()
    if penalties is not None:
        p = raw_calls.record_values(penalties)
        penalty_values = (p[0].of.f32, p[1].of.f32, p[2].of.f32, p[3].of.u32, p[4].of.u32, p[5].of.u32)
    filter_values = () if filters is None else tuple(v.of.f32 for v in raw_calls.record_values(filters))
    dry = raw_calls.option_value(args[6])
    dry_values: tuple[Any, ...] = ()
    if dry is not None:
        d = raw_calls.record_values(dry)
        breakers = tuple(sorted(set(raw_calls.u32_list(d[4]))))
        dry_values = (d[0].of.f32, d[1].of.f32, d[2].of.u32, d[3].of.u32, breakers)
    bias = [(t.of.u32, b.of.f32) for t, b in pairs]
    sampler = _with_stages(_raw_sampler(args[2]), bias, penalty_values, filter_values, dry_values)
    result = decode(run, raw_calls.borrow_rep(context, args[0]), raw_calls.u32_list(args[1]), sampler)
    return raw_calls.err_string(result) if isinstance(result, str) else raw_calls.ok_u32(result)


def decode_all(run: RunState, reps: list[int], tokens: list[Any], samplers: list[Sampler]) -> list[int | str]:
    """`decode-all`: one decode step on each context (by rep), as one group. `tokens`: each
    context's input, raw list values still in the guest's arguments."""
    if len(tokens) != len(reps) or len(samplers) not in (1, len(reps)):
        raise wasmtime.WasmtimeError(
            f"decode-all: {len(reps)} contexts, {len(tokens)} token lists and {len(samplers)} samplers: give one "
            "token list per context, and one sampler or one per context"
        )
    if len(set(reps)) != len(reps):
        raise wasmtime.WasmtimeError("decode-all: a context may appear only once")
    for rep in reps:
        try:
            run.resources.get(ResourceKind.CONTEXT, rep)
        except KeyError:
            raise wasmtime.WasmtimeError(f"decode-all: no live context with id {rep}") from None
    charged = sum(raw_calls.list_len(t) for t in tokens) * _ELEMENT_BYTES
    run.charge_pass_buffers(charged)  # held while the group runs, like a pass's buffers
    try:
        builders = []
        for i, (rep, items) in enumerate(zip(reps, tokens, strict=True)):
            builder = PassBuilder(rep, tokens=raw_calls.u32_list(items))
            builder.outputs.append(OutputSpec(row=len(builder.tokens) - 1, sampler=samplers[i % len(samplers)]))
            builders.append(builder)
        return [r if isinstance(r, str) else int(r[0].token) for r in run_group(run, builders)]
    finally:
        run.release_pass_buffers(charged)
        run.check_can_continue()  # a run cancelled while its passes were in flight stops here


@_raw_host_call
def _decode_all_raw(run: RunState, _context: Any, args: Any) -> Any:
    samplers = [_raw_sampler(v) for v in raw_calls.list_items(args[2])]
    results = decode_all(run, raw_calls.u32_list(args[0]), raw_calls.list_items(args[1]), samplers)
    return raw_calls.results_u32(results)


_helper_pool: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def _helpers() -> ThreadPoolExecutor:
    global _helper_pool
    with _helper_lock:
        if _helper_pool is None:
            _helper_pool = ThreadPoolExecutor(max_workers=_MAX_HELPER_THREADS, thread_name_prefix="wafer-pass")
        return _helper_pool


def _drop(_store: wasmtime.StoreContext, rep: int) -> None:
    run = current_or_none()
    if run is not None:
        builder = run.resources.remove(KIND, rep)
        if isinstance(builder, PassBuilder):
            run.release_pass_buffers(builder.charged_bytes)
            builder.charged_bytes = 0


def register(instance: LinkerInstance) -> None:
    instance.add_resource("forward-pass", ResourceType.host(int(KIND)), _drop)
    instance.add_func("[constructor]forward-pass", new)
    instance.add_func("[method]forward-pass.input-tokens", input_tokens)
    instance.add_func("[method]forward-pass.input-positions", input_positions)
    instance.add_func("[method]forward-pass.output", output)
    instance.add_func("[method]forward-pass.score", score)
    instance.add_func("[method]forward-pass.sampler-stages", sampler_stages)
    instance.add_func("[method]forward-pass.use-adapter", use_adapter)
    instance.add_func("[method]forward-pass.attention-window", attention_window)
    instance.add_func("[method]forward-pass.attention-rows", attention_rows)
    instance.add_func("[method]forward-pass.logit-mask", logit_mask)
    instance.add_func("[method]forward-pass.use-matcher", use_matcher)
    instance.add_func("[method]forward-pass.submit", submit)
    instance.add_func("[method]forward-pass.execute", execute)
    instance.add_func("[method]forward-pass.generate", generation.generate)
    raw_calls.add_raw_func(instance, "[method]forward-pass.id", handle_id(KIND), 1)
    instance.add_func("execute-all", execute_all)
    raw_calls.add_raw_func(instance, "decode-all", _decode_all_raw, 3)
    if USE_RAW_DECODE:
        raw_calls.add_raw_func(instance, "decode", _decode_raw, 3)
    else:
        instance.add_func("decode", decode_stock)
    raw_calls.add_raw_func(instance, "decode-chained", _decode_chained_raw, 7)
