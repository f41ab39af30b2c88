"""A request's greedy output (and its seeded samples) are the same alone and inside a batch of 8
mixed requests: prefills and decodes, masks, logit masks, random samplers, probes."""

from __future__ import annotations

from bridge_schema.batch import OutputSpec, RequestSpec, Sampler, pack_allowed
from bridge_schema.messages import Probe
from drivers.torch.driver import TorchDriver
from drivers.torch.weights.checkpoint import Checkpoint
from tests.drivers.torch.helpers import brle, forward, make_driver, random_tokens, request

PS = 16
STEPS = 8


def _generate(drv: TorchDriver, prompt: list[int], sampler: Sampler, others: bool) -> list[int]:
    pages = [0, 1]
    out: list[int] = []
    for step in range(STEPS):
        toks, start = (prompt, 0) if step == 0 else (out[-1:], len(prompt) + step - 1)
        mine = request(toks, start, pages, PS, sampler=sampler)
        batch = [mine] + (_noise(drv, step) if others else [])
        batch = batch[::-1] if step % 2 else batch  # position in the batch must not matter either
        res = drv.forward(forward(batch))
        out.append(int(res.tokens[0 if step % 2 == 0 or not others else -1]))  # mine is first or last
    return out


def _noise(drv: TorchDriver, step: int) -> list[RequestSpec]:
    """Seven other requests, each on its own pages: prefills of several lengths, a decode, a
    custom attention mask, a logit mask, random samplers and probes."""
    v = drv.cfg.vocab_size
    specs = []
    for i in range(7):
        pages = [2 + 3 * i, 3 + 3 * i, 4 + 3 * i]
        n = [1, 5, 17, 30, 2, 9, 40][i]
        toks = random_tokens(n, v, seed=100 * step + i)
        outputs = [OutputSpec(row=n - 1, sampler=Sampler.random(1.3, top_k=40, top_p=0.9, seed=i))]
        mask_rows = None
        if i == 3:
            outputs = [OutputSpec(row=n - 1, probe=Probe.LOGPROBS | Probe.DISTRIBUTION, probe_k=5)]
            mask_rows = [brle([j % 2 == 0 or j == r for j in range(r + 1)] + [False] * (n - r - 1)) for r in range(n)]
        if i == 5:
            outputs = [OutputSpec(row=r, logit_mask=pack_allowed(v, [7, 8, 9])) for r in range(0, n, 3)]
        specs.append(request(toks, 0, pages, PS, outputs=outputs, mask_rows=mask_rows, context_id=i + 1))
    return specs


def test_greedy_alone_equals_in_batch_of_8(smollm2: Checkpoint) -> None:
    assert smollm2.tokenizer is not None
    prompt = smollm2.tokenizer.encode("<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n").ids
    drv = make_driver(smollm2, page_size=PS, num_pages=32)
    alone = _generate(drv, prompt, Sampler.greedy(), others=False)
    batched = _generate(drv, prompt, Sampler.greedy(), others=True)
    assert alone == batched


def test_seeded_sampling_alone_equals_in_batch_of_8(smollm2: Checkpoint) -> None:
    prompt = random_tokens(12, 49152, seed=9)
    drv = make_driver(smollm2, page_size=PS, num_pages=32)
    s = Sampler.random(temperature=1.0, top_p=0.95, seed=1234)
    assert _generate(drv, prompt, s, others=False) == _generate(drv, prompt, s, others=True)
