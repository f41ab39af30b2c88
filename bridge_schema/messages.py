"""Every message of the host<->driver bridge, declared once.

A message is a dataclass; each field carries its wire type (see `fields`). Cross-field invariants
of `Forward` live in `forward_checks`. `docs/bridge.md` documents every field.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from bridge_schema.fields import array_field, scalar_field

U8 = npt.NDArray[np.uint8]
U32 = npt.NDArray[np.uint32]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]


class Status(enum.IntEnum):
    """Reply status. 0 is success; anything else comes with an `ErrorReply`."""

    OK = 0
    BAD_REQUEST = 1  # malformed frame or message (schema violation)
    OUT_OF_RANGE = 2  # well-formed but outside the driver's limits (page, token, size)
    UNSUPPORTED = 3  # a capability this driver lacks
    NOT_READY = 4  # a request before the handshake, or (code driver_busy) while another host holds the driver
    INTERNAL = 5  # the driver failed while executing a valid request


class SamplerKind(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1  # temperature, then top-k, top-p and min-p filters


class Probe(enum.IntFlag):
    """What an output row reports besides its sampled token."""

    NONE = 0
    LOGPROBS = 1  # logprob of the sampled token and the top `probe_k` tokens
    DISTRIBUTION = 2  # the whole log-probability vector (vocab_size floats)


class Message:
    """Base of all messages: `TAG` is the wire type tag, `id` pairs a request with its reply."""

    TAG: ClassVar[str]
    IS_REPLY: ClassVar[bool] = False
    id: int


# ---------------------------------------------------------------- handshake


@dataclass(slots=True)
class Hello(Message):
    """Host -> driver, first message on a connection: what the host asks for (0 = driver default)."""

    TAG: ClassVar[str] = "hello"
    id: int = scalar_field("int", 0, "u64")
    page_size: int = scalar_field("int", 0, "u32")
    num_pages: int = scalar_field("int", 0, "u32")
    prefix_match_unit: int = scalar_field("int", 0, "u32")
    speculation_depth: int = scalar_field("int", 0, "u32")


@dataclass(slots=True)
class Handshake(Message):
    """Driver -> host reply to `Hello`: the model and the limits the driver *resolved*."""

    TAG: ClassVar[str] = "handshake"
    IS_REPLY: ClassVar[bool] = True
    id: int = scalar_field("int", 0, "u64")
    status: int = scalar_field("int", 0, "u32")
    driver_kind: str = scalar_field("str", "")
    model_name: str = scalar_field("str", "")
    vocab_size: int = scalar_field("int", 0, "u32")
    page_size: int = scalar_field("int", 0, "u32")
    num_pages: int = scalar_field("int", 0, "u32")
    max_context: int = scalar_field("int", 0, "u32")
    max_requests_per_pass: int = scalar_field("int", 0, "u32")
    max_tokens_per_pass: int = scalar_field("int", 0, "u32")
    max_mask_bytes: int = scalar_field("int", 0, "u64")
    max_probe_k: int = scalar_field("int", 0, "u32")
    # The largest chunk of one request's fill the driver prefers in a pass (0: none). A long
    # prompt in chunks attends to fewer keys per query on a CPU (protocol 6).
    max_fill_chunk_tokens: int = scalar_field("int", 0, "u32")
    capabilities: list[str] = scalar_field("strs")
    tokenizer_kind: str = scalar_field("str", "bytes")  # "bytes" | "huggingface"
    tokenizer_data: str = scalar_field("str", "")  # tokenizer.json text for "huggingface"
    chat_template: str = scalar_field("str", "")  # jinja2 source
    stop_token_ids: U32 = array_field("<u4")
    control_token_ids: U32 = array_field("<u4")
    # What the driver runs on, for logs and `/health`: e.g. the device, and on the CPU which
    # instruction-set variant each C++ kernel runs. Informational; the host never branches on it.
    driver_info: dict[str, int | float | str] = scalar_field("stats")


# ---------------------------------------------------------------- forward


# Handshake capability: the driver fills in `Forward.deferred` tokens (every driver served by
# `drivers.serve` has it).
DEFERRED_TOKENS = "deferred_tokens"
# Handshake capability: the driver runs multi-step requests (`Forward.steps`; `drivers.serve`
# adds it for every driver it serves).
MULTI_STEP = "multi_step"
# The most decode steps one request may ask for.
MAX_DECODE_STEPS = 64
# Handshake capability: the driver applies the sampler chain's stages (penalties, logit bias).
SAMPLER_CHAIN = "sampler_chain"


@dataclass(slots=True)
class Forward(Message):
    """A batch of forward passes in CSR form (R requests, T tokens, O output rows).

    Request r owns tokens[token_indptr[r]:token_indptr[r+1]] at the same slice of `positions`,
    and KV pages pages[page_indptr[r]:page_indptr[r+1]], whose last page holds last_page_len[r]
    slots. Its keys are kv_len = (num_pages_r - 1) * page_size + last_page_len[r]; the request's
    new tokens fill the last T_r of those slots, in order.

    Deferred tokens (capability "deferred_tokens"): for each request index in `deferred`, the
    driver replaces the request's first token (sent as 0) with the token it last sampled for the
    same context id, in an earlier Forward (the last output row of that context's latest request
    that had one). This lets the host send a context's next decode step before the reply that
    carries its input token has come back, so the device never waits for the host.

    Multi-step requests (capability "multi_step"): request r with steps[r] = N > 1 is N decode
    steps in one request. It has one input token and N output rows with rows 0, 1, ..., N-1:
    step 0 runs the given token; step j > 0 runs the token sampled at step j-1, at the next
    position and into the next KV slot; output j is step j's sample. Its kv_len counts all N
    steps' slots. Its outputs carry no probes and no logit mask, and it has no mask rows. This
    lets the host generate N tokens of a context per round trip. `steps` is empty when every
    request is one step.

    Scored rows: `score_tokens` is empty, or has one entry per output. An entry >= 0 on an
    output with the LOGPROBS probe makes its `logprobs` value that token's log-probability
    instead of the sampled token's (the top `probe_k` are reported as usual): the logprob of a
    given continuation, e.g. each next token of a prompt. The row still samples as usual.

    Sampler chain: before its logit mask and sampler, an output row's logits go through the
    stages it has, in this order. Logit bias adds a value per listed token (-100 bans a token in
    practice, +100 forces it). Penalties count the tokens of the row's context: those in the KV
    slots [max(from, s + 1 - last_n), s] of the row's request, where s is the slot of the row's
    own input token (request r's inputs fill the last of its kv_len slots, in order) and
    `from` is `penalty_from` for the presence and frequency penalties and `repetition_from` for
    the repetition penalty. A slot holds whatever token was written into it, by this pass or any
    earlier one (deferred and multi-step tokens included), so the count follows forks (shared
    and copied pages), truncation and rollback. The repetition penalty divides a positive
    logit of every counted token by the penalty and multiplies a negative one (vLLM's and the
    CTRL paper's rule); the presence penalty subtracts its value once from every counted token,
    the frequency penalty its value times the token's count (OpenAI's rule). Probes report the
    log-probabilities after the chain and the mask, before temperature. A random row then goes
    through temperature and its filters in this order, each on the tokens the ones before kept:
    top-n-sigma (logits within n standard deviations of the best), top-k, top-p, min-p (these
    three on the probabilities before any filter, as without a chain), locally typical sampling
    (renormalized over the kept tokens), XTC (with probability xtc_probability, a draw of its
    own from `bridge_schema.sampling.xtc_uniform`, every kept token at least xtc_threshold likely
    but the least likely of them is removed, when there are two or more), Mirostat 2 (tokens
    whose surprise over the kept ones is past mu are removed, mu being the state of the row's
    context, 2 * tau before its first Mirostat step; after the draw mu moves by eta times the
    target less the drawn token's surprise), then the draw. The driver keeps mu per KV slot, as
    it keeps the tokens: the step at slot s reads slot s - 1's and writes slot s's, and writing
    a token into a slot clears its mu.

    DRY (llama.cpp's "don't repeat yourself"), after the penalties: over the tokens w of the KV
    slots [max(0, s + 1 - dry_last_n), s] (all of them for 0; an unwritten slot counts as a
    breaker), let the limit be the number of tokens after the last sequence breaker of w (the
    row's dry_breaker_ids; all of w without one). For every earlier position e of w (not its
    last), k(e) is the length of the longest run ending at e equal to the run ending at w's last
    token, at most the limit. The token after e, w[e + 1], takes the longest k of its positions;
    where that is at least dry_allowed_length, its logit drops by dry_multiplier *
    dry_base ** (k - dry_allowed_length), the exponent capped at floor(88.7228391 / ln dry_base)
    (llama.cpp's rule).
    """

    TAG: ClassVar[str] = "forward"
    id: int = scalar_field("int", 0, "u64")
    context_ids: U32 = array_field("<u4")  # [R]
    adapter_ids: I32 = array_field("<i4")  # [R], -1 = base model
    token_indptr: U32 = array_field("<u4")  # [R+1]
    tokens: U32 = array_field("<u4")  # [T]
    positions: U32 = array_field("<u4")  # [T]
    page_indptr: U32 = array_field("<u4")  # [R+1]
    pages: U32 = array_field("<u4")  # [P]
    last_page_len: U32 = array_field("<u4")  # [R]
    # Attention masks: request r has 0 rows (causal) or one row per token; a row is BRLE run
    # lengths over the request's kv_len keys, false run first; applied AND causal.
    mask_req_indptr: U32 = array_field("<u4")  # [R+1] over rows
    mask_row_indptr: U32 = array_field("<u4")  # [rows+1] over runs
    mask_runs: U32 = array_field("<u4")  # [runs]
    # Output rows: which rows of a request produce a token and/or probe outputs.
    out_indptr: U32 = array_field("<u4")  # [R+1] over output rows
    out_rows: U32 = array_field("<u4")  # [O] row index within its request, strictly increasing
    sampler: U8 = array_field("<u1")  # [O] SamplerKind
    # The three sampler floats are range-checked in `checks`, which rejects NaN and infinity too.
    temperature: F32 = array_field("<f4", range_checked=True)  # [O] > 0 for RANDOM
    top_k: U32 = array_field("<u4")  # [O] 0 = off
    top_p: F32 = array_field("<f4", range_checked=True)  # [O] in (0, 1], 1 = off
    min_p: F32 = array_field("<f4", range_checked=True)  # [O] in [0, 1), 0 = off
    seed: I64 = array_field("<i8")  # [O] -1 = unseeded; else the draw depends on (seed, position)
    probe: U8 = array_field("<u1")  # [O] Probe flags
    probe_k: U32 = array_field("<u4")  # [O] top-k size for LOGPROBS
    logit_mask_index: I32 = array_field("<i4")  # [O] -1 = unconstrained, else a row of logit_masks
    logit_masks: U32 = array_field("<u4")  # [K * ceil(V/32)], bit j of word i = token 32i+j
    deferred: U32 = array_field("<u4")  # [D] strictly increasing request indices (see above)
    steps: U32 = array_field("<u4")  # [R] decode steps per request, or empty: one each (see above)
    score_tokens: I32 = array_field("<i4")  # [O] or empty: the token a LOGPROBS row scores, -1 none
    # Sampler chain stages applied before the logit mask and the sampler (see above). Each group
    # is empty when no output row uses it. Penalties, per output row:
    repetition_penalty: F32 = array_field("<f4")  # [O] or empty: > 0, 1 = off
    presence_penalty: F32 = array_field("<f4")  # [O] or empty: 0 = off
    frequency_penalty: F32 = array_field("<f4")  # [O] or empty: 0 = off
    penalty_from: U32 = array_field("<u4")  # [O] or empty: first slot presence/frequency count
    repetition_from: U32 = array_field("<u4")  # [O] or empty: first slot repetition counts
    penalty_last_n: U32 = array_field("<u4")  # [O] or empty: only the last n slots count, 0 = all
    # Logit bias, sparse: output o adds logit_bias[i] to token logit_bias_ids[i] for i in
    # logit_bias_indptr[o]:logit_bias_indptr[o+1], ids strictly increasing within a row.
    logit_bias_indptr: U32 = array_field("<u4")  # [O+1] or empty
    logit_bias_ids: U32 = array_field("<u4")
    logit_bias: F32 = array_field("<f4")
    # Filters of random rows besides top-k, top-p and min-p (all [O] or all empty; see above).
    typical_p: F32 = array_field("<f4")  # [O] or empty: in (0, 1], 1 = off
    top_n_sigma: F32 = array_field("<f4")  # [O] or empty: >= 0, 0 = off
    xtc_probability: F32 = array_field("<f4")  # [O] or empty: in [0, 1], 0 = off
    xtc_threshold: F32 = array_field("<f4")  # [O] or empty: in [0, 1]
    mirostat_tau: F32 = array_field("<f4")  # [O] or empty: Mirostat 2's target surprise (bits), 0 = off
    mirostat_eta: F32 = array_field("<f4")  # [O] or empty: its learning rate, in [0, 1]
    # DRY (see above): all [O] or all empty, with its breakers' CSR over the outputs.
    dry_multiplier: F32 = array_field("<f4")  # [O] or empty: >= 0, 0 = off
    dry_base: F32 = array_field("<f4")  # [O] or empty: >= 1
    dry_allowed_length: U32 = array_field("<u4")  # [O] or empty
    dry_last_n: U32 = array_field("<u4")  # [O] or empty: the last n slots, 0 = all
    dry_breaker_indptr: U32 = array_field("<u4")  # [O+1] or empty
    dry_breaker_ids: U32 = array_field("<u4")

    @property
    def num_requests(self) -> int:
        return len(self.context_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.out_rows)


@dataclass(slots=True)
class ForwardResult(Message):
    """Reply to `Forward`: one entry per output row, in the order of `Forward.out_rows`."""

    TAG: ClassVar[str] = "forward_result"
    IS_REPLY: ClassVar[bool] = True
    id: int = scalar_field("int", 0, "u64")
    status: int = scalar_field("int", 0, "u32")
    tokens: I32 = array_field("<i4")  # [O] sampled token
    logprobs: F32 = array_field("<f4", logprobs=True)  # [O] logprob of the sampled token (0 without LOGPROBS)
    topk_indptr: U32 = array_field("<u4")  # [O+1]
    topk_ids: U32 = array_field("<u4")
    topk_logprobs: F32 = array_field("<f4", logprobs=True)
    dist_indptr: U32 = array_field("<u4")  # [O+1], rows of vocab_size or 0
    dists: F32 = array_field("<f4", logprobs=True)  # log-probabilities, -inf where masked


# ---------------------------------------------------------------- commands


@dataclass(slots=True)
class Copy(Message):
    """Copy whole KV pages: src_pages[i] -> dst_pages[i]. Destinations are distinct and no
    destination is also a source."""

    TAG: ClassVar[str] = "copy"
    id: int = scalar_field("int", 0, "u64")
    src_pages: U32 = array_field("<u4")
    dst_pages: U32 = array_field("<u4")


@dataclass(slots=True)
class Adapter(Message):
    """Load (from a PEFT safetensors directory at `path`) or unload a LoRA adapter by id."""

    TAG: ClassVar[str] = "adapter"
    id: int = scalar_field("int", 0, "u64")
    op: str = scalar_field("str", "load")  # "load" | "unload"
    adapter_id: int = scalar_field("int", 0, "u32")
    path: str = scalar_field("str", "")


@dataclass(slots=True)
class Health(Message):
    TAG: ClassVar[str] = "health"
    id: int = scalar_field("int", 0, "u64")


@dataclass(slots=True)
class Shutdown(Message):
    """Ask the driver to reply and exit cleanly."""

    TAG: ClassVar[str] = "shutdown"
    id: int = scalar_field("int", 0, "u64")


# ---------------------------------------------------------------- replies


@dataclass(slots=True)
class Ack(Message):
    """Success reply to `Copy`, `Adapter` and `Shutdown`."""

    TAG: ClassVar[str] = "ack"
    IS_REPLY: ClassVar[bool] = True
    id: int = scalar_field("int", 0, "u64")
    status: int = scalar_field("int", 0, "u32")


@dataclass(slots=True)
class HealthReply(Message):
    TAG: ClassVar[str] = "health_reply"
    IS_REPLY: ClassVar[bool] = True
    id: int = scalar_field("int", 0, "u64")
    status: int = scalar_field("int", 0, "u32")
    state: str = scalar_field("str", "ok")
    stats: dict[str, int | float | str] = scalar_field("stats")


@dataclass(slots=True)
class ErrorReply(Message):
    """The reply to any request that failed. `field` names the offending field when known;
    `id` is 0 when the request was too broken to read its id."""

    TAG: ClassVar[str] = "error"
    IS_REPLY: ClassVar[bool] = True
    id: int = scalar_field("int", 0, "u64")
    status: int = scalar_field("int", int(Status.BAD_REQUEST), "u32")
    code: str = scalar_field("str", "")
    field: str = scalar_field("str", "")
    message: str = scalar_field("str", "")


MESSAGE_TYPES: tuple[type[Message], ...] = (
    Hello,
    Handshake,
    Forward,
    ForwardResult,
    Copy,
    Adapter,
    Health,
    Shutdown,
    Ack,
    HealthReply,
    ErrorReply,
)
