"""What an engine is started with: `EngineConfig`, checked once where it is built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from bridge_schema.config_rules import check_prefix_match_unit
from bridge_schema.errors import ConfigError
from bridge_schema.messages import MAX_DECODE_STEPS, Hello
from host.driver_link import DriverSpec
from host.engine.page_quota import PageQuota
from host.errors import InvalidRequest

# How long one multi-step request may hold the device by default (`multi_step_budget_ms`): under
# two frames of a 60 Hz screen, so a stream's tokens in bursts of it read as smoothly as one at a
# time, while the host's work per pass is spread over 4-5 tokens of a CPU model's ~5 ms steps.
MULTI_STEP_BUDGET_MS = 25.0


@dataclass(frozen=True, slots=True)
class GrammarBudget:
    """The grammar compiler's budgets (host.grammar.GrammarCompiler): seconds a compile is waited
    for (0: no limit), MiB one compiled grammar may take, MiB the compiled-grammar cache keeps."""

    compile_s: float = 10.0
    max_grammar_mib: float = 64.0
    cache_mib: float = 512.0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to start an engine.

    `driver`: "dummy" or "torch" (a subprocess on a Unix socket), "loopback" (in-process),
    "unix:PATH" or "tcp:HOST:PORT" (a driver someone else started); `driver_args` are its
    command-line options, `driver_module` any module that serves `--listen ADDRESS`.
    `page_size`/`num_pages` 0 take the driver's defaults; `prefix_match_unit` (a page) turns
    prefix reuse on; `speculation_depth` 0 turns pass-level speculation off.
    `adapter_dir`: where adapter names are resolved (on the driver's machine; "" turns adapters
    off), at most `max_loaded_adapters` loaded at once.
    `max_run_page_fraction`: the most of the page pool one run's contexts may hold;
    `max_group_page_fraction`: the most the runs of one group (`set_run_group`) may hold;
    `group_reserve_page_fraction`: the pool's last pages, which only a group holding fewer may take.
    `max_run_contexts`: the most contexts one run may hold at once, forks included (0: no limit).
    `max_fill_chunk_tokens`: the largest chunk of a long fill in one pass (0: the driver's
    preference from its handshake, e.g. 512 for the torch driver on the CPU; else as the pass allows).
    `max_decode_steps`: the most steps of a multi-step request (host-side generation runs that
    many per pass while passes are short; 1 turns multi-step off).
    `multi_step_budget_ms`: how long one multi-step request may hold the device: as many steps
    as fit in it at the measured time per step (0: one step a pass). Longer spreads the host's
    per-pass work over more tokens; a stream then gets its tokens in bursts of that length, and a
    request arriving meanwhile waits up to that long to join the batch.
    `startup_timeout_s`: how long the driver's handshake is waited for.
    `grammar_budget`: the grammar compiler's time and memory budgets.
    `progress`: told of first-use costs a user waits on (the grammar engines' load), or None.

    A value that cannot work raises `InvalidRequest` here, before any driver starts.
    """

    driver: str = "dummy"
    driver_args: tuple[str, ...] = ()
    driver_module: str = ""
    page_size: int = 0
    num_pages: int = 0
    prefix_match_unit: int = 0
    speculation_depth: int = 0
    adapter_dir: str = ""
    max_loaded_adapters: int = 64
    max_run_page_fraction: float = 1.0
    max_group_page_fraction: float = 1.0
    group_reserve_page_fraction: float = 0.0
    max_run_contexts: int = 4096
    max_fill_chunk_tokens: int = 0
    max_decode_steps: int = 16
    multi_step_budget_ms: float = MULTI_STEP_BUDGET_MS
    startup_timeout_s: float = 60.0
    grammar_budget: GrammarBudget = field(default_factory=GrammarBudget)
    progress: Callable[[str], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "driver_args", tuple(self.driver_args))
        self.driver_spec().kind  # noqa: B018 - validates the driver name
        self.page_quota(0)  # validates the shares
        if self.max_run_contexts < 0:
            raise InvalidRequest(f"max_run_contexts must be >= 0, got {self.max_run_contexts}")
        if not 0 <= self.multi_step_budget_ms < float("inf"):
            raise InvalidRequest(f"multi_step_budget_ms must be >= 0 (milliseconds), got {self.multi_step_budget_ms}")
        if self.page_size:  # judged now against the size asked for, and again after the
            # handshake against the size the driver resolved (`check_resolved`)
            try:
                check_prefix_match_unit(self.prefix_match_unit, self.page_size, self.speculation_depth)
            except ConfigError as exc:
                raise InvalidRequest(f"configuration rejected: {exc}") from None

    @property
    def decode_steps_cap(self) -> int:
        """`max_decode_steps` within what the bridge allows (at least 1)."""
        return max(1, min(self.max_decode_steps, MAX_DECODE_STEPS))

    def page_quota(self, num_pages: int) -> PageQuota:
        return PageQuota(
            num_pages, self.max_run_page_fraction, self.max_group_page_fraction, self.group_reserve_page_fraction
        )

    def hello(self) -> Hello:
        return Hello(
            page_size=self.page_size,
            num_pages=self.num_pages,
            prefix_match_unit=self.prefix_match_unit,
            speculation_depth=self.speculation_depth,
        )

    def driver_spec(self) -> DriverSpec:
        return DriverSpec(self.driver, self.driver_args, self.driver_module, self.startup_timeout_s, self.hello())

    def check_resolved(self, page_size: int) -> None:
        """The configuration rules again, against the page size the driver resolved."""
        try:
            check_prefix_match_unit(self.prefix_match_unit, page_size, self.speculation_depth)
        except ConfigError as exc:
            raise InvalidRequest(f"configuration rejected after the handshake: {exc}") from None
        unit = self.prefix_match_unit
        if unit and unit != page_size:
            raise InvalidRequest(
                f"prefix_match_unit {unit} is sub-page: prefix reuse matches whole pages of the "
                f"driver's resolved page size {page_size}"
            )
