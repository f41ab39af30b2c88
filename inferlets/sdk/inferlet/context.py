"""`Context`: a token sequence with its KV cache on the host, and the ways to extend it.

The host's KV holds the *committed* tokens. Tokens given to `fill` and the last sampled token
are *pending*: they enter the KV with the next forward pass, whose last row predicts the next
token. `tokens` is always committed + pending.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from componentize_py_types import Err
from wit_world.imports import context as _ctx
from wit_world.imports import inference as _inf

from inferlet.adapter import Adapter
from inferlet.attention import LogitMask, Window
from inferlet.checks import need_ints
from inferlet.grammar import Grammar, Matcher
from inferlet.model import model_info, tokenize
from inferlet.sampling import Chain, Greedy, Random, Sampler
from inferlet.sampling import output as _output
from inferlet.text import TextDecoder

_NO_PROBE = _inf.Probe(0)
GREEDY = Greedy()


class InferenceError(Exception):
    """The host refused or failed a context operation (out of pages, bad input, driver error)."""


@dataclass(frozen=True)
class Completion:
    """What `Context.complete` generated."""

    tokens: list[int]
    """The tokens `generate` would have yielded (without the token that ended generation)."""
    stopped: bool
    """True when a stop token or the grammar's end ended it; False when `max_tokens` did."""
    tail: str
    """With `emit_text`: text held back because it ends inside a character (else "")."""


@dataclass(frozen=True)
class TokenChoice:
    token: int
    logprob: float


def _call(fn, *args):  # type: ignore[no-untyped-def]
    try:
        return fn(*args)
    except Err as e:
        raise InferenceError(str(e.value)) from None


