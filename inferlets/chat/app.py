"""chat: the daemon's built-in generator behind the OpenAI-compatible endpoints.

It takes one JSON argument (the request, already validated by the host), fills each prompt once,
forks it into `n` branches that share the prompt's KV pages, and decodes every live branch in the
same device passes. It streams JSON messages through `send` (see README.md for their shapes).
The common request (one prompt, one choice, no stop strings, no logprobs) hands its whole
generation loop to the host instead, which streams the text as run output.
"""

import json

from componentize_py_types import Err
from decoding import Branch, StopMatcher, Utf8Decoder
from inferlet import (
    DRY,
    XTC,
    Chain,
    Context,
    Grammar,
    Greedy,
    InferenceError,
    InferletError,
    LogitBias,
    MinP,
    Mirostat,
    Penalties,
    Random,
    Temperature,
    TopK,
    TopNSigma,
    TopP,
    Typical,
    execute_together,
    model_info,
    render_chat,
    send,
    tokenize,
)
from wit_world.imports import context as _ctx
from wit_world.imports import grammar as _g
from wit_world.imports import inference as _inf


def _call(fn, *args):
    try:
        return fn(*args)
    except Err as e:
        raise InferletError(str(e.value)) from None


def _sampler(req: dict, branch_index: int, prompt_length: int) -> Greedy | Random | Chain:
    """The request's sampler for branch `branch_index`: a `Chain` when it has penalties, a logit
    bias, top_k, min_p or llama.cpp's filters (typical_p, top_n_sigma, xtc). OpenAI's presence
    and frequency penalties count the completion only (the slots from `prompt_length` on),
    vLLM's repetition penalty the prompt too."""
    temperature = float(req.get("temperature", 1.0))
    top_p = float(req.get("top_p", 1.0))
    greedy = temperature == 0 or top_p == 0
    seed = req.get("seed")
    # Branch i draws with seed + i: seeded choices are reproducible and differ from each other.
    seed = -1 if seed is None else (int(seed) + branch_index) % (1 << 63)
    stages = []
    bias = {int(t): float(v) for t, v in req.get("logit_bias", {}).items()}
    if bias:
        stages.append(LogitBias(bias))
    repetition = float(req.get("repetition_penalty", 1.0))
    presence, frequency = float(req.get("presence_penalty", 0.0)), float(req.get("frequency_penalty", 0.0))
    if repetition != 1.0 or presence or frequency:
        last_n = int(req.get("penalty_last_n", 0))  # llama.cpp's repeat_last_n
        stages.append(Penalties(repetition, presence, frequency, since=prompt_length, last_n=last_n))
    if "dry" in req:  # llama.cpp's DRY; the daemon has turned its breaker strings into token ids
        d = req["dry"]
        stages.append(DRY(d["multiplier"], d["base"], d["allowed_length"], d["last_n"], tuple(d["breakers"])))
    filters = []
    if float(req.get("typical_p", 1.0)) != 1.0:
        filters.append(Typical(float(req["typical_p"])))
    if float(req.get("top_n_sigma", 0.0)):
        filters.append(TopNSigma(float(req["top_n_sigma"])))
    if float(req.get("xtc_probability", 0.0)):
        filters.append(XTC(float(req["xtc_probability"]), float(req.get("xtc_threshold", 0.1))))
    if float(req.get("mirostat_tau", 0.0)):
        filters.append(Mirostat(float(req["mirostat_tau"]), float(req.get("mirostat_eta", 0.1))))
    top_k, min_p = int(req.get("top_k", 0)), float(req.get("min_p", 0.0))
    if not stages and not filters and not top_k and not min_p:
        return Greedy() if greedy else Random(temperature, top_p=top_p, seed=seed)
    if greedy:
        return Chain(*stages, Greedy())
    random_stages = [Temperature(temperature), TopK(top_k), TopP(top_p), MinP(min_p), *filters]
    return Chain(*stages, *random_stages, seed=seed)


def _prompt_tokens(prompt: dict) -> list[int]:
    if "messages" in prompt:
        return tokenize(render_chat([(m[0], m[1]) for m in prompt["messages"]], True))
    if "text" in prompt:
        return tokenize(prompt["text"])
    return [int(t) for t in prompt["tokens"]]


def _fill(tokens: list[int], score_k: int = -1) -> tuple[_ctx.Context, list]:
    """A context holding all prompt tokens but the last, which stays pending: it is the input
    that predicts the first generated token. With `score_k` >= 0, also each prompt token's
    logprob given the ones before it (the first has none), with the top `score_k`: the entries
    a completion's `echo` reports."""
    ctx = _call(_ctx.Context.create)
    entries = [[tokens[0], None, [], []]] if score_k >= 0 else []
    if len(tokens) > 1:
        with _inf.ForwardPass(ctx) as fp:
            fp.input_tokens(tokens[:-1])
            if score_k >= 0:
                for row in range(len(tokens) - 1):
                    fp.score(row, tokens[row + 1], score_k)
            outputs = _call(fp.execute)
        for row, out in enumerate(outputs):
            entries.append([tokens[row + 1], float(out.logprob), list(out.topk_ids), list(out.topk_logprobs)])
    return ctx, entries


