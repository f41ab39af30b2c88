"""`forward-pass.generate`: the plain generation loop, run on the host. What may start one, and
the rule for each next step (the engine asks it on its loop thread while the guest waits).
"""

from __future__ import annotations

import time
from dataclasses import replace

import wasmtime
from wasmtime.component import Record, ResourceAny

from bridge_schema.messages import Probe
from host.api import grammar as grammar_api
from host.api.forward_pass import PassBuilder, pass_builder, pass_request, validate
from host.api.host_call import error_text, host_function, record
from host.errors import HostError
from host.sandbox.run_state import RunState
from host.services import PassRequest, PassResult
from host.text_stream import TextStream


def _generate_problem(run: RunState, builder: PassBuilder) -> str | None:
    """Why `builder` cannot be the first step of `generate`, or None."""
    if builder.submitted is not None:
        return "this forward pass was submitted: execute it instead"
    problem = validate(builder)
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
        self.spec = first.outputs[0]  # before `pass_request` merges the matcher's mask into it
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
        prepared = pass_request(self.run, step)
        if isinstance(prepared, str):
            self.error = prepared
            return len(result.outputs), None
        request = prepared[1]
        if self.is_plain:
            request.steps = min(self.run.services.max_decode_steps(), self.max_tokens - len(self.tokens))
        self.run.num_passes += 1
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
    first = pass_builder(run, handle)
    problem = _generate_problem(run, first)
    if problem is not None or max_tokens == 0:
        return record(tokens=[], error=problem, tail="")
    loop = _HostLoop(run, first, max_tokens, frozenset(stop_tokens), emit_text)
    prepared = pass_request(run, first)
    if isinstance(prepared, str):
        return record(tokens=[], error=prepared, tail="")
    run.num_passes += 1
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