class Context:
    """A context on the host. Release it with `release()` or a `with` block when done (the host
    also frees whatever a run leaves behind when it ends)."""

    def __init__(self, _handle: _ctx.Context | None = None, _tokens: list[int] | None = None, _committed: int = 0):
        self._handle = _handle if _handle is not None else _call(_ctx.Context.create)
        self._tokens: list[int] = list(_tokens or [])
        self._committed = _committed
        self._id: int | None = None  # the handle's number, for group calls (asked once)
        self.adapter: Adapter | None = None
        """When set, every later pass of this context runs through this LoRA adapter."""
        self.attention: Window | None = None
        """When set, every later pass of this context attends only within this window."""

    # -- state -------------------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """Every token of the context: committed and pending."""
        return list(self._tokens)

    @property
    def pending(self) -> list[int]:
        return self._tokens[self._committed :]

    @property
    def num_committed(self) -> int:
        """Tokens already in the host's KV: the slot of the first pending token. Explicit
        attention rows cover the keys `0 .. num_committed + len(tokens run) - 1`."""
        return self._committed

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def num_pages(self) -> int:
        """KV pages this context holds on the host now (a page shared with a fork counts here
        too; released slots do not). `pages_in_use()` counts the whole run's, shared ones once."""
        return int(self._live().num_pages())

    @property
    def room(self) -> int:
        """How many more tokens fit before the model's context length (`max_context`): a pass
        runs only while the context holds at most that many. Positions count from the
        context's start: a `Window` or released slots do not make room."""
        return max(0, model_info().max_context - len(self._tokens))

    def _check_fits(self) -> None:
        if len(self._tokens) > model_info().max_context:
            raise InferenceError(
                f"the context is full: {len(self._tokens)} tokens, past the model's context length of "
                f"{model_info().max_context} (model_info().max_context; a Window or released slots do not make "
                "room, as positions count from the start): truncate() it, or continue in a new context"
            )

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Free the context's pages now. The object is unusable afterwards."""
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
            self._handle = None

    def _live(self) -> _ctx.Context:
        if self._handle is None:
            raise InferenceError("this context was released")
        return self._handle

    # -- building ----------------------------------------------------------------------------

    def fill(self, text_or_tokens: str | Iterable[int]) -> None:
        """Append a prompt (text is tokenized by the model's tokenizer). Nothing runs until the
        next `flush`, `decode_step`, `generate` or `fork`."""
        if isinstance(text_or_tokens, str):
            new = tokenize(text_or_tokens)
        else:
            new = need_ints(text_or_tokens, "fill()'s tokens (or give text as a str)")
        vocab = model_info().vocab_size
        if any(t < 0 or t >= vocab for t in new):
            raise InferenceError(f"token out of range for a vocabulary of {vocab}")
        self._tokens.extend(new)

    def flush(self, attention_rows: Sequence[Sequence[int]] | None = None) -> None:
        """Run every pending token but the last through the model, so they are in the KV (and
        shared by forks). The last stays pending: it is the input that predicts the next token.
        `attention_rows`: one explicit mask row per token run (see `decode_step`)."""
        todo = self.pending[:-1]
        if todo:
            self._forward(todo, outputs=(), attention_rows=attention_rows)
            self._committed += len(todo)
        elif attention_rows:
            raise InferenceError("attention rows given, but there is nothing to flush")

    def fork(self) -> Context:
        """A new context with the same tokens. Full KV pages are shared, not copied."""
        self.flush()
        handle = _call(self._live().fork)
        child = Context(handle, self._tokens, self._committed)
        child.adapter = self.adapter
        child.attention = self.attention
        return child

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens (rewind)."""
        if not 0 <= length <= len(self._tokens):
            raise InferenceError(f"cannot truncate a context of {len(self._tokens)} tokens to {length}")
        if length <= self._committed and self._committed > 0:
            # The token at length-1 must be re-fed as pending: it predicts what comes next.
            committed = max(length - 1, 0)
            _call(self._live().truncate, committed)
            self._committed = committed
        del self._tokens[length:]

    def release_slots(self, start: int, stop: int) -> int:
        """Give back the KV memory of the whole pages inside committed slots [start, stop),
        keeping every position as it is (the tokens stay in `tokens`). Only for a context whose
        `attention` never looks there again, e.g. a `Window` with sinks: later passes that
        would attend to released slots are refused. Returns the number of pages released."""
        stop = min(stop, self._committed)
        if start >= stop:
            return 0
        return int(_call(self._live().release_pages, start, stop))

    # -- running -----------------------------------------------------------------------------

    def _forward(
        self,
        tokens: list[int],
        outputs: Iterable[tuple[int, Sampler, _inf.Probe, int]],
        attention_rows: Sequence[Sequence[int]] | None = None,
    ) -> list[_inf.Output]:
        self._check_fits()
        with _inf.ForwardPass(self._live()) as fp:
            fp.input_tokens(tokens)
            self._constrain(fp)
            self._attend(fp, len(tokens), attention_rows)
            for row, sampler, probe, k in outputs:
                _output(fp, row, sampler, probe, k)
            return _call(fp.execute)

    def _constrain(self, fp: _inf.ForwardPass) -> None:
        if self.adapter is not None:
            fp.use_adapter(self.adapter.id)
        if self.attention is not None:
            fp.attention_window(self.attention.size, self.attention.sinks)

    def _attend(self, fp: _inf.ForwardPass, num_tokens: int, rows: Sequence[Sequence[int]] | None) -> None:
        """Attach explicit attention rows, checked here so a mistake names itself."""
        if rows is None:
            return
        if self.attention is not None:
            raise InferenceError("explicit attention rows and a Window cannot both apply: unset ctx.attention")
        num_keys = self._committed + num_tokens
        if len(rows) != num_tokens or any(sum(row) != num_keys for row in rows):
            raise InferenceError(f"need {num_tokens} attention rows, each covering the pass's {num_keys} keys")
        fp.attention_rows([list(row) for row in rows])

    def _pending_pass(
        self,
        sampler: Sampler,
        probe: _inf.Probe,
        k: int,
        logit_mask: LogitMask | None = None,
        matcher: Matcher | None = None,
        attention_rows: Sequence[Sequence[int]] | None = None,
    ) -> _inf.ForwardPass:
        """A configured, not yet executed pass over the pending tokens, sampling the last row."""
        todo = self.pending
        if not todo:
            raise InferenceError("nothing to predict from: fill() the context first")
        self._check_fits()
        fp = _inf.ForwardPass(self._live())
        fp.input_tokens(todo)
        self._constrain(fp)
        try:
            self._attend(fp, len(todo), attention_rows)
        except InferenceError:
            fp.__exit__(None, None, None)
            raise
        _output(fp, len(todo) - 1, sampler, probe, k)
        if logit_mask is not None:
            fp.logit_mask(len(todo) - 1, list(logit_mask.runs))
        if matcher is not None:
            fp.use_matcher(len(todo) - 1, matcher.id)
        return fp

    def _run_pending(
        self,
        sampler: Sampler,
        probe: _inf.Probe,
        k: int,
        logit_mask: LogitMask | None = None,
        matcher: Matcher | None = None,
        attention_rows: Sequence[Sequence[int]] | None = None,
    ) -> _inf.Output:
        with self._pending_pass(sampler, probe, k, logit_mask, matcher, attention_rows) as fp:
            (out,) = _call(fp.execute)
        self._committed = len(self._tokens)
        return out

    def decode_step(
        self,
        sampler: Sampler = GREEDY,
        logit_mask: LogitMask | None = None,
        matcher: Matcher | None = None,
        attention_rows: Sequence[Sequence[int]] | None = None,
    ) -> int:
        """Run the pending tokens and sample the next token, which becomes pending. A
        `logit_mask` restricts which tokens this step may sample; so does a grammar `matcher`
        (the caller feeds the token back with `matcher.accept`; `generate` does it for you).

        `attention_rows` gives each pending token its own attention mask: one row per pending
        token, each BRLE run lengths (false run first) over the pass's keys, the context's
        `num_committed` earlier slots then the pending tokens; causality applies on top. Not
        with `ctx.attention` (a `Window`), which is the compact form of the same thing."""
        todo = self.pending
        if not todo:
            raise InferenceError("nothing to predict from: fill() the context first")
        constrained = logit_mask is not None or matcher is not None or attention_rows is not None
        if self.adapter is None and self.attention is None and not constrained:
            self._check_fits()
            stages = sampler.stages_to_wit() if isinstance(sampler, Chain) else None
            if stages is None:
                token = _call(_inf.decode, self._live(), todo, sampler.to_wit())
            else:
                token = _call(_inf.decode_chained, self._live(), todo, sampler.to_wit(), *stages)
            self._committed = len(self._tokens)
        else:  # the one-call `decode` carries no adapter or mask: use a full forward pass
            token = self._run_pending(sampler, _NO_PROBE, 0, logit_mask, matcher, attention_rows).token
        self._tokens.append(token)
        return token

    def step(
        self,
        sampler: Sampler = GREEDY,
        logit_mask: LogitMask | None = None,
        matcher: Matcher | None = None,
        top_k: int = 0,
    ) -> tuple[TokenChoice, list[TokenChoice]]:
        """`decode_step` that also reports what it chose from: the sampled token (which becomes
        pending) with its logprob, and the `top_k` most likely tokens (at most
        `model_info().max_probe_k`), best first. Logprobs are after the sampler chain's bias and
        penalties and the mask or grammar, before temperature. One pass, like `decode_step`."""
        out = self._run_pending(sampler, _inf.Probe.LOGPROBS, top_k, logit_mask, matcher)
        token = int(out.token)
        self._tokens.append(token)
        top = [TokenChoice(int(t), float(p)) for t, p in zip(out.topk_ids, out.topk_logprobs, strict=True)]
        return TokenChoice(token, float(out.logprob)), top

    def verify(self, draft: list[int], sampler: Sampler = GREEDY, matcher: Matcher | None = None) -> tuple[int, int]:
        """Speculative decoding's verify step: run the pending tokens and `draft` in one pass,
        sampling a token after every position, and keep the longest prefix of the draft the
        model agrees with plus the model's own next token (which becomes pending). The rejected
        tail's KV is truncated. Returns (number of draft tokens accepted, the new pending token).

        With a `matcher`, the row that predicts draft token j is masked by the grammar state
        after draft tokens 0..j-1 (the hidden state at row i predicts token i+1); the matcher
        is advanced over what is kept. The sampled tokens are exactly those plain decoding with
        the same sampler would produce (seeded draws depend on (seed, position))."""
        todo = self.pending
        if not todo:
            raise InferenceError("nothing to predict from: fill() the context first")
        if matcher is not None:
            draft = _grammatical_prefix(matcher, draft)
        first_row = len(todo) - 1
        forks: list[Matcher] = []
        with _inf.ForwardPass(self._live()) as fp:
            fp.input_tokens(todo + draft)
            self._constrain(fp)
            for j in range(len(draft) + 1):
                _output(fp, first_row + j, sampler, _NO_PROBE, 0)
                if matcher is not None:
                    state = matcher.fork() if j == 0 else forks[-1].fork()
                    if j:
                        state.accept(draft[j - 1])
                    forks.append(state)
                    fp.use_matcher(first_row + j, state.id)
            try:
                outputs = _call(fp.execute)
            finally:
                for state in forks:
                    state.release()
        sampled = [o.token for o in outputs]
        accepted = 0
        while accepted < len(draft) and sampled[accepted] == draft[accepted]:
            accepted += 1
        kept = self._committed + len(todo) + accepted
        if accepted < len(draft):  # the KV of the rejected tail goes
            _call(self._live().truncate, kept)
        self._tokens.extend(draft[:accepted])
        self._tokens.append(sampled[accepted])
        self._committed = kept
        if matcher is not None:
            for token in [*draft[:accepted], sampled[accepted]]:
                matcher.accept(token)
        return accepted, sampled[accepted]

    def top_k(self, k: int) -> list[TokenChoice]:
        """Run the pending tokens and return the `k` most likely next tokens with their
        logprobs, best first. No token is appended: `fill` the one you choose."""
        out = self._run_pending(Greedy(), _inf.Probe.LOGPROBS, k)
        return [TokenChoice(int(t), float(p)) for t, p in zip(out.topk_ids, out.topk_logprobs, strict=True)]

    def generate(
        self,
        max_tokens: int,
        stop: Iterable[int] | None = None,
        sampler: Sampler = GREEDY,
        grammar: Grammar | None = None,
    ) -> Iterator[int]:
        """Sample up to `max_tokens` tokens, yielding each. Stops early at a token in `stop`
        (default: the model's stop tokens), which is appended but not yielded. With a
        `grammar`, every step is constrained by it and generation ends when it is complete.
        Generation also ends, as at `max_tokens`, when the context reaches the model's context
        length (`room` reaches 0: the last token yielded is then pending)."""
        stop_set = set(model_info().stop_tokens if stop is None else stop)
        matcher = grammar.matcher() if grammar is not None else None
        for _ in range(min(max_tokens, model_info().max_context - len(self._tokens) + 1)):
            token = self.decode_step(sampler, matcher=matcher)
            if matcher is not None:
                if not matcher.accept(token):
                    raise InferenceError(f"the host sampled token {token}, which the grammar refuses")
                if matcher.is_terminated():
                    return  # the grammar ended on a stop token: appended, not yielded
            if token in stop_set:
                return
            yield token

    def complete(
        self,
        max_tokens: int,
        stop: Iterable[int] | None = None,
        sampler: Sampler = GREEDY,
        grammar: Grammar | None = None,
        emit_text: bool = False,
    ) -> Completion:
        """`generate` in one call: the host runs the whole loop, so the inferlet pays one
        boundary crossing instead of one per token. Returns the tokens `generate` would have
        yielded (the token that ended generation is appended to the context but not returned).
        With `emit_text`, the host streams their text to the run's output as it goes, like
        `emit` on each piece of `generate_text`. For per-token logic (stop strings, logprobs,
        choosing among candidates), use `generate` or `decode_step`."""
        if max_tokens <= 0:
            return Completion([], False, "")
        stop_list = [int(t) for t in (model_info().stop_tokens if stop is None else stop)]
        matcher = grammar.matcher() if grammar is not None else None
        with self._pending_pass(sampler, _NO_PROBE, 0, matcher=matcher) as fp:
            result = fp.generate(max_tokens, stop_list, emit_text)
        if result.tokens:
            self._tokens.extend(result.tokens)
            self._committed = len(self._tokens) - 1  # the last sampled token is pending
        if result.error is not None:
            raise InferenceError(result.error)
        tokens = list(result.tokens)
        stopped = bool(tokens) and (tokens[-1] in stop_list or (matcher is not None and matcher.is_terminated()))
        if stopped:
            tokens.pop()  # the token that ended generation
        return Completion(tokens, stopped, result.tail)

    def generate_text(
        self,
        max_tokens: int,
        stop: Iterable[int] | None = None,
        sampler: Sampler = GREEDY,
        grammar: Grammar | None = None,
    ) -> Iterator[str]:
        """Like `generate`, yielding printable text pieces instead of tokens."""
        decoder = TextDecoder()
        for token in self.generate(max_tokens, stop, sampler, grammar):
            piece = decoder.push(token)
            if piece:
                yield piece


def _grammatical_prefix(matcher: Matcher, draft: list[int]) -> list[int]:
    """The longest prefix of `draft` the grammar allows (checked on a copy of the matcher)."""
    probe = matcher.fork()
    try:
        for i, token in enumerate(draft):
            if not probe.accept(token):
                return draft[:i]
        return draft
    finally:
        probe.release()


def execute_together(passes: list[_inf.ForwardPass]) -> list[list[_inf.Output]]:
    """Execute configured passes (of different contexts) as one group: they reach the scheduler
    together and share device passes (one a step for the decode steps of k forks). Every one
    runs even after a failure; all are released; then the first failure is raised as
    `InferenceError`, or their outputs are returned, in order."""
    try:
        results = _inf.execute_all([fp.id() for fp in passes]) if passes else []
    finally:
        for fp in passes:
            fp.__exit__(None, None, None)
    outputs = []
    for result in results:
        if isinstance(result, Err):
            raise InferenceError(str(result.value))
        outputs.append(result.value)
    return outputs


SamplerChoice = Sampler | Sequence[Sampler]


def _samplers(contexts: list[Context], sampler: SamplerChoice) -> list[Sampler]:
    if isinstance(sampler, (Greedy, Random, Chain)):
        return [sampler] * len(contexts)
    samplers = list(sampler)
    if len(samplers) != len(contexts):
        raise InferenceError(f"{len(samplers)} samplers for {len(contexts)} contexts: give one, or one per context")
    return samplers


def _run_all(contexts: list[Context], samplers: list[Sampler], probe: _inf.Probe, k: int) -> list[_inf.Output]:
    if len({id(c) for c in contexts}) != len(contexts):
        raise InferenceError("each context may appear only once")
    results = execute_together([c._pending_pass(s, probe, k) for c, s in zip(contexts, samplers, strict=True)])
    for ctx in contexts:
        ctx._committed = len(ctx._tokens)
    return [outputs[0] for outputs in results]


def decode_steps(contexts: list[Context], sampler: SamplerChoice = GREEDY) -> list[int]:
    """`decode_step` on several contexts at once: their passes share device passes instead of
    running one after another. `sampler`: one for all, or one per context (a seeded `Random`
    each for best-of-n, say). Returns one token per context, in order."""
    samplers = _samplers(contexts, sampler)
    plain = all(isinstance(s, (Greedy, Random)) for s in samplers)
    if plain and all(c.adapter is None and c.attention is None for c in contexts):
        return _decode_plain(contexts, sampler if isinstance(sampler, (Greedy, Random)) else samplers)  # type: ignore[arg-type]
    return [choice.token for choice in _decode_all(contexts, samplers, _NO_PROBE)]


def _decode_plain(contexts: list[Context], sampler: Sampler | list[Sampler]) -> list[int]:
    """`decode_steps` without adapters or windows: the whole step in one host call
    (`decode-all`). Contexts whose step ran take their token even when another's failed;
    then the first failure is raised."""
    if len({id(c) for c in contexts}) != len(contexts):
        raise InferenceError("each context may appear only once")
    for ctx in contexts:
        if not ctx.pending:
            raise InferenceError("nothing to predict from: fill() the context first")
        ctx._check_fits()
        handle = ctx._live()
        if ctx._id is None:
            ctx._id = int(handle.id())
    wit = [sampler.to_wit()] if isinstance(sampler, (Greedy, Random)) else [s.to_wit() for s in sampler]
    ids = [int(c._id or 0) for c in contexts]
    results = _inf.decode_all(ids, [c.pending for c in contexts], wit)
    tokens, failure = [], None
    for ctx, result in zip(contexts, results, strict=True):
        if isinstance(result, Err):
            failure = failure or str(result.value)
            continue
        ctx._committed = len(ctx._tokens)
        ctx._tokens.append(int(result.value))
        tokens.append(int(result.value))
    if failure is not None:
        raise InferenceError(failure)
    return tokens


def decode_steps_with_logprobs(contexts: list[Context], sampler: SamplerChoice = GREEDY) -> list[TokenChoice]:
    """`decode_steps`, with each sampled token's logprob under the model (after any logit mask
    or grammar, before the sampler's temperature): summed over a branch, the score that best-of-n,
    beam search and self-consistency compare. One `TokenChoice` per context, in order."""
    return _decode_all(contexts, _samplers(contexts, sampler), _inf.Probe.LOGPROBS)


def _decode_all(contexts: list[Context], samplers: list[Sampler], probe: _inf.Probe) -> list[TokenChoice]:
    choices = [TokenChoice(int(out.token), float(out.logprob)) for out in _run_all(contexts, samplers, probe, 0)]
    for ctx, choice in zip(contexts, choices, strict=True):
        ctx._tokens.append(choice.token)
    return choices


def top_k_all(contexts: list[Context], k: int) -> list[list[TokenChoice]]:
    """`top_k` on several contexts at once (see `decode_steps`)."""
    return [
        [TokenChoice(int(t), float(p)) for t, p in zip(out.topk_ids, out.topk_logprobs, strict=True)]
        for out in _run_all(contexts, [Greedy()] * len(contexts), _inf.Probe.LOGPROBS, k)
    ]


def pages_in_use() -> int:
    """KV pages all of this run's contexts hold on the host now, each shared page once (what
    the daemon's per-run page quota counts, and what the run would leave if it ended now)."""
    return int(_ctx.pages_in_use())
