"""self_consistency: a chat model that samples several answers to the prompt and answers with
the one most of them agree on (self-consistency, Wang et al. 2022); ties go to the likeliest.

The prompt is filled once; the samples are forks of it, sharing its KV pages, decoded together
in the same device passes. Upload it as a model and call it like any other:

    curl -X POST "$URL/v1/inferlets?model=self-consistency" -H "Authorization: Bearer $KEY" \\
         --data-binary @PATH.wasm   # the component `wafer build self_consistency` writes
    client.chat.completions.create(model="wafer/self-consistency", messages=[...])

Run on its own with the chat protocol's argument:

    wafer run self_consistency -- '{"prompts": [{"messages": [["user", "2+2?"]]}], "max_tokens": 16}'
"""

from collections import Counter

from inferlet import ChatRequest, Context, Random, TextDecoder, chat_model, decode_steps_with_logprobs, model_info

SAMPLES = 5
TEMPERATURE = 0.7  # when the request asks for greedy decoding: greedy samples would all agree


def _vote_key(text: str) -> str:
    return " ".join(text.split()).lower()


def answer(req: ChatRequest):
    grammar = req.grammar()
    if grammar is not None:  # a response format or tools: one answer, constrained
        with Context() as ctx:
            ctx.fill(req.prompt)
            yield from ctx.generate_text(req.max_tokens, sampler=req.sampler, grammar=grammar)
        return
    stop = set(model_info().stop_tokens)
    root = Context()
    root.fill(req.prompt)
    branches = [root.fork() for _ in range(SAMPLES)]
    root.release()  # the branches keep the shared prompt pages
    temperature = req.temperature or TEMPERATURE
    base = -1 if req.seed is None else req.seed + req.choice * SAMPLES
    samplers = [Random(temperature, top_p=req.top_p or 1.0, seed=-1 if base < 0 else base + i) for i in range(SAMPLES)]
    texts, scores = [""] * SAMPLES, [0.0] * SAMPLES
    decoders = [TextDecoder() for _ in branches]
    live = list(range(SAMPLES))
    for _ in range(req.max_tokens):
        if not live:
            break
        choices = decode_steps_with_logprobs([branches[i] for i in live], [samplers[i] for i in live])
        for i, choice in zip(list(live), choices, strict=True):
            scores[i] += choice.logprob
            if choice.token in stop:
                live.remove(i)
            else:
                texts[i] += decoders[i].push(choice.token)
    for branch in branches:
        branch.release()
    votes = Counter(_vote_key(t) for t in texts)
    yield texts[max(range(SAMPLES), key=lambda i: (votes[_vote_key(texts[i])], scores[i]))]


main = chat_model(answer)
