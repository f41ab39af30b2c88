"""The console's live state (`GET /dashboard/state`): engine-wide rates, sampled at most every
SAMPLE_INTERVAL_S with a short history for the sparklines, and the asking key's own runs (with
keys configured, nothing of another key's runs, not even a count). Knows nothing of HTTP."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Histogram

from host.daemon.daemon import Daemon
from host.daemon.replica_set import AnyEngine
from host.daemon.runs import RunRecord, RunState
from host.daemon.supervisor import DriverState, DriverStatus

# The owner of a request with no key when keys are configured: it sees no run at all.
ANONYMOUS = "\0anonymous"
SAMPLE_INTERVAL_S = 0.5  # however many consoles poll, the driver is asked for its counters at most this often
MAX_GAP_S = 5.0  # a reading older than this (nobody looked meanwhile) starts the rates afresh
HISTORY_POINTS = 120  # per sparkline
MAX_RUNNING_SHOWN = 100
MAX_ENDED_SHOWN = 20
KEY_ID_SHOWN = 8  # hex digits of a key's digest shown beside its runs
# The series the sparklines draw, in the order of `Rates`.
SERIES = ("generated_per_s", "computed_per_s", "passes_per_s", "pass_ms", "itl_ms", "ttft_ms")


@dataclass(frozen=True, slots=True)
class Counters:
    """Engine-wide cumulative counters read at `at_s` (monotonic seconds)."""

    at_s: float
    passes: float = 0.0
    requests: float = 0.0  # forward requests (contexts) in those passes; NaN when the driver does not count them
    computed: float = 0.0  # input tokens the driver computed
    generated: float = 0.0  # tokens the driver sampled
    forward_s: float = float("nan")  # seconds the driver spent in passes (where it counts them)
    itl_sum_s: float = 0.0
    itl_count: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0


@dataclass(frozen=True, slots=True)
class Rates:
    """What happened between two readings; None where nothing was measured."""

    generated_per_s: float
    computed_per_s: float
    passes_per_s: float
    pass_ms: float | None  # the driver's time per pass
    itl_ms: float | None  # OpenAI requests: time between generated pieces
    ttft_ms: float | None  # OpenAI requests: time to first token
    batch_size: float | None  # forward requests per pass (sampled tokens per pass where not counted)


def rates_between(before: Counters, after: Counters) -> Rates:
    """Pure. A counter that went back (a driver restarted and counts from zero) counts from zero."""
    span_s = max(after.at_s - before.at_s, 1e-9)

    def delta(name: str) -> float:
        old, new = getattr(before, name), getattr(after, name)
        return float(new - old if new >= old else new)  # went back, or was not counted before

    def mean_ms(total: str, count: str) -> float | None:
        n = delta(count)
        return delta(total) / n * 1000.0 if n > 0 else None

    passes = delta("passes")
    requests = delta("requests") if after.requests == after.requests else delta("generated")  # NaN: not counted
    forward_s = delta("forward_s")
    return Rates(
        generated_per_s=delta("generated") / span_s,
        computed_per_s=delta("computed") / span_s,
        passes_per_s=passes / span_s,
        pass_ms=forward_s / passes * 1000.0 if passes and forward_s == forward_s else None,
        itl_ms=mean_ms("itl_sum_s", "itl_count"),
        ttft_ms=mean_ms("ttft_sum_s", "ttft_count"),
        batch_size=requests / passes if passes else None,
    )


def histogram_totals(histogram: Histogram) -> tuple[float, float]:
    """(sum, count) of a histogram over all its label values."""
    total = count = 0.0
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    return total, count


class Sampler:
    """Engine-wide readings, taken when a console asks and the last is older than
    SAMPLE_INTERVAL_S, and the rates between the last HISTORY_POINTS of them."""

    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon
        self._lock = threading.Lock()
        self._last: Counters | None = None
        self._rates: Rates | None = None
        self._history: deque[tuple[float, Rates]] = deque(maxlen=HISTORY_POINTS)

    def sample(self, now_s: float | None = None) -> tuple[Rates | None, list[tuple[float, Rates]]]:
        """The latest rates (None until two readings) and the history, as (wall time, rates)."""
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            if self._last is None or now_s - self._last.at_s >= SAMPLE_INTERVAL_S:
                reading = self._read(now_s)
                if self._last is not None and now_s - self._last.at_s <= MAX_GAP_S:
                    self._rates = rates_between(self._last, reading)
                    self._history.append((time.time(), self._rates))
                else:
                    self._rates = None
                self._last = reading
            return self._rates, list(self._history)

    def _read(self, now_s: float) -> Counters:
        daemon = self._daemon
        stats = daemon.driver_stats()  # {} while the driver is down

        def stat(name: str, default: float = 0.0) -> float:
            value = stats.get(name)
            return float(value) if isinstance(value, int | float) else default

        itl_sum, itl_count = histogram_totals(daemon.inter_token)
        ttft_sum, ttft_count = histogram_totals(daemon.first_token)
        return Counters(
            at_s=now_s,
            passes=stat("forwards"),
            requests=stat("requests", float("nan")),
            computed=stat("tokens"),
            generated=stat("outputs"),
            forward_s=stat("forward_s", float("nan")),
            itl_sum_s=itl_sum,
            itl_count=itl_count,
            ttft_sum_s=ttft_sum,
            ttft_count=ttft_count,
        )


def console_state(daemon: Daemon, sampler: Sampler, owner: str | None) -> dict[str, Any]:
    """The console's view: `owner` is the asking key's digest (only its runs), None when the
    daemon has no keys (every run), or ANONYMOUS (keys configured, none given: no runs)."""
    rates, history = sampler.sample()
    engine = daemon.live_engine()
    status = daemon.supervisor.status()
    runs: dict[str, Any]
    if owner == ANONYMOUS:
        scope, runs = "engine", {"running": None, "ended": {}, "items": []}
    else:
        scope, runs = ("all" if owner is None else "key"), _runs(daemon.runs.list(owner=owner), engine)
    return {
        "now": time.time(),
        "scope": scope,
        "key": (owner if owner != ANONYMOUS else "")[:KEY_ID_SHOWN] if owner else "",
        "model": engine.model.name if engine is not None else None,
        "driver": _driver(status),
        "engine": _engine(engine, rates),
        "history": _history(history),
        "runs": runs,
        "replicas": _replicas(daemon),
    }


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _driver(status: DriverStatus) -> dict[str, Any]:
    return {
        "state": status.state.value,
        "restarts": status.num_restarts,
        "last_error": status.last_error or None,
    }


def _engine(engine: AnyEngine | None, rates: Rates | None) -> dict[str, Any]:
    out: dict[str, Any] = {name: None for name in (*SERIES, "batch_size", "kv_usage", "spec_hit_rate")}
    if rates is not None:
        out |= {name: _round(getattr(rates, name)) for name in (*SERIES, "batch_size")}
    if engine is None:
        return out | {"num_pages": None, "available_pages": None}
    num_pages, available = engine.num_pages, engine.num_available_pages
    speculation = engine.speculation_stats()
    staged = speculation.get("speculation_staged", 0)
    return out | {
        "num_pages": num_pages,
        "available_pages": available,
        "kv_usage": _round(1.0 - available / num_pages, 4) if num_pages else None,
        # Of the decode steps pre-fired, the share an inferlet's request was served from.
        "spec_hit_rate": _round(speculation.get("speculation_hits", 0) / staged, 4) if staged else None,
    }


def _history(history: Iterable[tuple[float, Rates]]) -> dict[str, list[float | None]]:
    points = list(history)
    out: dict[str, list[float | None]] = {"t": [round(t, 3) for t, _ in points]}
    for name in SERIES:
        out[name] = [_round(getattr(r, name)) for _, r in points]
    return out


def _runs(records: list[RunRecord], engine: AnyEngine | None) -> dict[str, Any]:
    running = [r for r in records if r.outcome is None]
    ended = [r for r in records if r.outcome is not None]
    num_ended: dict[str, int] = {s.value: 0 for s in RunState if s is not RunState.RUNNING}
    for record in ended:
        num_ended[record.state.value] += 1
    now = time.time()
    shown = running[-MAX_RUNNING_SHOWN:] + ended[-MAX_ENDED_SHOWN:]
    items = [_run(record, engine, now) for record in sorted(shown, key=lambda r: -r.run_id)]
    return {"running": len(running), "ended": num_ended, "items": items}


def _run(record: RunRecord, engine: AnyEngine | None, now: float) -> dict[str, Any]:
    tokens = pages = contexts = None
    if record.outcome is None and engine is not None:
        contexts, pages = engine.run_usage(record.run_id)
        tokens = engine.run_num_tokens(record.run_id)
    return {
        "id": record.run_id,
        "inferlet": record.inferlet,
        "kind": record.kind,
        "key": record.owner[:KEY_ID_SHOWN],
        "state": record.state.value,
        "tokens": tokens,
        "pages": pages,
        "contexts": contexts,
        "age_s": round(max(0.0, now - record.created_at), 1),
        "error": record.error_message(),
    }


def _replicas(daemon: Daemon) -> list[dict[str, Any]]:
    out = []
    engines = daemon.supervisor.replica_engines()
    for index, (status, engine) in enumerate(zip(daemon.supervisor.statuses(), engines, strict=True)):
        out.append(
            {
                "index": index,
                "state": status.state.value,
                "is_ready": status.state is DriverState.READY,
                "serving": engine is not None,
                "pid": status.pid,
                "restarts": status.num_restarts,
                "last_error": status.last_error or None,
                "available_pages": engine.num_available_pages if engine is not None else None,
                "num_pages": engine.num_pages if engine is not None else None,
            }
        )
    return out
