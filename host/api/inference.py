"""`wafer:inferlet/inference`: the `forward-pass` resource, built up by the guest and executed
through `Services.forward`.

Issue [speculator] adds attention masks, logit masks and grammar matchers as further methods
that fill more fields of `PassBuilder`, passed on in `_run_pass_raw` (`PassRequest.mask_rows`,
`OutputSpec.logit_mask` already exist). `decode` stays the unconstrained one-token step.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import wasmtime
from wasmtime.component import LinkerInstance, Record, ResourceAny, ResourceHost, ResourceType

from bridge_schema.batch import OutputResult, OutputSpec, Sampler, logit_mask_words, pack_allowed
from bridge_schema.messages import Probe, SamplerKind
from host.api import adapter as adapter_api
from host.api import grammar as grammar_api
from host.api.host_call import borrowed_rep, error_text, host_function, record
from host.api.host_call import field as rec_field
from host.errors import HostError
from host.sandbox import raw_calls
from host.sandbox.resources import ResourceKind
from host.sandbox.run_state import RunState, current, current_or_none
from host.services import PassRequest, PassResult
from host.text_stream import TextStream

INTERFACE = "inference"
KIND = ResourceKind.FORWARD_PASS
# The hot one-token decode goes through a raw ctypes callback (see host.sandbox.raw_calls).
USE_RAW_DECODE = True
# Helper threads only wait on the engine; they never enter wasm.
_MAX_HELPER_THREADS = 256

_SAMPLER_KINDS = {"greedy": SamplerKind.GREEDY, "random": SamplerKind.RANDOM}
_PROBES = {"logprobs": Probe.LOGPROBS, "distribution": Probe.DISTRIBUTION}


@dataclass(slots=True)
class PassBuilder:
    """A forward pass as the guest configures it, bound to a context handle (by rep, so a pass on
    a context that was dropped meanwhile fails cleanly at `execute`)."""

    context_rep: int
    tokens: list[int] = field(default_factory=list)
    positions: list[int] | None = None
    outputs: list[OutputSpec] = field(default_factory=list)
    adapter_id: int = -1
    window: int = 0
    sinks: int = 0
    mask_rows: list[list[int]] | None = None
    matchers: dict[int, int] = field(default_factory=dict)  # output row -> matcher rep
    is_executed: bool = False
    submitted: Future[list[Record] | str] | None = None
    charged_bytes: int = 0  # of the run's pass-buffer budget (`RunState.charge_pass_buffers`)


# What the host holds per list element of a pass (a list slot and an int object): the unit that
# pass buffers are charged in, so that their budget bounds the memory they really take.
_ELEMENT_BYTES = 36


def _charge(run: RunState, builder: PassBuilder, num_bytes: int) -> None:
    run.charge_pass_buffers(num_bytes)
    builder.charged_bytes += num_bytes


def _builder(run: RunState, handle: ResourceAny) -> PassBuilder:
    value = run.resources.get(KIND, borrowed_rep(run, handle))
    assert isinstance(value, PassBuilder)
    return value


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
    builder = _builder(run, handle)
    _charge(run, builder, len(tokens) * _ELEMENT_BYTES)
    builder.tokens.extend(tokens)


@host_function
def input_positions(run: RunState, handle: ResourceAny, positions: list[int]) -> None:
    builder = _builder(run, handle)
    _charge(run, builder, len(positions) * _ELEMENT_BYTES)
    if builder.positions is None:
        builder.positions = []
    builder.positions.extend(positions)  # in place: repeated calls stay linear


@host_function
def output(run: RunState, handle: ResourceAny, row: int, sampler: Any, probe: Any, probe_k: int) -> None:
    spec = OutputSpec(row=row, sampler=_sampler(sampler), probe=_probe(probe), probe_k=probe_k)
    _builder(run, handle).outputs.append(spec)


@host_function
def score(run: RunState, handle: ResourceAny, row: int, token: int, probe_k: int) -> None:
    """An output on `row` that reports the logprob of `token` (the row's continuation) and the
    top `probe_k`; the row samples greedily, so its token is the model's own first choice."""
    spec = OutputSpec(row=row, probe=Probe.LOGPROBS, probe_k=probe_k, score_token=token)
    _builder(run, handle).outputs.append(spec)


@host_function
def use_adapter(run: RunState, handle: ResourceAny, adapter_id: int) -> None:
    try:
        adapter = adapter_api.loaded_by_rep(run, adapter_id)
    except KeyError:
        raise wasmtime.WasmtimeError(f"no live adapter with id {adapter_id}") from None
    _builder(run, handle).adapter_id = adapter.adapter_id


@host_function
def attention_window(run: RunState, handle: ResourceAny, window: int, sinks: int) -> None:
    builder = _builder(run, handle)
    builder.window, builder.sinks = window, sinks


@host_function
def attention_rows(run: RunState, handle: ResourceAny, rows: list[list[int]]) -> None:
    builder = _builder(run, handle)
    _charge(run, builder, sum(len(r) + 2 for r in rows) * _ELEMENT_BYTES)
    builder.mask_rows = [list(r) for r in rows]


@host_function
def logit_mask(run: RunState, handle: ResourceAny, row: int, runs: list[int]) -> None:
    builder = _builder(run, handle)
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
    builder = _builder(run, handle)
    try:
        grammar_api.matcher_by_rep(run, matcher_id)
    except KeyError:
        raise wasmtime.WasmtimeError(f"no live matcher with id {matcher_id}") from None
    if not any(spec.row == row for spec in builder.outputs):
        raise wasmtime.WasmtimeError(f"no output on row {row}: call output() for it first")
    builder.matchers[row] = matcher_id


def _apply_matchers(run: RunState, builder: PassBuilder) -> str | None:
    """Fill each matcher row's logit mask from its matcher's current state (at execute time)."""
    vocab_size = run.services.model.vocab_size
    for i, spec in enumerate(builder.outputs):
        rep = builder.matchers.get(spec.row)
        if rep is None:
            continue
        words = np.zeros(logit_mask_words(vocab_size), dtype=np.uint32)
        try:
            is_constrained = grammar_api.matcher_by_rep(run, rep).fill_bitmask(words)
        except KeyError:
            return f"the matcher of row {spec.row} was dropped"
        except HostError as exc:  # e.g. the matcher already terminated
            return error_text(exc)
        if not is_constrained:  # every token allowed; the pass still counts as constrained
            continue
        mask = words if spec.logit_mask is None else words & spec.logit_mask  # both constrain
        builder.outputs[i] = replace(spec, logit_mask=mask)
    return None


def _bitmap(runs: list[int], vocab_size: int) -> npt.NDArray[np.uint32]:
    """A BRLE vocabulary mask as the bridge's packed bitmap (bit j of word i = token 32i+j)."""
    allowed = np.repeat(np.arange(len(runs)) % 2 == 1, runs)
    return pack_allowed(vocab_size, np.flatnonzero(allowed))


def _validate(run: RunState, builder: PassBuilder) -> str | None:
    if builder.is_executed:
        return "this forward pass was already executed; create a new one"
    if not builder.tokens:
        return "a forward pass needs at least one input token"
    vocab_size = run.services.model.vocab_size
    if any(t >= vocab_size for t in builder.tokens):
        return f"input token out of range (vocabulary size {vocab_size})"
    if builder.positions is not None and len(builder.positions) != len(builder.tokens):
        return f"{len(builder.positions)} positions given for {len(builder.tokens)} input tokens"
    for spec in builder.outputs:
        if spec.row >= len(builder.tokens):
            return f"output row {spec.row} is outside the pass's {len(builder.tokens)} input tokens"
    return None


def _output_record(spec: OutputSpec, result: OutputResult) -> Record:
    dist = result.distribution
    return record(
        row=spec.row,
        token=int(result.token),
        logprob=float(result.logprob),
        topk_ids=[int(t) for t in result.topk_ids],
        topk_logprobs=[float(p) for p in result.topk_logprobs],
        distribution=[] if dist is None else [float(p) for p in dist],
    )


def _pass_request(run: RunState, builder: PassBuilder) -> tuple[int, PassRequest] | str:
    """Validate `builder` and fill its matcher masks: (context id, request), or the error the
    guest gets. Marks the builder executed."""
    problem = _validate(run, builder) or _apply_matchers(run, builder)
    if problem is not None:
        return problem
    builder.is_executed = True
    try:
        ctx_value = run.resources.get(ResourceKind.CONTEXT, builder.context_rep)
    except KeyError:
        return "the forward pass's context was released"
    assert isinstance(ctx_value, int)
    request = PassRequest(
        tokens=builder.tokens,
        positions=builder.positions,
        outputs=builder.outputs,
        adapter_id=builder.adapter_id,
        mask_rows=builder.mask_rows,
        attention_window=builder.window,
        attention_sinks=builder.sinks,
        has_grammar=bool(builder.matchers),
    )
    return ctx_value, request


def _run_pass_raw(run: RunState, builder: PassBuilder) -> list[OutputResult] | str:
    """Validate and run one pass; the engine's results, or the error the guest gets."""
    prepared = _pass_request(run, builder)
    if isinstance(prepared, str):
        return prepared
    started_s = time.perf_counter()
    try:
        # Waits in slices: cancel and the wall clock stop the run during a long pass too.
        return run.services.forward(run.run_id, *prepared, may_wait=run.check_can_continue).outputs
    except HostError as exc:  # out of pages, driver errors: the guest decides
        return error_text(exc)
    finally:
        run.forward_wait_s += time.perf_counter() - started_s


def _run_pass(run: RunState, builder: PassBuilder) -> list[Record] | str:
    """`_run_pass_raw` with WIT output records (on the run thread, or a helper for `submit`)."""
    results = _run_pass_raw(run, builder)
    if isinstance(results, str):
        return results
    return [_output_record(s, r) for s, r in zip(builder.outputs, results, strict=True)]


@host_function
def submit(run: RunState, handle: ResourceAny) -> None:
    builder = _builder(run, handle)
    if builder.submitted is None and not builder.is_executed:
        # `Services.forward` blocks until its batch returns; a helper thread waits instead of the
        # run, so the run can submit more passes and the engine batches them together.
        builder.submitted = _helpers().submit(_run_pass, run, builder)


@host_function
def execute(run: RunState, handle: ResourceAny) -> list[Record] | str:
    builder = _builder(run, handle)
    try:
        if builder.submitted is not None:
            future, builder.submitted = builder.submitted, None
            return future.result()
        return _run_pass(run, builder)
    finally:
        run.check_can_continue()  # a run cancelled while its pass was in flight stops here


def _generate_problem(run: RunState, builder: PassBuilder) -> str | None:
    """Why `builder` cannot be the first step of `generate`, or None."""
    if builder.submitted is not None:
        return "this forward pass was submitted: execute it instead"
    problem = _validate(run, builder)
    if problem is not None:
        return problem
    if len(builder.outputs) != 1 or builder.outputs[0].row != len(builder.tokens) - 1:
        return "generate needs exactly one output, on the pass's last input row"
    if builder.outputs[0].probe != Probe.NONE:
        return "generate reports no probes: execute passes one by one to read logprobs"
    if builder.positions is not None:
        return "generate continues the context: explicit positions are not allowed"
    if builder.mask_rows is not None:
        return "generate takes no explicit attention rows (an attention window is fine)"
    return None


class _HostLoop:
    """`forward-pass.generate`'s rule for the next step, run by the engine after each step
    (on its loop thread, while the guest waits in the host call)."""

    def __init__(self, run: RunState, first: PassBuilder, max_tokens: int, stop: frozenset[int], emit: bool) -> None:
        self.run = run
        self.first = first
        self.spec = first.outputs[0]  # before `_apply_matchers` merges the matcher's mask into it
        self.matcher_rep = first.matchers.get(self.spec.row)
        self.max_tokens = max_tokens
        self.stop = stop
        self.text = TextStream(run.services.tokenizer) if emit else None
        self.tokens: list[int] = []
        self.error: str | None = None
        # Several decode steps per pass (`PassRequest.steps`) only for plain steps: a matcher or
        # a logit mask changes per step, and a window is an attention mask.
        self.is_plain = self.matcher_rep is None and self.spec.logit_mask is None and not first.window

    def next_step(self, result: PassResult) -> tuple[int, PassRequest | None]:
        """(outputs of `result` used, the next request or None)."""
        for used, output in enumerate(result.outputs, 1):
            if not self._take(int(output.token)):
                return used, None
        if len(self.tokens) >= self.max_tokens or self.run.cancel_requested.is_set() or self.run.remaining_s() <= 0:
            return len(result.outputs), None  # a stopped run learns why from `check_can_continue`
        first = self.first
        step = PassBuilder(
            first.context_rep,
            tokens=[self.tokens[-1]],
            outputs=[replace(self.spec, row=0)],
            adapter_id=first.adapter_id,
            window=first.window,
            sinks=first.sinks,
            matchers={} if self.matcher_rep is None else {0: self.matcher_rep},
        )
        prepared = _pass_request(self.run, step)
        if isinstance(prepared, str):
            self.error = prepared
            return len(result.outputs), None
        request = prepared[1]
        if self.is_plain:
            request.steps = min(self.run.services.max_decode_steps(), self.max_tokens - len(self.tokens))
        return len(result.outputs), request

    def _take(self, token: int) -> bool:
        """Add one sampled token; False when generation ends with it."""
        self.tokens.append(token)
        if self.matcher_rep is not None:
            matcher = grammar_api.matcher_by_rep(self.run, self.matcher_rep)  # live: the guest waits
            if not matcher.accept(token):
                self.error = f"the host sampled token {token}, which the grammar refuses"
                return False
            if matcher.is_terminated():
                return False
        if token in self.stop:
            return False
        if self.text is not None and (piece := self.text.push(token)):
            try:
                self.run.emit(piece)
            except wasmtime.WasmtimeError:  # past the output limit: the run stops at `generate`'s end
                return False
        return len(self.tokens) < self.max_tokens


@host_function
def generate(run: RunState, handle: ResourceAny, max_tokens: int, stop_tokens: list[int], emit_text: bool) -> Record:
    """`forward-pass.generate`: the plain generation loop, on the host (see the WIT)."""
    first = _builder(run, handle)
    problem = _generate_problem(run, first)
    if problem is not None or max_tokens == 0:
        return record(tokens=[], error=problem, tail="")
    loop = _HostLoop(run, first, max_tokens, frozenset(stop_tokens), emit_text)
    prepared = _pass_request(run, first)
    if isinstance(prepared, str):
        return record(tokens=[], error=prepared, tail="")
    started_s = time.perf_counter()
    try:
        run.services.generate(run.run_id, prepared[0], prepared[1], loop.next_step)
    except HostError as exc:  # out of pages, driver errors: the guest decides
        loop.error = error_text(exc)
    finally:
        run.forward_wait_s += time.perf_counter() - started_s
    run.check_can_continue()  # cancelled or out of time while generating: the run stops here
    tail = loop.text.held() if loop.text is not None else ""
    return record(tokens=loop.tokens, error=loop.error, tail=tail)


def decode(run: RunState, ctx_rep: int, tokens: list[int], sampler: Sampler) -> int | str:
    """`decode` for the stock path and the raw path alike."""
    builder = PassBuilder(ctx_rep, tokens=tokens)
    builder.outputs.append(OutputSpec(row=len(tokens) - 1, sampler=sampler))
    try:
        result = _run_pass_raw(run, builder)
    finally:
        run.check_can_continue()
    return result if isinstance(result, str) else int(result[0].token)


@host_function
def decode_stock(run: RunState, ctx: ResourceAny, tokens: list[int], sampler: Any) -> int | str:
    return decode(run, borrowed_rep(run, ctx), tokens, _sampler(sampler))


def _decode_raw(context: Any, args: Any) -> Any:
    started_s = time.perf_counter()
    run = current()
    run.check_can_continue()
    try:
        kind, temperature, top_k, top_p, min_p, seed = raw_calls.record_values(args[2])
        sampler_kind = _SAMPLER_KINDS.get(raw_calls.enum_name(kind))
        if sampler_kind is None:
            raise wasmtime.WasmtimeError("unknown sampler kind")
        sampler = Sampler(sampler_kind, temperature.of.f32, top_k.of.u32, top_p.of.f32, min_p.of.f32, seed.of.s64)
        result = decode(run, raw_calls.borrow_rep(context, args[0]), raw_calls.u32_list(args[1]), sampler)
        return raw_calls.err_string(result) if isinstance(result, str) else raw_calls.ok_u32(result)
    finally:
        run.rearm_watchdog()
        run.note_host_call(started_s)


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
    instance.add_func("[method]forward-pass.use-adapter", use_adapter)
    instance.add_func("[method]forward-pass.attention-window", attention_window)
    instance.add_func("[method]forward-pass.attention-rows", attention_rows)
    instance.add_func("[method]forward-pass.logit-mask", logit_mask)
    instance.add_func("[method]forward-pass.use-matcher", use_matcher)
    instance.add_func("[method]forward-pass.submit", submit)
    instance.add_func("[method]forward-pass.execute", execute)
    instance.add_func("[method]forward-pass.generate", generate)
    if USE_RAW_DECODE:
        raw_calls.add_raw_func(instance, "decode", _decode_raw)
    else:
        instance.add_func("decode", decode_stock)
