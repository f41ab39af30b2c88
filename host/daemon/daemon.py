"""The daemon's parts and their lifecycle: sandbox, built-in chat inferlet, driver supervisor,
run registry, inferlet store and metrics; started before the server accepts and stopped
(runs drained, driver shut down) after it stops accepting.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from host.build import BuildError, build
from host.daemon.config import DaemonConfig
from host.daemon.errors import DaemonError
from host.daemon.inferlet_store import InferletStore
from host.daemon.metrics import TOKEN_BUCKETS_S, LabelValues, Registry, SampledFamily
from host.daemon.replica_set import AnyEngine, ReplicaSet
from host.daemon.runs import RunRegistry
from host.daemon.supervisor import DriverState
from host.engine import Engine
from host.errors import HostError
from host.sandbox import LoadedInferlet, Sandbox

log = logging.getLogger("wafer.daemon")

CHAT_INFERLET = "chat"
# How long a request waits for a starting or restarting driver before it gets a 503.
ENGINE_WAIT_S = 30.0


class DaemonStartError(DaemonError):
    """The daemon cannot start (the chat inferlet does not build, the sandbox fails)."""


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.metrics = m = Registry()
        self.latency = m.histogram(
            "wafer_http_request_duration_seconds",
            "HTTP request latency, until the last byte",
            ("method", "route", "status"),
        )
        # OpenAI requests, named as vLLM names them (docs/operating.md, "Metrics").
        endpoint = ("endpoint",)
        self.first_token = m.histogram(
            "wafer_time_to_first_token_seconds", "Time from request to its first generated token", endpoint
        )
        self.inter_token = m.histogram(
            "wafer_inter_token_latency_seconds", "Time between generated tokens", endpoint, TOKEN_BUCKETS_S
        )
        self.e2e = m.histogram("wafer_e2e_request_latency_seconds", "Time from request to its last token", endpoint)
        self.queue_time = m.histogram(
            "wafer_request_queue_time_seconds",
            "Time from request until its run started (waiting for a driver, preparing the prompt)",
            endpoint,
        )
        self.waiting = m.gauge("wafer_requests_waiting", "OpenAI requests whose run has not started yet")
        self.prompt_tokens = m.counter("wafer_prompt_tokens_total", "Prompt tokens of finished requests", endpoint)
        self.generation_tokens = m.counter(
            "wafer_generation_tokens_total", "Tokens generated for finished requests", endpoint
        )
        self.requests = m.counter("wafer_openai_requests_total", "OpenAI requests by outcome", ("endpoint", "outcome"))
        self.sandbox: Sandbox | None = None
        self.supervisor = ReplicaSet(config)  # one supervisor per driver replica
        self._registry: RunRegistry | None = None
        self._store: InferletStore | None = None
        self._chat: LoadedInferlet | None = None
        self._model_name = config.served_model_name
        self._lock = threading.Lock()
        self._register_metrics()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Blocking: builds (or finds cached) the chat inferlet, then starts the driver."""
        self.sandbox = Sandbox(self.config.sandbox_config())
        try:
            # A snapshot build: its modules are imported once, at build time, instead of at the start
            # of every request's run (13 ms a run on wafer's base; docs/performance.md).
            result = build(
                CHAT_INFERLET, self.config.cache_dir, lambda msg: log.info("chat inferlet: %s", msg), snapshot=True
            )
            self._chat = self.sandbox.load(result.wasm_path)
        except (BuildError, HostError, DaemonError) as exc:
            self.sandbox.close()
            raise DaemonStartError(f"the built-in chat inferlet cannot be built: {exc}") from None
        self._store = InferletStore(self.config.data_dir / "inferlets", self.sandbox)
        self._registry = RunRegistry(self.config, self.sandbox, self.supervisor)
        self.supervisor.start()

    def stop(self) -> None:
        if self._registry is not None:
            self._registry.drain(self.config.drain_timeout_s)
        self.supervisor.stop()
        if self.sandbox is not None:
            self.sandbox.close()

    # ------------------------------------------------------------------ parts

    @property
    def runs(self) -> RunRegistry:
        assert self._registry is not None, "the daemon is not started"
        return self._registry

    @property
    def store(self) -> InferletStore:
        assert self._store is not None, "the daemon is not started"
        return self._store

    @property
    def chat_component(self) -> LoadedInferlet:
        assert self._chat is not None, "the daemon is not started"
        return self._chat

    def engine(self, wait_s: float = ENGINE_WAIT_S) -> AnyEngine:
        """The live engine (blocking: waits for a starting or restarting driver)."""
        engine, _ = self.supervisor.engine(wait_s)
        with self._lock:
            if not self._model_name:
                self._model_name = engine.model.name
        return engine

    def served_model(self) -> str:
        """The model id clients name (blocking the first time: it comes from the handshake)."""
        return self.served_model_waiting(ENGINE_WAIT_S)

    def served_model_waiting(self, wait_s: float) -> str:
        with self._lock:
            if self._model_name:
                return self._model_name
        self.engine(wait_s)
        return self._model_name

    # ------------------------------------------------------------------ metrics

    def _register_metrics(self) -> None:
        m = self.metrics
        m.add(SampledFamily("wafer_requests_running", "Runs running now (chat and inferlet)", "gauge", (), self._busy))
        m.add(SampledFamily("wafer_kv_cache_usage_ratio", "KV pages in use of the pool", "gauge", (), self._kv_usage))
        m.add(
            SampledFamily(
                "wafer_prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache",
                "counter",
                (),
                lambda: self._prefix_stat("tokens_queried"),
            )
        )
        m.add(
            SampledFamily(
                "wafer_prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache (not computed again)",
                "counter",
                (),
                lambda: self._prefix_stat("tokens_reused"),
            )
        )
        m.add(SampledFamily("wafer_driver_up", "1 when a driver (any replica) is ready", "gauge", (), self._driver_up))
        m.add(SampledFamily("wafer_driver_restarts_total", "Driver restarts", "counter", (), self._restarts))
        m.add(SampledFamily("wafer_runs", "Runs now running", "gauge", ("kind",), self._running))
        m.add(SampledFamily("wafer_runs_ended_total", "Runs ended, by final state", "counter", ("state",), self._ended))
        m.add(
            SampledFamily(
                "wafer_runs_by_inferlet_total",
                "Runs ended, by inferlet (an upload's id, or chat; past 64 of them, other) and final state",
                "counter",
                ("inferlet", "outcome"),
                self._ended_by_inferlet,
            )
        )
        m.add(
            SampledFamily(
                "wafer_driver_stat",
                "The driver's own counters (passes, requests, tokens...); reset on restart",
                "gauge",
                ("name",),
                self._driver_stats,
            )
        )
        m.add(
            SampledFamily(
                "wafer_passes_total",
                "Passes (batched forward requests) sent to the driver",
                "counter",
                (),
                lambda: self._pick_driver_stat("forwards"),
            )
        )
        m.add(
            SampledFamily(
                "wafer_pass_tokens_total",
                "Input tokens computed by the driver",
                "counter",
                (),
                lambda: self._pick_driver_stat("tokens"),
            )
        )
        m.add(
            SampledFamily(
                "wafer_batch_size_mean",
                "Mean forward requests per pass",
                "gauge",
                (),
                self._batch_size,
            )
        )
        m.add(
            SampledFamily(
                "wafer_speculation_total",
                "Speculation: hits, staged fires, misses and skips by reason",
                "counter",
                ("outcome", "reason"),
                self._speculation,
            )
        )
        m.add(SampledFamily("wafer_prefix_cache", "Prefix reuse counters", "gauge", ("name",), self._prefix))
        replica = ("replica",)
        m.add(SampledFamily("wafer_replica_up", "1 when the replica's driver is ready", "gauge", replica, self._up))
        m.add(
            SampledFamily(
                "wafer_replica_restarts_total", "Restarts of the replica's driver", "counter", replica, self._rs
            )
        )
        m.add(
            SampledFamily(
                "wafer_replica_stat",
                "Each replica's engine and driver counters: available_pages, num_pages, the driver's own",
                "gauge",
                ("replica", "name"),
                self._replica_stats,
            )
        )

    def live_engine(self) -> AnyEngine | None:
        try:
            engine, _ = self.supervisor.engine(0.0)
        except DaemonError:
            return None
        return engine

    def _up(self) -> Mapping[LabelValues, float]:
        return {(str(i),): float(s.state is DriverState.READY) for i, s in enumerate(self.supervisor.statuses())}

    def _rs(self) -> Mapping[LabelValues, float]:
        return {(str(i),): float(s.num_restarts) for i, s in enumerate(self.supervisor.statuses())}

    def replica_stats(self, engine: Engine) -> dict[str, float]:
        """One replica's page pool and its driver's counters (empty if the driver does not answer)."""
        try:
            health = engine.driver_health()
        except HostError:
            return {}
        stats = {k: float(v) for k, v in health.items() if isinstance(v, int | float)}
        return stats | {"available_pages": float(engine.num_available_pages), "num_pages": float(engine.num_pages)}

    def _replica_stats(self) -> Mapping[LabelValues, float]:
        out: dict[LabelValues, float] = {}
        for i, engine in enumerate(self.supervisor.replica_engines()):
            for name, value in (self.replica_stats(engine) if engine is not None else {}).items():
                out[(str(i), name)] = value
        return out

    def _driver_up(self) -> Mapping[LabelValues, float]:
        return {(): 1.0 if self.supervisor.status().state is DriverState.READY else 0.0}

    def _restarts(self) -> Mapping[LabelValues, float]:
        return {(): float(self.supervisor.status().num_restarts)}

    def _running(self) -> Mapping[LabelValues, float]:
        if self._registry is None:
            return {}
        out: dict[LabelValues, float] = {("chat",): 0.0, ("inferlet",): 0.0}
        for record in self._registry.list():
            if record.outcome is None:
                out[(record.kind,)] += 1
        return out

    def _ended(self) -> Mapping[LabelValues, float]:
        if self._registry is None:
            return {}
        return {(state,): float(n) for state, n in self._registry.counts().items() if state != "running"}

    def _ended_by_inferlet(self) -> Mapping[LabelValues, float]:
        if self._registry is None:
            return {}
        return {labels: float(n) for labels, n in self._registry.ended_by_inferlet().items()}

    def driver_stats(self) -> dict[str, int | float | str]:
        engine = self.live_engine()
        if engine is None:
            return {}
        try:
            return engine.driver_health()
        except HostError:
            return {}

    def _driver_stats(self) -> Mapping[LabelValues, float]:
        return {(k,): float(v) for k, v in self.driver_stats().items() if isinstance(v, int | float)}

    def _pick_driver_stat(self, name: str) -> Mapping[LabelValues, float]:
        value = self.driver_stats().get(name)
        return {(): float(value)} if isinstance(value, int | float) else {}

    def _batch_size(self) -> Mapping[LabelValues, float]:
        stats = self.driver_stats()
        passes, requests = stats.get("forwards"), stats.get("requests")
        if isinstance(passes, int | float) and isinstance(requests, int | float) and passes:
            return {(): float(requests) / float(passes)}
        return {}

    def _speculation(self) -> Mapping[LabelValues, float]:
        engine = self.live_engine()
        if engine is None:
            return {}
        out: dict[LabelValues, float] = {}
        for key, value in engine.speculation_stats().items():
            name = key.removeprefix("speculation_")
            outcome, _, reason = name.partition("_")
            out[(outcome, reason)] = float(value)
        return out

    def _busy(self) -> Mapping[LabelValues, float]:
        return {(): sum(self._running().values())}

    def _kv_usage(self) -> Mapping[LabelValues, float]:
        engine = self.live_engine()
        if engine is None or not engine.num_pages:
            return {}
        return {(): 1.0 - engine.num_available_pages / engine.num_pages}

    def _prefix_stat(self, name: str) -> Mapping[LabelValues, float]:
        engine = self.live_engine()
        value = engine.prefix_stats().get(f"prefix_{name}") if engine is not None else None
        return {(): float(value)} if value is not None else {}

    def _prefix(self) -> Mapping[LabelValues, float]:
        engine = self.live_engine()
        if engine is None:
            return {}
        return {(k.removeprefix("prefix_"),): float(v) for k, v in engine.prefix_stats().items()}
