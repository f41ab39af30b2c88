"""SmolLM2 from the embedded GGUF matches transformers' Llama carrying the same dequantized
weights: logits within 1e-3 (fp32) on prefill and decode, and 32 greedy tokens equal."""

from __future__ import annotations

import pytest
import torch

from bridge_schema.messages import Hello
from drivers.torch.weights.checkpoint import Checkpoint
from tests.drivers.torch.helpers import forward, llama_twin, make_driver, request

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. In 1984, 42 people",
    "def fib(n):\n    return n if n < 2 else",
]
PAGES = list(range(8))


@pytest.fixture(scope="module")
def twin(smollm2: Checkpoint) -> torch.nn.Module:
    return llama_twin(smollm2.cfg, smollm2.state)


def test_tokenizer_and_handshake(smollm2: Checkpoint) -> None:
    tok = smollm2.tokenizer
    assert tok is not None
    assert tok.encode("12345").ids == [33, 34, 35, 36, 37]  # digits split one by one
    assert tok.encode("Hello").ids == [19556]  # no BOS added
    assert tok.encode("<|im_end|>").ids == [2]
    hs = make_driver(smollm2, num_pages=8).handshake(Hello(page_size=16, num_pages=8))
    assert hs.driver_kind == "torch" and hs.vocab_size == 49152 and hs.page_size == 16
    assert hs.num_pages == 8 and hs.max_context == 128
    assert list(hs.stop_token_ids) == [2]
    assert list(hs.control_token_ids) == list(range(17))
    assert hs.tokenizer_kind == "huggingface" and "im_start" in hs.chat_template
    assert hs.tokenizer_data == tok.to_str()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_and_decode_logits_match_transformers(smollm2: Checkpoint, twin: torch.nn.Module, prompt: str) -> None:
    assert smollm2.tokenizer is not None
    ids = smollm2.tokenizer.encode(prompt).ids
    drv = make_driver(smollm2, num_pages=8)
    ours = drv.logits(forward([request(ids, 0, PAGES, 16, all_rows=True)]))
    seq = list(ids)
    decoded = []
    for step in range(3):
        seq.append(int(ours[-1].argmax()) if step == 0 else int(decoded[-1].argmax()))
        decoded.append(drv.logits(forward([request(seq[-1:], len(seq) - 1, PAGES, 16)]))[0])
    with torch.no_grad():
        ref = twin(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(ours, ref[: len(ids)], atol=1e-3, rtol=0)
    torch.testing.assert_close(torch.stack(decoded[:-1]), ref[len(ids) : len(seq) - 1], atol=1e-3, rtol=0)


def test_greedy_32_tokens_equal_transformers(smollm2: Checkpoint, twin: torch.nn.Module) -> None:
    assert smollm2.tokenizer is not None
    ids = smollm2.tokenizer.encode(PROMPTS[0]).ids
    drv = make_driver(smollm2, num_pages=8)
    res = drv.forward(forward([request(ids, 0, PAGES, 16)]))
    ours = [int(res.tokens[0])]
    for _ in range(31):
        pos = len(ids) + len(ours) - 1
        ours.append(int(drv.forward(forward([request(ours[-1:], pos, PAGES, 16)])).tokens[0]))
    theirs: list[int] = []
    with torch.no_grad():  # no KV cache on their side: its API changes between releases
        for _ in range(32):
            theirs.append(int(twin(torch.tensor([ids + theirs])).logits[0, -1].argmax()))
    assert ours == theirs


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2: Checkpoint) -> None:
    from transformers import AutoTokenizer

    from drivers.torch.weights.gguf_loader import SMOLLM2_FILE, smollm2_path

    theirs = AutoTokenizer.from_pretrained(str(smollm2_path().parent), gguf_file=SMOLLM2_FILE)
    assert smollm2.tokenizer is not None
    texts = [
        "Hello world 12345!",
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>",
        "  leading spaces,\ttabs\n\nand newlines  ",
        "naïve café — 日本語 🙂 ÅÄÖ",
        "def f(x):\n    return x**2 + 3.14159",
        "e-mail: someone@example.com, price $1,299.99",
    ]
    for text in texts:
        assert smollm2.tokenizer.encode(text).ids == theirs(text)["input_ids"], text


def test_answers_a_question(smollm2: Checkpoint) -> None:
    """Guards the checkpoint adaptation itself (q/k un-permutation, tied head), which a twin
    carrying our own weights cannot see: a mis-adapted model does not know Paris."""
    assert smollm2.tokenizer is not None
    ids = smollm2.tokenizer.encode(PROMPTS[0]).ids
    drv = make_driver(smollm2, num_pages=8)
    out = [int(drv.forward(forward([request(ids, 0, PAGES, 16)])).tokens[0])]
    while len(out) < 8:
        out.append(int(drv.forward(forward([request(out[-1:], len(ids) + len(out) - 1, PAGES, 16)])).tokens[0]))
    assert "Paris" in smollm2.tokenizer.decode(out)
