"""A driver that computes nothing and behaves like a real one in every other way.

It samples each requested token uniformly among the tokens its logit mask allows (seeded rows
reproducibly, from (seed, position); greedy rows from (input token, position), so a greedy
request is deterministic), returns correctly shaped probe outputs of that uniform distribution,
validates every request against its handshake, and acks `Copy`/`Adapter` as no-ops (it holds no
KV memory and no weights, and its tokens do not depend on the cache, so success is faithful).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bridge_schema.batch import logit_mask_words, unpack_allowed
from bridge_schema.config_rules import check_prefix_match_unit
from bridge_schema.errors import ConfigError
from bridge_schema.messages import (
    SAMPLER_CHAIN,
    Adapter,
    Copy,
    Forward,
    ForwardResult,
    Handshake,
    Hello,
    Probe,
    SamplerKind,
)
from bridge_schema.sampling import seeded_uniform, xtc_uniform
from drivers.errors import ConfigRejected, RequestRejected
from drivers.sampler_chain import Filters, SlotTokens, apply_chain_np, sample_row_with_state

# The byte tokenizer's special tokens follow the 256 byte tokens.
ENDOFTEXT, IM_START, IM_END, PAD = 256, 257, 258, 259
NUM_BYTE_TOKENS = 256
_GREEDY = int(SamplerKind.GREEDY)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class DummyConfig:
    vocab_size: int = 260
    page_size: int = 16
    min_page_size: int = 1  # like a kernel's tile: a smaller request resolves to this
    num_pages: int = 4096
    max_context: int = 32768
    max_requests_per_pass: int = 256
    max_tokens_per_pass: int = 32768
    max_mask_bytes: int = 64 * 1024 * 1024
    max_probe_k: int = 20
    max_fill_chunk_tokens: int = 0  # the fill chunk the handshake prefers (0: none), as the torch driver's
    pass_latency_ms: float = 0.0
    seed: int = 0
    # What every context "says": these tokens in order, then ENDOFTEXT (see DummyDriver._say).
    script: tuple[int, ...] = ()
    # The model's logits at every row, as (token, logit) pairs (every other token's is 0). With
    # them, or on a row with a sampler chain, a row samples from the distribution they make
    # (after the chain and its logit mask) as the torch driver would, instead of uniformly.
    logits: tuple[tuple[int, float], ...] = ()


class DummyDriver:
    def __init__(self, config: DummyConfig = DummyConfig()) -> None:
        if config.vocab_size < PAD + 1:
            raise ValueError(f"vocab size must be at least {PAD + 1} (256 bytes + 4 special tokens)")
        self.config = config
        self.page_size = config.page_size
        self.num_pages = config.num_pages
        self._rng = np.random.default_rng(config.seed)
        self._adapters: set[int] = set()
        self._slot_tokens = SlotTokens(0, 1)  # the token in each KV slot, made at the handshake
        self._base_logits = np.zeros(config.vocab_size, dtype=np.float32)
        for token, logit in config.logits:
            if not 0 <= token < config.vocab_size or not math.isfinite(logit):
                raise ValueError(f"logits: token {token} must be in [0, {config.vocab_size}) with a finite logit")
            self._base_logits[token] = logit
        # With a script: per context, at each input position, the script index sampled there and
        # the token it gave (a mask may have refused the script's).
        self._said: dict[int, dict[int, tuple[int, int]]] = {}
        self._said_last: dict[int, int] = {}  # per context, the highest position in `_said`
        # With a pass latency: when the simulated device is free, and when the last reply is due.
        self._device_free_at = 0.0
        self.reply_at: float | None = None
        self.stats: dict[str, int] = {
            "forwards": 0,
            "requests": 0,
            "tokens": 0,
            "outputs": 0,
            "copies": 0,
            "pages_copied": 0,
            "adapter_loads": 0,
            "adapter_unloads": 0,
        }

    def handshake(self, hello: Hello) -> Handshake:
        c = self.config
        self.page_size = max(hello.page_size or c.page_size, c.min_page_size)
        self.num_pages = hello.num_pages or c.num_pages
        try:
            check_prefix_match_unit(hello.prefix_match_unit, self.page_size, hello.speculation_depth)
        except ConfigError as exc:
            raise ConfigRejected(exc.detail, exc.field) from None
        # A new host (a kept driver serves one after another) numbers its contexts from 1 again:
        # they start the script afresh.
        self._said.clear()
        self._said_last.clear()
        self._slot_tokens = SlotTokens(self.num_pages, self.page_size)
        return Handshake(
            driver_kind="dummy",
            model_name="dummy",
            vocab_size=c.vocab_size,
            page_size=self.page_size,
            num_pages=self.num_pages,
            max_context=c.max_context,
            max_requests_per_pass=c.max_requests_per_pass,
            max_tokens_per_pass=c.max_tokens_per_pass,
            max_mask_bytes=c.max_mask_bytes,
            max_probe_k=c.max_probe_k,
            max_fill_chunk_tokens=c.max_fill_chunk_tokens,
            capabilities=["attention_mask", "logit_mask", "probes", "adapters", "copy", SAMPLER_CHAIN],
            tokenizer_kind="bytes",
            chat_template=CHATML_TEMPLATE,
            stop_token_ids=np.array([IM_END, ENDOFTEXT], dtype=np.uint32),
            control_token_ids=np.arange(NUM_BYTE_TOKENS, c.vocab_size, dtype=np.uint32),
            driver_info={"device": "none (the dummy driver computes nothing)"},
        )

    def forward(self, f: Forward) -> ForwardResult:
        """Sample every output row. With `pass_latency_ms` the driver models a device queue: the
        pass occupies the device for that long, starting when the device is free (right away
        if it is idle, else when the pass before ends), and its reply is due when it ends
        (`reply_at`; `drivers.serve` sends it then, while it reads the frames behind it)."""
        result = self._forward(f)
        if self.config.pass_latency_ms:
            start = max(time.perf_counter(), self._device_free_at)
            self._device_free_at = self.reply_at = start + self.config.pass_latency_ms / 1000
        return result

    def _forward(self, f: Forward) -> ForwardResult:
        self._slot_tokens.write(f)
        result = self._sample(f)
        if self.config.script:
            self._forget_discarded(f)
            if f.num_outputs:
                self._say(f, result.tokens)
        return result

    def _forget_discarded(self, f: Forward) -> None:
        """A sample the context did not continue with is forgotten, with every later one: a
        pass that writes another token at position p + 1 than the one sampled at p (a staged
        step the inferlet never used, then a new prompt) takes the script back to p. So what a
        context says does not depend on speculation."""
        indptr = f.token_indptr.tolist()
        for r in range(f.num_requests):
            context = int(f.context_ids[r])
            said = self._said.get(context)
            if not said:
                continue
            lo, hi = indptr[r], indptr[r + 1]
            for position, token in zip(f.positions[lo:hi].tolist(), f.tokens[lo:hi].tolist(), strict=True):
                got = said.get(position - 1)
                if got is not None and got[1] != token:
                    for p in [p for p in said if p >= position - 1]:
                        del said[p]
                    self._said_last[context] = max(said, default=-1)
                    break

    def _say(self, f: Forward, tokens: npt.NDArray[np.int32]) -> None:
        """Each context samples the script in order, one token per new position, then
        ENDOFTEXT; a position sampled again (a retried step) gets the same token, and a sample
        the context did not go on with is taken back (`_forget_discarded`). A logit mask that
        refuses the scripted token keeps the draw within it. A fork is a new context: it starts
        the script again."""
        script, words = self.config.script, logit_mask_words(self.config.vocab_size)
        out_ptr = f.out_indptr.tolist()
        for r in range(f.num_requests):
            context = int(f.context_ids[r])
            said = self._said.setdefault(context, {})
            first = int(f.token_indptr[r])
            for i in range(out_ptr[r], out_ptr[r + 1]):
                position = int(f.positions[first + int(f.out_rows[i])])
                got = said.get(position)
                if got is None:  # one past the latest position before it: the last one, as a rule
                    last = self._said_last.get(context, -1)
                    if last < position:
                        k = said[last][0] + 1 if last >= 0 else 0
                        self._said_last[context] = position
                    else:
                        k = max((said[p][0] for p in said if p < position), default=-1) + 1
                else:
                    k = got[0]
                want = script[k] if k < len(script) else ENDOFTEXT
                mask = int(f.logit_mask_index[i])
                if mask >= 0:
                    allowed = unpack_allowed(self.config.vocab_size, f.logit_masks[mask * words : (mask + 1) * words])
                    if not allowed[want]:
                        said[position] = (k, int(tokens[i]))
                        continue
                tokens[i] = want
                said[position] = (k, want)

    def _sample(self, f: Forward) -> ForwardResult:
        # np.count_nonzero: a third of `.any()`'s cost on short arrays (this is the hot path).
        if np.count_nonzero(f.adapter_ids >= 0):
            bad = [a for a in f.adapter_ids.tolist() if a >= 0 and a not in self._adapters]
            if bad:
                raise RequestRejected(f"adapter {bad[0]} is not loaded", "adapter_ids")
        vocab = self.config.vocab_size
        o = f.num_outputs
        # Global token row of each output: the request's first token index + its row.
        out_ptr = f.out_indptr.astype(np.int64)
        request_of = np.repeat(np.arange(f.num_requests), out_ptr[1:] - out_ptr[:-1])
        rows = f.token_indptr[request_of].astype(np.int64) + f.out_rows
        positions = f.positions[rows]
        draws = self._rng.random(o)
        seeded = f.seed >= 0
        n_seeded = np.count_nonzero(seeded)
        if n_seeded == o:  # every row seeded: no masking
            draws = seeded_uniform(f.seed, positions)
        elif n_seeded:
            draws[seeded] = seeded_uniform(f.seed[seeded], positions[seeded])
        greedy = f.sampler == _GREEDY
        if np.count_nonzero(greedy):
            draws[greedy] = seeded_uniform(f.tokens[rows][greedy], positions[greedy])

        tokens = np.minimum((draws * vocab).astype(np.int64), vocab - 1).astype(np.int32)
        logprobs = np.zeros(o, dtype=np.float32)
        if (
            self.config.logits
            or len(f.repetition_penalty)
            or len(f.logit_bias_ids)
            or len(f.typical_p)
            or len(f.dry_multiplier)
        ):
            xtc = self._rng.random(o)
            if n_seeded:
                xtc[seeded] = xtc_uniform(f.seed[seeded], positions[seeded])
            return self._sample_distribution(f, draws, xtc)
        # Only rows with a logit mask or a probe need work beyond the vectorised draw above.
        if not o or (int(f.logit_mask_index.max()) < 0 and not np.count_nonzero(f.probe)):
            self._count(f, o)
            no_probes = np.zeros(o + 1, dtype=np.uint32)
            return ForwardResult(
                tokens=tokens,
                logprobs=logprobs,
                topk_indptr=no_probes,
                topk_ids=np.zeros(0, np.uint32),
                topk_logprobs=np.zeros(0, np.float32),
                dist_indptr=no_probes,
                dists=np.zeros(0, np.float32),
            )
        topk_counts = np.zeros(o, dtype=np.int64)
        topk_ids: list[npt.NDArray[np.uint32]] = []
        dists: list[npt.NDArray[np.float32]] = []
        dist_counts = np.zeros(o, dtype=np.int64)
        words = logit_mask_words(vocab)
        special = np.flatnonzero((f.logit_mask_index >= 0) | (f.probe != 0)).tolist()
        for i in special:
            mask_index = int(f.logit_mask_index[i])
            probe = int(f.probe[i])
            allowed: npt.NDArray[np.int64] | None = None
            if mask_index >= 0:
                bits = unpack_allowed(vocab, f.logit_masks[mask_index * words : (mask_index + 1) * words])
                allowed = np.flatnonzero(bits)
                if not len(allowed):
                    raise RequestRejected(f"logit mask {mask_index} allows no token", "logit_masks")
                tokens[i] = allowed[min(int(draws[i] * len(allowed)), len(allowed) - 1)]
            if not probe:
                continue
            n_allowed = vocab if allowed is None else len(allowed)
            lp = -math.log(n_allowed)
            if probe & Probe.LOGPROBS:
                scored = int(f.score_tokens[i]) if len(f.score_tokens) else -1
                # Uniform over the allowed tokens: a scored token outside them has logprob -inf.
                logprobs[i] = -np.inf if scored >= 0 and allowed is not None and scored not in allowed else lp
                k = min(int(f.probe_k[i]), n_allowed)
                ids = np.arange(k, dtype=np.uint32) if allowed is None else allowed[:k].astype(np.uint32)
                topk_ids.append(ids)
                topk_counts[i] = k
            if probe & Probe.DISTRIBUTION:
                dist = np.full(vocab, lp, dtype=np.float32)
                if allowed is not None:
                    dist[:] = -np.inf
                    dist[allowed] = lp
                dists.append(dist)
                dist_counts[i] = vocab
        topk = np.concatenate(topk_ids) if topk_ids else np.zeros(0, np.uint32)
        self._count(f, o)
        return ForwardResult(
            tokens=tokens,
            logprobs=logprobs,
            topk_indptr=_indptr(topk_counts),
            topk_ids=topk,
            topk_logprobs=np.repeat(logprobs, topk_counts),
            dist_indptr=_indptr(dist_counts),
            dists=np.concatenate(dists) if dists else np.zeros(0, np.float32),
        )

    def _sample_distribution(
        self, f: Forward, draws: npt.NDArray[np.float64], xtc_draws: npt.NDArray[np.float64]
    ) -> ForwardResult:
        """Every row from the base logits (`DummyConfig.logits`) after its chain and logit mask:
        greedy rows take a maximum (`draws` picks among ties, so uniform logits sample as
        without them), random rows sample as the torch driver does, on `draws`."""
        o, vocab = f.num_outputs, self.config.vocab_size
        logits = apply_chain_np(np.broadcast_to(self._base_logits, (o, vocab)), f, self._slot_tokens)
        words = logit_mask_words(vocab)
        tokens = np.zeros(o, dtype=np.int32)
        logprobs = np.zeros(o, dtype=np.float32)
        topk_counts, dist_counts = np.zeros(o, dtype=np.int64), np.zeros(o, dtype=np.int64)
        topk_ids: list[npt.NDArray[np.uint32]] = []
        topk_lps: list[npt.NDArray[np.float32]] = []
        dists: list[npt.NDArray[np.float32]] = []
        all_rows = np.arange(o)
        mirostat = len(f.mirostat_tau) and np.count_nonzero(f.mirostat_tau)
        mu_in = self._slot_tokens.mirostat_mu(f, all_rows) if mirostat else np.zeros(o, np.float32)
        mu_out = np.full(o, np.nan, dtype=np.float32)
        for i in range(o):
            row = logits[i]
            mask_index = int(f.logit_mask_index[i])
            if mask_index >= 0:
                allowed = unpack_allowed(vocab, f.logit_masks[mask_index * words : (mask_index + 1) * words])
                if not allowed.any():
                    raise RequestRejected(f"logit mask {mask_index} allows no token", "logit_masks")
                row = np.where(allowed, row, -np.inf).astype(np.float32)
            if int(f.sampler[i]) == _GREEDY:
                best = np.flatnonzero(row == row.max())
                tokens[i] = best[min(int(draws[i] * len(best)), len(best) - 1)]
            else:
                t, k, p, m = float(f.temperature[i]), int(f.top_k[i]), float(f.top_p[i]), float(f.min_p[i])
                filters = Filters.of(f, i, float(xtc_draws[i]), float(mu_in[i]))
                tokens[i], mu_out[i] = sample_row_with_state(row, t, k, p, m, float(draws[i]), filters)
            probe = int(f.probe[i])
            if not probe:
                continue
            lp = (row - np.logaddexp.reduce(row.astype(np.float64))).astype(np.float32)
            if probe & Probe.LOGPROBS:
                scored = int(f.score_tokens[i]) if len(f.score_tokens) else -1
                logprobs[i] = lp[scored if scored >= 0 else int(tokens[i])]
                k = int(f.probe_k[i])
                top = np.argsort(-lp, kind="stable")[:k]
                topk_ids.append(top.astype(np.uint32))
                topk_lps.append(lp[top])
                topk_counts[i] = k
            if probe & Probe.DISTRIBUTION:
                dists.append(lp)
                dist_counts[i] = vocab
        if mirostat:
            self._slot_tokens.set_mirostat_mu(f, all_rows, mu_out)
        self._count(f, o)
        return ForwardResult(
            tokens=tokens,
            logprobs=logprobs,
            topk_indptr=_indptr(topk_counts),
            topk_ids=np.concatenate(topk_ids) if topk_ids else np.zeros(0, np.uint32),
            topk_logprobs=np.concatenate(topk_lps) if topk_lps else np.zeros(0, np.float32),
            dist_indptr=_indptr(dist_counts),
            dists=np.concatenate(dists) if dists else np.zeros(0, np.float32),
        )

    def _count(self, f: Forward, outputs: int) -> None:
        s = self.stats
        s["forwards"] += 1
        s["requests"] += len(f.context_ids)
        s["tokens"] += len(f.tokens)
        s["outputs"] += outputs

    def copy(self, c: Copy) -> None:
        self._slot_tokens.copy(c.src_pages, c.dst_pages)
        self.stats["copies"] += 1
        self.stats["pages_copied"] += len(c.src_pages)

    def adapter(self, a: Adapter) -> None:
        if a.op == "load":
            self._adapters.add(a.adapter_id)
            self.stats["adapter_loads"] += 1
        else:
            if a.adapter_id not in self._adapters:
                raise RequestRejected(f"adapter {a.adapter_id} is not loaded", "adapter_id")
            self._adapters.discard(a.adapter_id)
            self.stats["adapter_unloads"] += 1

    def health(self) -> dict[str, int | float | str]:
        return {**self.stats}


def _indptr(counts: npt.NDArray[np.int64]) -> npt.NDArray[np.uint32]:
    out = np.zeros(len(counts) + 1, dtype=np.uint32)
    np.cumsum(counts, out=out[1:])
    return out
