"""The CUDA path of the torch driver checked on a real GPU, in one short run (`make gpu-check`,
about 5 minutes): SmolLM2 decoding 64 greedy tokens on the GPU (float32 without and with CUDA
graphs, then bfloat16) compared with the CPU path's tokens, then a short `bench/decode.py
--device cuda`. The Triton kernel and CUDA-graph tests on CUDA run before it (`make gpu-check`
runs them with TRITON_INTERPRET=0). Writes bench/results/gpu_check.json; exits 1 if the GPU's
float32 tokens (with or without graphs) differ from the CPU's in the first 16."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge_schema.batch import OutputSpec, RequestSpec, build_forward
from bridge_schema.messages import Hello
from drivers.torch.driver import DriverOptions, TorchDriver
from drivers.torch.weights.checkpoint import load_checkpoint

PROMPT = "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n"
NEW_TOKENS = 64


def greedy(drv: TorchDriver, prompt: list[int], n: int) -> tuple[list[int], float]:
    """n greedy tokens after `prompt` and the decode rate (tokens/s after the first)."""
    ps, pages = 16, list(range((len(prompt) + n + 15) // 16))

    def spec(tokens: list[int], start: int) -> RequestSpec:
        kv = start + len(tokens)
        used = pages[: (kv + ps - 1) // ps]
        return RequestSpec(
            0, tokens, list(range(start, kv)), used, kv - (len(used) - 1) * ps, [OutputSpec(len(tokens) - 1)]
        )

    out = [int(drv.forward(build_forward(0, [spec(prompt, 0)])).tokens[0])]
    start = time.perf_counter()
    for i in range(n - 1):
        out.append(int(drv.forward(build_forward(i + 1, [spec([out[-1]], len(prompt) + i)])).tokens[0]))
    return out, (n - 1) / (time.perf_counter() - start)


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    ckpt = load_checkpoint("smollm2")
    assert ckpt.tokenizer is not None
    prompt = ckpt.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    runs = {}
    for device, dtype, graphs in (
        ("cpu", "float32", False),
        ("cuda", "float32", False),
        ("cuda", "float32", True),
        ("cuda", "bfloat16", True),
    ):
        drv = TorchDriver(ckpt, DriverOptions(device=device, dtype=dtype, num_pages=16, cuda_graphs=graphs))
        drv.handshake(Hello())
        tokens, rate = greedy(drv, prompt, NEW_TOKENS)
        name = f"{device} {dtype}" + (" graphs" if graphs else "")
        runs[name] = tokens
        text = ckpt.tokenizer.decode(tokens)
        served = ""
        if drv.graphs is not None:  # only on CUDA with graphs on
            why_off = f"; {drv.graphs.disabled}" if drv.graphs.disabled else ""
            served = f" ({drv.graphs.passes} passes from CUDA graphs{why_off})"
        print(f"{name}: {rate:.1f} tok/s{served}: {text!r}", flush=True)
        results[name.replace(" ", "_")] = {"tokens": tokens, "decode_tok_s": rate, "text": text}
    cpu = runs["cpu float32"]

    def agree(other: str) -> int:
        return next((i for i, (a, b) in enumerate(zip(cpu, runs[other], strict=True)) if a != b), len(cpu))

    same, same_graphs, same_bf16 = agree("cuda float32"), agree("cuda float32 graphs"), agree("cuda bfloat16 graphs")
    print(
        f"float32: GPU and CPU tokens agree on the first {same} of {len(cpu)}, with CUDA graphs {same_graphs}; "
        f"bfloat16 (graphs): {same_bf16}"
    )
    results["agree_float32"], results["agree_float32_graphs"] = same, same_graphs
    results["agree_bfloat16"] = same_bf16
    bench = subprocess.run(
        [
            sys.executable,
            "bench/decode.py",
            "--device",
            "cuda",
            "--dtype",
            "float32,float32+graphs,bfloat16,bfloat16+graphs",
            "--batches",
            "1,8,32",
            "--repeats",
            "1",
            "--json",
            "bench/results/decode_cuda.json",
        ],
        check=False,
    )
    results["bench_rc"] = bench.returncode
    out = Path("bench/results/gpu_check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    # Float32 on two devices may round differently and flip a near tie late in a long greedy
    # decode; the first 16 tokens must agree.
    return 0 if min(same, same_graphs) >= 16 and bench.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
