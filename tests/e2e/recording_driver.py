"""The dummy driver, recording what masked requests it received in its Health stats, so an
end-to-end test can see what a windowed inferlet's passes really carried (loaded by module name
through loopback)."""

from __future__ import annotations

import numpy as np

from bridge_schema.messages import Forward, ForwardResult
from drivers.dummy import DummyDriver
from drivers.dummy import create_driver as create_dummy


class RecordingDriver(DummyDriver):
    def forward(self, f: Forward) -> ForwardResult:
        rows_per_request = np.diff(f.mask_req_indptr.astype(np.int64))
        pages_per_request = np.diff(f.page_indptr.astype(np.int64))
        token_ends = f.token_indptr[1:].astype(np.int64)
        tokens_per_request = np.diff(f.token_indptr.astype(np.int64))
        s = self.stats
        for r in np.flatnonzero(rows_per_request).tolist():
            s["masked_requests"] = int(s.get("masked_requests", 0)) + 1
            s["masked_max_position"] = max(int(s.get("masked_max_position", 0)), int(f.positions[token_ends[r] - 1]))
            if tokens_per_request[r] == 1:  # a decode step
                s["masked_decode_max_pages"] = max(int(s.get("masked_decode_max_pages", 0)), int(pages_per_request[r]))
        return super().forward(f)


def create_driver(argv: list[str]) -> RecordingDriver:
    return RecordingDriver(create_dummy(argv).config)