def _step(branches: list[Branch], probe: _inf.Probe, probe_k: int) -> list[_inf.Output]:
    """One decode step of every branch: all passes are submitted first so they share a pass."""
    passes = []
    for b in branches:
        fp = _inf.ForwardPass(b.ctx)
        fp.input_tokens([b.pending])
        fp.output(0, b.sampler.to_wit(), probe, probe_k)
        if b.stages is not None:
            fp.sampler_stages(0, *b.stages)
        if b.matcher is not None:
            fp.use_matcher(0, b.matcher.id())
        passes.append(fp)
    try:
        results = execute_together(passes)
    except InferenceError as e:
        raise InferletError(str(e)) from None
    return [outputs[0] for outputs in results]


def _generate_on_host(req: dict, stop_tokens: set[int], max_tokens: int) -> None:
    """One prompt, one choice, no stop strings, no logprobs: the host runs the loop and streams
    the text as run output (the daemon reads it as choice 0's deltas); then one message says how
    it ended."""
    tokens = _prompt_tokens(req["prompts"][0])
    if not tokens:
        raise InferletError("prompt 0 is empty")
    send(json.dumps({"prompt_tokens": [len(tokens)]}))
    grammar = None
    if "grammar" in req:
        spec = req["grammar"]
        grammar = Grammar(spec["kind"], spec["text"], **spec["options"])
    with Context() as ctx:
        ctx.fill(tokens)
        before = len(ctx.tokens)
        try:
            done = ctx.complete(
                max_tokens,
                stop=sorted(stop_tokens),
                sampler=_sampler(req, 0, len(tokens)),
                grammar=grammar,
                emit_text=True,
            )
        except InferenceError as e:
            raise InferletError(str(e)) from None
        generated = len(ctx.tokens) - before  # the token that ended it included, as below
    finished = [[0, "stop" if done.stopped else "length", generated]]
    send(json.dumps({"deltas": [[0, done.tail, None]], "finished": finished}))


def main(args: list[str]) -> None:
    if len(args) != 1:
        raise InferletError("chat takes one argument: the request as JSON")
    req = json.loads(args[0])
    n = int(req.get("n", 1))
    max_tokens = int(req["max_tokens"])
    want_logprobs = bool(req.get("logprobs", False))
    probe_k = int(req.get("top_logprobs", 0))
    probe = _inf.Probe.LOGPROBS if want_logprobs else _inf.Probe(0)
    stops = [s for s in req.get("stop", []) if s]
    # ignore_eos: stop tokens are generated like any other, except where a grammar ends the text.
    is_ignore_eos = bool(req.get("ignore_eos")) and "grammar" not in req
    stop_tokens = set() if is_ignore_eos else set(model_info().stop_tokens)
    if n == 1 and len(req["prompts"]) == 1 and not stops and not want_logprobs:
        _generate_on_host(req, stop_tokens, max_tokens)
        return
    grammar = None
    if "grammar" in req:  # response_format: every step masked by the grammar, on the host
        spec = req["grammar"]
        grammar = _call(_g.Grammar.compile, spec["kind"], spec["text"], json.dumps(spec["options"]))

    branches: list[Branch] = []
    prompt_lengths = []
    prompt_logprobs = []
    score_k = probe_k if req.get("echo_logprobs") else -1
    for p_index, prompt in enumerate(req["prompts"]):
        tokens = _prompt_tokens(prompt)
        if not tokens:
            raise InferletError(f"prompt {p_index} is empty")
        prompt_lengths.append(len(tokens))
        root, scored = _fill(tokens, score_k)
        if scored:
            prompt_logprobs.append([p_index, scored])
        for i in range(n):
            ctx = root if i == n - 1 else _call(root.fork)
            index = p_index * n + i
            sampler = _sampler(req, index, len(tokens))
            branch = Branch(index, ctx, tokens[-1], sampler, Utf8Decoder(), StopMatcher(stops))
            if isinstance(sampler, Chain):
                branch.stages = sampler.stages_to_wit()
            if grammar is not None:
                branch.matcher = _g.Matcher(grammar)
            branches.append(branch)
    send(json.dumps({"prompt_tokens": prompt_lengths}))
    if prompt_logprobs:
        send(json.dumps({"prompt_logprobs": prompt_logprobs}))

    live = list(branches)
    while live:
        outputs = _step(live, probe, probe_k)
        deltas, finished = [], []
        for b, out in zip(live, outputs, strict=True):
            token = int(out.token)
            b.pending = token
            b.num_tokens += 1
            if b.matcher is not None and not b.matcher.accept(token):
                raise InferletError(f"the grammar refused token {token}, which its own mask allowed")
            entry = [token, float(out.logprob), list(out.topk_ids), list(out.topk_logprobs)] if want_logprobs else None
            if token in stop_tokens:
                deltas.append([b.index, b.stop.flush(b.decoder.flush()), entry])
                b.finish_reason = "stop"
            else:
                text, hit = b.stop.push(b.decoder.push(token))
                if hit:
                    b.finish_reason = "stop"
                elif b.num_tokens >= max_tokens:
                    text += b.stop.flush(b.decoder.flush())
                    b.finish_reason = "length"
                deltas.append([b.index, text, entry])
            if b.finish_reason is not None:  # with the stop sequence that ended it, if one did
                finished.append([b.index, b.finish_reason, b.num_tokens, b.stop.matched])
        send(json.dumps({"deltas": deltas, "finished": finished}))
        for b in [b for b in live if b.finish_reason is not None]:
            b.ctx.__exit__(None, None, None)  # free the branch's pages as soon as it is done
        live = [b for b in live if b.finish_reason is None]
