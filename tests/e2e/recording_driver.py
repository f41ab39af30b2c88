"""The dummy driver, recording what masked requests it received in its Health stats, so an
end-to-end test can see what a masked inferlet's passes really carried (loaded by module name
through loopback).

Besides the summary counters, `masked_log` (a JSON list, the most recent `LOG_SIZE` masked
requests) holds each masked request as it arrived: `seq` (1, 2, ... across the driver's life),
`context`, `first_position`, its input `tokens`, `num_pages`, `kv_len` and its BRLE `rows`, one per
token (over the keys of the pages it was given: pages the host left out are not counted).
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

import numpy as np

from bridge_schema.messages import Forward, ForwardResult
from drivers.dummy import DummyDriver
from drivers.dummy import create_driver as create_dummy

LOG_SIZE = 4096


class RecordingDriver(DummyDriver):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._log: deque[dict[str, Any]] = deque(maxlen=LOG_SIZE)
        self._num_logged = 0

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
            self._record(f, r, int(pages_per_request[r]))
        return super().forward(f)

    def _record(self, f: Forward, r: int, num_pages: int) -> None:
        first_token = int(f.token_indptr[r])
        first_row = int(f.mask_req_indptr[r])
        rows = [
            f.mask_runs[f.mask_row_indptr[i] : f.mask_row_indptr[i + 1]].tolist()
            for i in range(first_row, int(f.mask_req_indptr[r + 1]))
        ]
        self._num_logged += 1
        self._log.append(
            {
                "seq": self._num_logged,
                "context": int(f.context_ids[r]),
                "first_position": int(f.positions[first_token]),
                "tokens": f.tokens[first_token : int(f.token_indptr[r + 1])].tolist(),
                "num_pages": num_pages,
                "kv_len": (num_pages - 1) * self.page_size + int(f.last_page_len[r]),
                "rows": rows,
            }
        )

    def health(self) -> dict[str, int | float | str]:
        return super().health() | {"masked_log": json.dumps(list(self._log))}


def create_driver(argv: list[str]) -> RecordingDriver:
    return RecordingDriver(create_dummy(argv).config)
