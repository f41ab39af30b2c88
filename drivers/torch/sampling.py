"""Logit masks, samplers and probe outputs for a pass's output rows. Avoids the CPU's slow paths
(`torch.multinomial`, `exponential_`, full-vocabulary sorts): greedy is a max, random sampling is
inverse-CDF over a top-256 prefilter, and seeded draws come from `seeded_uniform(seed, position)`
so a request samples the same tokens alone or in any batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from bridge_schema.batch import logit_mask_words
from bridge_schema.messages import Forward, Probe, SamplerKind
from bridge_schema.sampling import seeded_uniform, xtc_uniform
from drivers.errors import RequestRejected
from drivers.sampler_chain import PREFILTER, SlotTokens, bias_entries, dry_entries, penalty_entries
from drivers.torch.kernels import cpu_kernels

# As a plain int: numpy compares an array with an IntEnum member through Python-level calls
# (warm ~3.2 against ~1.3 us; right after the model's graph, with cold caches, ~35 against ~24).
_RANDOM = int(SamplerKind.RANDOM)


@dataclass(slots=True)
class Sampled:
    tokens: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    topk_indptr: npt.NDArray[np.uint32]
    topk_ids: npt.NDArray[np.uint32]
    topk_logprobs: npt.NDArray[np.float32]
    dist_indptr: npt.NDArray[np.uint32]
    dists: npt.NDArray[np.float32]


def unpack_logit_masks(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [K, vocab_size] from u32 words [K, W]; bit j of word i is token 32i+j."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int64)
    bits = (words.to(torch.int64)[..., None] >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


@dataclass(slots=True)
class SamplingPlan:
    """What `sample` does for a pass, worked out (its logit masks and temperatures checked) from
    the request alone, before the model runs: a bad mask or temperature is refused before any
    compute, and no K/V is written for it."""

    mask_rows: torch.Tensor | None  # output rows with a logit mask (None: no row has one)
    allowed: torch.Tensor | None  # bool [len(mask_rows), vocab]: each such row's allowed tokens
    random_rows: npt.NDArray[np.int64]  # output rows sampled at random (the others: greedy)
    probe_rows: npt.NDArray[np.int64]  # output rows with probes (logprobs, top-k, distribution)


def plan_sampling(fwd: Forward, vocab_size: int, device: torch.device) -> SamplingPlan:
    """The pass's `SamplingPlan`; raises `RequestRejected` for a random row whose temperature is
    not > 0, and for logit masks that are not rows of the vocabulary's words or allow no token."""
    random_rows, probe_rows = np.flatnonzero(fwd.sampler == _RANDOM), np.flatnonzero(fwd.probe)
    if len(random_rows) and not np.all(fwd.temperature[random_rows] > 0):
        raise RequestRejected("temperature must be > 0 for random sampling", "temperature")
    if not fwd.logit_mask_index.size or int(fwd.logit_mask_index.max()) < 0:
        return SamplingPlan(None, None, random_rows, probe_rows)
    index = fwd.logit_mask_index.astype(np.int64)
    width = logit_mask_words(vocab_size)
    num_masks = fwd.logit_masks.size // width
    if fwd.logit_masks.size != num_masks * width or int(index.max()) >= num_masks:
        raise RequestRejected(f"logit masks must be rows of {width} words", "logit_masks")
    words = torch.as_tensor(fwd.logit_masks.astype(np.int64).reshape(num_masks, width), device=device)
    allowed = unpack_logit_masks(words, vocab_size)
    used = np.unique(index[index >= 0])
    empty = used[~allowed[torch.as_tensor(used, device=device)].any(-1).cpu().numpy()]
    if len(empty):
        raise RequestRejected(f"logit mask {int(empty[0])} allows no token", "logit_masks")
    rows = torch.as_tensor(np.nonzero(index >= 0)[0], device=device)
    return SamplingPlan(rows, allowed[torch.as_tensor(index[index >= 0], device=device)], random_rows, probe_rows)


