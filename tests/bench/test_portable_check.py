"""bench/portable_check.py's verdicts: each bar against decode.py's JSON, at and around its target."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "portable_check.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("portable_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _module()
BEST = "float32+w8a8+compile+kv16+avx2"
BASE = "float32+avx2"


def _result(decode1: float = 160.0, bound1: float = 200.0, decode8: float = 450.0, hf8: float = 100.0,
            peer: float | None = 120.0, prefill: tuple[float, float] = (500.0, 900.0)) -> dict[str, Any]:  # fmt: skip
    def row(dtype: str, batch: int, pre: float, dec: float, bound: float, hf: float) -> dict[str, Any]:
        return {"dtype": dtype, "batch": batch, "prefill_tok_s": pre, "decode_tok_s": dec, "decode_bound_tok_s": bound,
                "hf_prefill_tok_s": 400.0, "hf_decode_tok_s": hf}  # fmt: skip

    rows = [
        row(BASE, 1, 450.0, 23.0, 60.0, 17.0),
        row(BASE, 8, 700.0, 95.0, 480.0, hf8),
        row(BEST, 1, prefill[0], decode1, bound1, 17.0),
        row(BEST, 8, prefill[1], decode8, 8 * bound1, hf8),
    ]
    peers = (
        []
        if peer is None
        else [{"peer": "llama.cpp", "version": "0.3.36", "prefill_tok_s": 300.0, "decode_tok_s": peer}]
    )
    cpu = {"model": "AMD EPYC", "features": ["avx2", "fma"], "torch_isa": "AVX2"}
    return {"meta": {"cpu": cpu}, "rows": rows, "peers": peers}


def _verdicts(result: dict[str, Any]) -> dict[str, tuple[float | None, bool]]:
    return {v["bar"]: (v["measured"], v["met"]) for v in check.evaluate(result, BEST, BASE)}


def test_every_bar_met_and_measured() -> None:
    got = _verdicts(_result())
    assert got == {
        "batch-1 decode vs llama.cpp": (pytest.approx(160 / 120), True),
        "batch-1 decode vs llama.cpp (stretch)": (pytest.approx(160 / 120), True),
        "batch-1 decode, share of the bandwidth bound": (pytest.approx(0.8), True),
        "batch-8 decode vs transformers": (pytest.approx(4.5), True),
        "w8a8 prefill vs float32, batch 1": (pytest.approx(500 / 450), True),
        "w8a8 prefill vs float32, batch 8": (pytest.approx(900 / 700), True),
    }


@pytest.mark.parametrize(
    ("change", "bar", "met"),
    [
        ({"decode1": 140.0}, "batch-1 decode, share of the bandwidth bound", True),  # exactly 70%
        ({"decode1": 139.0}, "batch-1 decode, share of the bandwidth bound", False),
        ({"peer": 240.0}, "batch-1 decode vs llama.cpp", True),  # 160 / 240 = 0.67
        ({"peer": 270.0}, "batch-1 decode vs llama.cpp", False),  # 0.59
        ({"peer": 170.0}, "batch-1 decode vs llama.cpp (stretch)", False),
        ({"decode8": 299.0}, "batch-8 decode vs transformers", False),
        ({"prefill": (449.0, 900.0)}, "w8a8 prefill vs float32, batch 1", False),
        ({"prefill": (500.0, 699.0)}, "w8a8 prefill vs float32, batch 8", False),
    ],
)
def test_a_bar_flips_at_its_target(change: dict[str, Any], bar: str, met: bool) -> None:
    got = _verdicts(_result(**change))
    assert got[bar][1] is met
    # The other bars are unaffected (a change of llama.cpp's speed moves both of its bars).
    others = [ok for name, (_, ok) in got.items() if not name.startswith(bar.split(" (")[0])]
    assert others and all(others)


def test_a_missing_peer_is_not_measured_and_not_met() -> None:
    got = _verdicts(_result(peer=None))
    assert got["batch-1 decode vs llama.cpp"] == (None, False)
    assert got["batch-1 decode, share of the bandwidth bound"][1] is True


def test_judging_an_earlier_run_from_its_json(tmp_path: Path) -> None:
    decode = tmp_path / "decode.json"
    decode.write_text(json.dumps(_result(decode1=130.0)))
    out = tmp_path / "check.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-json", str(decode), "--out", str(out)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "| batch-1 decode, share of the bandwidth bound | 65% | 70% | NO |" in run.stdout
    assert "C++ kernels capped at avx2" in run.stdout and "only approximates it" in run.stdout
    saved = json.loads(out.read_text())
    assert saved["best"] == BEST and saved["baseline"] == BASE
    assert [v["met"] for v in saved["verdicts"]] == [True, True, False, True, True, True]
