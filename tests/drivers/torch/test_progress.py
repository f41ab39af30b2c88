"""Long steps with nothing to count (the C++ kernels' compile) still show on stderr while they
run, then say how long they took."""

from __future__ import annotations

import time

import pytest

from drivers.torch.progress import ticking


def test_a_long_step_ticks_then_says_it_is_done(capsys: pytest.CaptureFixture[str]) -> None:
    with ticking("compiling", every_s=0.05):
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert err.count("compiling: ") >= 3 and "so far" in err and "compiling: done in" in err
    with ticking("quiet", every_s=0.05, enabled=False):
        time.sleep(0.1)
    assert capsys.readouterr().err == ""
