"""Field-by-field equality of messages (numpy arrays compared by dtype and value)."""

from __future__ import annotations

import dataclasses

import numpy as np

from bridge_schema.messages import Message


def assert_same(a: Message, b: Message) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype, f.name
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        else:
            assert x == y, f.name
