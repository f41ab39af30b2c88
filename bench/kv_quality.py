"""What a float16 KV cache costs in accuracy, next to what w8a8 weights cost: SmolLM2 reads real
text (this repository's README and a source file by default) one token per decode pass, as
generation does, so every step attends over the keys the cache holds; each entry's next-token
distributions are compared with the float32 model's over a float32 cache (the reference):
perplexity of the text, mean KL(reference || entry) in nats, how often the top token is the
reference's, and the longest greedy continuation (of a chat prompt) equal to the reference's.

    python bench/kv_quality.py [--dtype float32+kv16,float32+w8a8+compile,...] [--tokens 1024]
                               [--threads 2] [--text PATH ...] [--json PATH]

Entries are bench/decode.py --dtype entries. Prints a table and writes JSON. Not part of the test
run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import _request, capped, cpu_description, make_driver

from bridge_schema.batch import build_forward
from drivers.torch.driver import TorchDriver
from drivers.torch.weights.checkpoint import load_checkpoint

REFERENCE = "float32"
ROOT = Path(__file__).resolve().parents[1]
CHAT = "<|im_start|>user\nExplain how a hash table works, step by step.<|im_end|>\n<|im_start|>assistant\n"
PAGE = 16


def read_logits(drv: TorchDriver, tokens: list[int], prompt: int) -> torch.Tensor:
    """Log-probabilities [len(tokens) - prompt, V] of tokens[prompt:], each from a decode pass
    over the keys before it (the first `prompt` tokens are one prefill pass)."""
    per = (len(tokens) + PAGE - 1) // PAGE
    out = [drv.logits(build_forward(0, [_request(0, tokens[:prompt], 0, PAGE, per)]))[-1]]
    for s in range(prompt, len(tokens) - 1):
        out.append(drv.logits(build_forward(s, [_request(0, [tokens[s]], s, PAGE, per)]))[0])
    return torch.log_softmax(torch.stack(out).float(), dim=-1)


def greedy(drv: TorchDriver, prompt: list[int], new: int) -> list[int]:
    per = (len(prompt) + new + PAGE - 1) // PAGE
    logits = drv.logits(build_forward(0, [_request(0, prompt, 0, PAGE, per)]))[-1]
    out = [int(logits.argmax())]
    for s in range(new - 1):
        logits = drv.logits(build_forward(s + 1, [_request(0, [out[-1]], len(prompt) + s, PAGE, per)]))[0]
        out.append(int(logits.argmax()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32+kv16,float32+w8a8+compile,float32+w8a8+compile+kv16")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens read from each text")
    parser.add_argument("--prompt", type=int, default=16, help="tokens of each text given as one prefill pass")
    parser.add_argument("--greedy", type=int, default=128, help="greedy tokens generated after the chat prompt")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--text", nargs="*", default=[str(ROOT / "README.md"), str(ROOT / "drivers/torch/model.py")])
    parser.add_argument("--json", default="bench/results/kv_quality.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = cpu_description()
    print(f"CPU: {cpu['model']}; C++ kernels: {cpu['kernels']}", flush=True)
    ckpt = load_checkpoint("smollm2")
    assert ckpt.tokenizer is not None
    texts = {Path(p).name: ckpt.tokenizer.encode(Path(p).read_text()).ids[: args.tokens] for p in args.text}
    chat = ckpt.tokenizer.encode(CHAT).ids
    pages = (max(len(t) for t in texts.values()) + args.greedy + len(chat)) // PAGE + 2
    results: dict[str, dict[str, object]] = {}
    for spec in [REFERENCE, *args.dtype.split(",")]:
        with capped(spec):
            drv = make_driver(ckpt, spec, "cpu", pages)
            start = time.perf_counter()
            logp = {name: read_logits(drv, toks, args.prompt) for name, toks in texts.items()}
            tokens = greedy(drv, chat, args.greedy)
            del drv
        results[spec] = {"logp": logp, "greedy": tokens}
        read = sum(len(t) for t in texts.values())
        print(f"{spec}: read {read} tokens in {time.perf_counter() - start:.1f} s", flush=True)
    ref = results[REFERENCE]
    rows = []
    for spec, res in results.items():
        row: dict[str, object] = {"dtype": spec}
        for name, toks in texts.items():
            lp, rp = res["logp"][name], ref["logp"][name]  # type: ignore[index]
            target = torch.tensor(toks[args.prompt :])
            nll = -lp.gather(1, target[:, None]).mean().item()
            kl = (rp.exp() * (rp - lp)).sum(-1).mean().item()
            top = (lp.argmax(-1) == rp.argmax(-1)).float().mean().item()
            row[name] = {"perplexity": math.exp(nll), "kl": kl, "top1_agree": top, "tokens": len(target)}
        mine, theirs = res["greedy"], ref["greedy"]  # type: ignore[assignment]
        differ = [i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b]
        row["greedy_equal_prefix"] = differ[0] if differ else len(mine)
        rows.append(row)
    print()
    head = " | ".join(f"{n} ppl | {n} KL | {n} top-1 =" for n in texts)
    print(f"| dtype | {head} | greedy equal of {args.greedy} |")
    print("|---" * (2 + 3 * len(texts)) + "|")
    for row in rows:
        cells = " | ".join(
            f"{row[n]['perplexity']:.3f} | {row[n]['kl']:.2e} | {row[n]['top1_agree']:.1%}"  # type: ignore[index]
            for n in texts
        )
        print(f"| {row['dtype']} | {cells} | {row['greedy_equal_prefix']} |")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu, "tokens": args.tokens, "prompt": args.prompt, "texts": list(texts), "reference": REFERENCE}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
