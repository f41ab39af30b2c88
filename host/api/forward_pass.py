"""A forward pass as the guest builds it (`PassBuilder`, the `forward-pass` resource's state) and
how it runs: validated, its matcher rows masked, sent as a `PassRequest` through
`Services.forward`, its results as WIT records. Registers nothing on a Linker.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import numpy as np
from wasmtime.component import Record, ResourceAny

from bridge_schema.batch import OutputResult, OutputSpec, logit_mask_words
from host.api import grammar as grammar_api
from host.api.host_call import borrowed_rep, error_text, record
from host.errors import HostError
from host.sandbox.resources import ResourceKind
from host.sandbox.run_state import RunState
from host.services import PassRequest

KIND = ResourceKind.FORWARD_PASS


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


def pass_builder(run: RunState, handle: ResourceAny) -> PassBuilder:
    """The pass behind a guest's `forward-pass` handle (a trap when there is none)."""
    value = run.resources.get(KIND, borrowed_rep(run, handle))
    assert isinstance(value, PassBuilder)
    return value


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


def validate(builder: PassBuilder) -> str | None:
    """Why `builder` cannot run as it is (the error the guest gets), or None. Only what the
    matchers need settled first: the engine checks the rest of the pass against the handshake
    where it enters (host.engine.pass_check: token and position ranges, rows, samplers, masks)."""
    if builder.is_executed:
        return "this forward pass was already executed; create a new one"
    if not builder.tokens:
        return "a forward pass needs at least one input token"
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


def pass_request(run: RunState, builder: PassBuilder) -> tuple[int, PassRequest] | str:
    """Validate `builder` and fill its matcher masks: (context id, request), or the error the
    guest gets. Marks the builder executed."""
    problem = validate(builder) or _apply_matchers(run, builder)
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


def run_pass(run: RunState, builder: PassBuilder) -> list[OutputResult] | str:
    """Validate and run one pass; the engine's results, or the error the guest gets."""
    prepared = pass_request(run, builder)
    if isinstance(prepared, str):
        return prepared
    run.num_passes += 1
    started_s = time.perf_counter()
    try:
        # Waits in slices: cancel and the wall clock stop the run during a long pass too.
        return run.services.forward(run.run_id, *prepared, may_wait=run.check_can_continue).outputs
    except HostError as exc:  # out of pages, driver errors: the guest decides
        return error_text(exc)
    finally:
        run.forward_wait_s += time.perf_counter() - started_s


def run_pass_records(run: RunState, builder: PassBuilder) -> list[Record] | str:
    """`run_pass` with WIT output records (on the run thread, or a helper for `submit`)."""
    results = run_pass(run, builder)
    if isinstance(results, str):
        return results
    return [_output_record(s, r) for s, r in zip(builder.outputs, results, strict=True)]


def run_group(run: RunState, builders: list[PassBuilder]) -> list[list[OutputResult] | str]:
    """Run passes of distinct contexts (none submitted alone) as one group
    (`Services.forward_group`): one result per builder, in order, each as `run_pass` gives it."""
    prepared = [pass_request(run, b) for b in builders]
    group = [p for p in prepared if isinstance(p, tuple)]
    run.num_passes += len(group)
    started_s = time.perf_counter()
    try:
        answers = iter(run.services.forward_group(run.run_id, group, may_wait=run.check_can_continue))
    finally:
        run.forward_wait_s += time.perf_counter() - started_s
    results: list[list[OutputResult] | str] = []
    for item in prepared:
        if isinstance(item, str):
            results.append(item)
        else:
            answer = next(answers)
            results.append(error_text(answer) if isinstance(answer, HostError) else answer.outputs)
    return results


def run_group_records(run: RunState, builders: list[PassBuilder]) -> list[list[Record] | str]:
    """`run_group` with WIT output records; a pass already `submit`ted alone is waited for
    instead."""
    answers = iter(run_group(run, [b for b in builders if b.submitted is None]))
    results: list[list[Record] | str] = []
    for builder in builders:
        if builder.submitted is not None:
            future, builder.submitted = builder.submitted, None
            results.append(future.result())
            continue
        answer = next(answers)
        if isinstance(answer, str):
            results.append(answer)
        else:
            results.append([_output_record(s, r) for s, r in zip(builder.outputs, answer, strict=True)])
    return results