def apply_logit_masks(logits: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
    if plan.mask_rows is None or plan.allowed is None:  # set together
        return logits
    masked = logits.clone()
    masked[plan.mask_rows] = logits[plan.mask_rows].masked_fill(~plan.allowed, float("-inf"))
    return masked


def apply_chain(logits: torch.Tensor, fwd: Forward, slot_tokens: SlotTokens) -> torch.Tensor:
    """`logits` [O, V] after the chain's logit bias, penalties and DRY (`drivers.sampler_chain`),
    as sparse gathers and scatters of the touched (row, token) pairs; `logits` itself when the
    pass has neither."""
    if not len(fwd.logit_bias_ids) and not len(fwd.repetition_penalty) and not len(fwd.dry_multiplier):
        return logits
    bias, penalties, dry = bias_entries(fwd), penalty_entries(fwd, slot_tokens), dry_entries(fwd, slot_tokens)
    if bias is None and penalties is None and dry is None:
        return logits
    out = logits.clone()
    device = logits.device

    def tensor(values: npt.NDArray[np.generic]) -> torch.Tensor:
        return torch.as_tensor(values, device=device)

    if bias is not None:
        assert bias.bias is not None
        out.index_put_((tensor(bias.rows), tensor(bias.ids)), tensor(bias.bias), accumulate=True)
    if penalties is not None:
        e = penalties
        assert e.counts is not None and e.repeated is not None and e.repetition is not None
        assert e.presence is not None and e.frequency is not None
        where = (tensor(e.rows), tensor(e.ids))
        v = out[where]
        repetition, counts = tensor(e.repetition), tensor(e.counts)
        v = torch.where(tensor(e.repeated), torch.where(v > 0, v / repetition, v * repetition), v)
        out[where] = v - tensor(e.presence) * (counts > 0) - tensor(e.frequency) * counts
    if dry is not None:
        assert dry.bias is not None
        out.index_put_((tensor(dry.rows), tensor(dry.ids)), tensor(dry.bias), accumulate=True)
    return out


def _uniforms(
    fwd: Forward,
    rows: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
    gen: torch.Generator,
    stream: Callable[[npt.ArrayLike, npt.ArrayLike], npt.NDArray[np.float64]] = seeded_uniform,
) -> npt.NDArray[np.float64]:
    """Each random row's draw in [0, 1): from `stream(seed, position)` where seeded (the token's
    draw, or XTC's), else from `gen`."""
    seeds = fwd.seed[rows]
    u = np.empty(len(rows), dtype=np.float64)
    seeded = seeds >= 0
    u[seeded] = stream(seeds[seeded], positions[seeded])
    if np.any(~seeded):
        u[~seeded] = torch.rand(int((~seeded).sum()), generator=gen, dtype=torch.float64).numpy()
    return u


def _random_tokens(
    logits: torch.Tensor,
    fwd: Forward,
    rows: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
    gen: torch.Generator,
    slot_tokens: SlotTokens,
) -> torch.Tensor:
    """The random rows' tokens: the C++ op where it runs (`cpu_kernels.sample_rows`, one pass
    over each row), else these torch steps, which it follows. Mirostat's mu comes from, and goes
    back to, `slot_tokens`."""
    u = _uniforms(fwd, rows, positions, gen)
    if len(fwd.typical_p):  # filters the C++ op does not run
        xtc = _uniforms(fwd, rows, positions, gen, xtc_uniform)
        if not np.count_nonzero(fwd.mirostat_tau[rows]):
            return _random_tokens_torch(logits, fwd, rows, u, xtc)[0]
        tokens, mu = _random_tokens_torch(logits, fwd, rows, u, xtc, slot_tokens.mirostat_mu(fwd, rows))
        slot_tokens.set_mirostat_mu(fwd, rows, mu)
        return tokens
    native = cpu_kernels.sample_rows(
        logits, rows, fwd.temperature[rows], fwd.top_k[rows], fwd.top_p[rows], fwd.min_p[rows], u
    )
    return native if native is not None else _random_tokens_torch(logits, fwd, rows, u)[0]


def _random_tokens_torch(
    logits: torch.Tensor,
    fwd: Forward,
    rows: npt.NDArray[np.int64],
    u: npt.NDArray[np.float64],
    xtc_draws: npt.NDArray[np.float64] | None = None,
    mu: npt.NDArray[np.float32] | None = None,
) -> tuple[torch.Tensor, npt.NDArray[np.float32] | None]:
    """The rows' tokens, and with `mu` (Mirostat's, going in) the mu each leaves (NaN where the
    row has no Mirostat)."""
    device = logits.device
    temp = torch.as_tensor(fwd.temperature[rows], device=device)
    scaled = logits[torch.as_tensor(rows, device=device)] / temp[:, None]
    k = min(PREFILTER, scaled.shape[-1])
    vals, ids = torch.topk(scaled, k, dim=-1)  # sorted, descending
    probs = torch.softmax(vals, dim=-1)
    rank = torch.arange(k, device=device)[None, :]
    top_k = torch.as_tensor(fwd.top_k[rows].astype(np.int64), device=device)
    keep = (top_k[:, None] == 0) | (rank < top_k[:, None])
    top_p = torch.as_tensor(fwd.top_p[rows], device=device)
    before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
    keep &= (before < top_p[:, None]) | (rank == 0)
    min_p = torch.as_tensor(fwd.min_p[rows], device=device)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    if xtc_draws is not None:
        keep = _filter(keep, scaled, vals, probs, fwd, rows, xtc_draws)
    tau = eta = mu_t = None
    if mu is not None:  # Mirostat 2: drop the kept tokens whose surprise is past mu (keep one)
        tau = torch.as_tensor(fwd.mirostat_tau[rows], device=device)
        eta = torch.as_tensor(fwd.mirostat_eta[rows], device=device)
        mu_t = torch.as_tensor(mu, device=device)
        q = torch.where(keep, probs, 0.0)
        surprise = -torch.log2(q / q.sum(-1, keepdim=True))
        within = keep & (surprise <= mu_t[:, None])
        first_kept = torch.where(keep, rank, k).min(-1).values
        within |= (rank == first_kept[:, None]) & ~within.any(-1, keepdim=True)
        keep = torch.where(tau[:, None] > 0, within, keep)
    kept = torch.where(keep, probs, 0.0)
    cdf = kept.cumsum(-1)
    target = torch.as_tensor(u, device=device, dtype=cdf.dtype)[:, None] * cdf[:, -1:]
    pick = torch.searchsorted(cdf, target, right=True).clamp(max=k - 1)
    tokens = ids.gather(1, pick).squeeze(1)
    if mu_t is None or tau is None or eta is None:
        return tokens, None
    observed = -torch.log2(kept.gather(1, pick).squeeze(1) / cdf[:, -1])
    new_mu = torch.where(tau > 0, mu_t - eta * (observed - tau), torch.nan)
    return tokens, new_mu.float().cpu().numpy()


def _filter(
    keep: torch.Tensor,
    scaled: torch.Tensor,
    vals: torch.Tensor,
    probs: torch.Tensor,
    fwd: Forward,
    rows: npt.NDArray[np.int64],
    xtc_draws: npt.NDArray[np.float64],
) -> torch.Tensor:
    """`keep` [rows, k] after top-n-sigma, typical and XTC (`drivers.sampler_chain.sample_row_np`
    is the plain version): `scaled` the rows' whole scaled logits, `vals`/`probs` the candidates'."""
    device = keep.device

    def column(name: str) -> torch.Tensor:
        return torch.as_tensor(getattr(fwd, name)[rows], device=device)

    n_sigma, typical_p = column("top_n_sigma"), column("typical_p")
    finite = torch.isfinite(scaled)
    count = finite.sum(-1)
    mean = torch.where(finite, scaled, 0.0).sum(-1) / count
    sigma = (torch.where(finite, scaled - mean[:, None], 0.0).square().sum(-1) / count).sqrt()
    keep &= (n_sigma[:, None] == 0) | (vals >= vals[:, :1] - n_sigma[:, None] * sigma[:, None])
    # Typical: the kept tokens whose surprisal is nearest the entropy, until they hold typical_p.
    q = torch.where(keep, probs, 0.0)
    q = q / q.sum(-1, keepdim=True)
    live = q > 0
    surprisal = torch.where(live, -torch.log(torch.where(live, q, 1.0)), torch.inf)
    entropy = torch.where(live, q * surprisal, 0.0).sum(-1)
    _, order = torch.sort((surprisal - entropy[:, None]).abs(), dim=-1, stable=True)
    q_sorted = q.gather(1, order)
    chosen_sorted = (q_sorted.cumsum(-1) - q_sorted < typical_p[:, None]) & (q_sorted > 0)
    chosen = torch.zeros_like(keep).scatter(1, order, chosen_sorted)
    keep = torch.where(typical_p[:, None] < 1, keep & chosen, keep)
    # XTC: with its probability, every kept token at least threshold likely but the last of them.
    q = torch.where(keep, probs, 0.0)
    q = q / q.sum(-1, keepdim=True)
    above = keep & (q >= column("xtc_threshold")[:, None])
    rank = torch.arange(keep.shape[-1], device=device)[None, :]
    last = torch.where(above, rank, -1).max(-1).values
    fires = (torch.as_tensor(xtc_draws, device=device) < column("xtc_probability").double()) & (above.sum(-1) >= 2)
    return keep & ~(above & (rank != last[:, None]) & fires[:, None])


def sample(
    logits: torch.Tensor,
    fwd: Forward,
    out_tokens: npt.NDArray[np.int64],
    plan: SamplingPlan,
    gen: torch.Generator,
    slot_tokens: SlotTokens,
) -> Sampled:
    """Tokens and probe outputs for raw `logits` [O, V] of the output rows; `out_tokens` [O] are the
    rows' input tokens in the pass (their RoPE positions key the seeded draws); `plan`: the pass's
    `plan_sampling`, made before the model ran; `slot_tokens`: the tokens the penalties count,
    this pass's written."""
    num_out = logits.shape[0]
    masked = apply_logit_masks(apply_chain(logits, fwd, slot_tokens), plan)
    random_rows, probe_rows = plan.random_rows, plan.probe_rows
    if not len(random_rows):
        tokens = cpu_kernels.argmax_rows(masked)  # the first maximum, like argmax
    else:
        positions = fwd.positions.astype(np.int64)[out_tokens[random_rows]]
        sampled = _random_tokens(masked, fwd, random_rows, positions, gen, slot_tokens)
        if len(random_rows) == num_out:  # every row, in order: no greedy row to find the maximum of
            tokens = sampled
        else:
            tokens = cpu_kernels.argmax_rows(masked)
            tokens[torch.as_tensor(random_rows, device=logits.device)] = sampled
    tokens_np = tokens.cpu().numpy().astype(np.int32)  # one torch call, not three
    if not len(probe_rows):  # most passes: nothing but the tokens
        no_probes, nothing = np.zeros(num_out + 1, dtype=np.uint32), np.zeros(0, np.float32)
        return Sampled(
            tokens_np, np.zeros(num_out, np.float32), no_probes, np.zeros(0, np.uint32), nothing, no_probes, nothing
        )
    logprobs = np.zeros(num_out, dtype=np.float32)
    topk_counts = np.zeros(num_out, dtype=np.int64)
    dist_counts = np.zeros(num_out, dtype=np.int64)
    topk_ids: list[npt.NDArray[np.uint32]] = []
    topk_lps: list[npt.NDArray[np.float32]] = []
    dists: list[npt.NDArray[np.float32]] = []
    lp_all = torch.log_softmax(masked[torch.as_tensor(probe_rows, device=logits.device)], dim=-1)
    for j, o in enumerate(probe_rows.tolist()):
        flags = Probe(int(fwd.probe[o]))
        lp = lp_all[j]
        if Probe.LOGPROBS in flags:
            scored = int(fwd.score_tokens[o]) if len(fwd.score_tokens) else -1
            logprobs[o] = float(lp[scored if scored >= 0 else int(tokens_np[o])])
            k = int(fwd.probe_k[o])
            if k:
                v, i = torch.topk(lp, k)
                topk_ids.append(i.cpu().numpy().astype(np.uint32))
                topk_lps.append(v.float().cpu().numpy())
                topk_counts[o] = k
        if Probe.DISTRIBUTION in flags:
            dists.append(lp.float().cpu().numpy())
            dist_counts[o] = lp.shape[-1]  # the vocabulary: one logit per token

    def indptr(counts: npt.NDArray[np.int64]) -> npt.NDArray[np.uint32]:
        return np.concatenate(([0], np.cumsum(counts))).astype(np.uint32)

    def cat(parts: list[npt.NDArray[np.generic]], dtype: type) -> npt.NDArray[np.generic]:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

    return Sampled(
        tokens=tokens_np,
        logprobs=logprobs,
        topk_indptr=indptr(topk_counts),
        topk_ids=cat(topk_ids, np.uint32),  # type: ignore[arg-type]
        topk_logprobs=cat(topk_lps, np.float32),  # type: ignore[arg-type]
        dist_indptr=indptr(dist_counts),
        dists=cat(dists, np.float32),  # type: ignore[arg-type]
    )
