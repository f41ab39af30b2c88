"""`python -m drivers.torch`'s choice of how a GGUF loads for int8 weights: straight into int8
(no float copy, unsmoothed) when smoothing is off or the float model would not fit, else through
the float model so that w8a8 is smoothed (SmolLM2 and other small files)."""

from __future__ import annotations

import dataclasses

import pytest

from drivers.torch import __main__ as driver_main
from drivers.torch.driver import DriverOptions
from drivers.torch.weights.gguf_loader import smollm2_path


def test_small_files_keep_the_smoothed_float_path_and_big_ones_stream(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    w8a8 = DriverOptions(weights="w8a8")
    assert not driver_main._streams_int8("smollm2", DriverOptions())  # dense: the float path
    assert not driver_main._streams_int8("smollm2", w8a8)  # 0.1 GB: room for the float model
    assert driver_main._streams_int8("smollm2", dataclasses.replace(w8a8, smooth=False))
    assert driver_main._streams_int8(str(smollm2_path()), DriverOptions(weights="int8", dtype="bfloat16"))
    size = smollm2_path().stat().st_size
    monkeypatch.setattr(driver_main, "_available_bytes", lambda: size * 4)  # the float model would not fit
    assert driver_main._streams_int8("smollm2", w8a8)
    assert "go straight into int8, unsmoothed" in capsys.readouterr().err
