"""Attention masks: BRLE rows decoded on the device into dense boolean rows over a request's keys.
Knows the wire encoding (run lengths, false run first), not the model or the cache layout."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from drivers.errors import RequestRejected


def check_mask_rows(
    req_indptr: npt.NDArray[np.uint32],
    row_indptr: npt.NDArray[np.uint32],
    runs: npt.NDArray[np.uint32],
    num_tokens: npt.NDArray[np.int64],
    kv_lens: npt.NDArray[np.int64],
) -> None:
    """Every mask row must cover exactly its request's kv_len keys. A shorter row would leave keys
    undefined and a longer one would name keys that do not exist: both are refused, never padded,
    truncated or dropped."""
    if not int(req_indptr[-1]):  # no request has mask rows (most passes)
        return
    for r in range(len(kv_lens)):
        n_rows = int(req_indptr[r + 1] - req_indptr[r])
        if n_rows == 0:
            continue
        if n_rows != num_tokens[r]:
            raise RequestRejected(
                f"request {r} has {n_rows} mask rows for {int(num_tokens[r])} tokens", "mask_req_indptr"
            )
        row0 = int(req_indptr[r])
        bounds = row_indptr[row0 : row0 + n_rows + 1].astype(np.int64)
        csum = np.concatenate(([0], np.cumsum(runs.astype(np.int64))))
        sums = csum[bounds[1:]] - csum[bounds[:-1]]
        bad = np.nonzero(sums != kv_lens[r])[0]
        if len(bad):
            raise RequestRejected(
                f"request {r} mask row {int(bad[0])} covers {int(sums[bad[0]])} keys, its kv_len is {int(kv_lens[r])}",
                "mask_runs",
            )


def decode_brle_rows(row_indptr: torch.Tensor, runs: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Dense bool [rows, num_keys] (True = may attend) from BRLE rows, on the tensors' device.

    Key j of a row lies in run `searchsorted(ends, j, right=True)`; odd runs are true."""
    num_rows = row_indptr.shape[0] - 1
    device = runs.device
    if num_rows == 0:
        return torch.zeros(0, num_keys, dtype=torch.bool, device=device)
    counts = (row_indptr[1:] - row_indptr[:-1]).long()
    width = max(int(counts.max()), 1)
    col = torch.arange(width, device=device)
    valid = col[None, :] < counts[:, None]
    flat = (row_indptr[:-1].long()[:, None] + col[None, :]).clamp(max=max(runs.shape[0] - 1, 0))
    padded = torch.where(valid, runs.long()[flat] if runs.numel() else 0, 0)
    ends = padded.cumsum(-1)
    # Padding runs have length 0 so they end where the row ends; keys past the end land after
    # every run and get a run index of `width`, whatever parity that has, callers never read them.
    keys = torch.arange(num_keys, device=device).expand(num_rows, num_keys).contiguous()
    run_index = torch.searchsorted(ends, keys, right=True)
    return (run_index % 2) == 1
