"""Driver supervision: start the driver process and the engine on it, watch both, and when the
driver dies fail what was in flight (the engine does), then restart with exponential backoff.

It owns the driver process and the `Engine`; it knows nothing of HTTP or runs.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from host.daemon.config import DaemonConfig
from host.daemon.errors import DriverUnavailable
from host.driver_link import BUILTIN_DRIVERS
from host.driver_process import driver_argv, output_tail, owned_driver_env, socket_path, stop_process
from host.engine import Engine, EngineConfig, GrammarBudget
from host.errors import HostError

log = logging.getLogger("wafer.daemon.driver")

_POLL_S = 0.05  # how often the driver process is checked: bounds how late a death is noticed
_HEALTH_EVERY_S = 2.0  # a bridge round trip, catching a live process with a dead link
_STABLE_AFTER_S = 30.0  # a driver up this long resets the backoff
_EXIT_REJECTED = 2  # a driver's exit status for arguments or a model it refuses (argparse's too)


class _DriverRejected(DriverUnavailable):
    """The driver exited before listening, refusing its configuration: a restart cannot help."""


class DriverState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"  # the driver refused its configuration (a model it cannot load): not restarted
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class DriverStatus:
    state: DriverState
    pid: int | None
    num_restarts: int
    last_error: str
    generation: int  # increments with every engine started: tells runs of a dead engine apart


class Supervisor:
    """One driver (`driver`, the configuration's first by default) and its engine; `index` is
    its replica's, for the logs."""

    def __init__(
        self,
        config: DaemonConfig,
        on_lost: Callable[[int, str], None] | None = None,
        driver: str = "",
        index: int = 0,
    ) -> None:
        self._config = config
        self._driver = driver or config.replica_drivers[0]  # an entry: a driver and its own arguments
        self._name = f"replica {index} driver" if len(config.replica_drivers) > 1 else "driver"
        self._on_lost = on_lost
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._engine: Engine | None = None
        self._state = DriverState.STARTING
        self._pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._num_restarts = 0
        self._last_error = ""
        self._generation = 0
        self._output: threading.Thread | None = None  # forwards the driver process's output
        self._thread = threading.Thread(target=self._main, name=f"wafer-supervisor-{index}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Close the engine and stop the driver; idempotent."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def is_stopping(self) -> bool:
        return self._stopping.is_set()

    def status(self) -> DriverStatus:
        with self._cond:
            return DriverStatus(self._state, self._pid, self._num_restarts, self._last_error, self._generation)

    def engine(self, timeout_s: float = 0.0) -> tuple[Engine, int]:
        """The live engine and its generation, waiting up to `timeout_s` for a (re)start."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            # A driver that just died is not handed out in the moment before the watcher notices.
            while self._engine is None or (self._proc is not None and self._proc.poll() is not None):
                remaining = deadline - time.monotonic()
                if self._state is DriverState.FAILED:
                    raise DriverUnavailable(f"the model driver cannot start: {self._last_error}")
                if self._stopping.is_set() or remaining <= 0:
                    detail = f": {self._last_error}" if self._last_error else ""
                    raise DriverUnavailable(f"the model driver is {self._state.value}{detail}")
                self._cond.wait(min(remaining, _POLL_S))
            return self._engine, self._generation

    def is_current(self, generation: int) -> bool:
        with self._cond:
            return self._engine is not None and self._generation == generation

    def lost_reason(self, generation: int, settle_s: float = 0.25) -> str:
        """Why the engine of `generation` is gone, or "" if it still looks alive. A run that failed
        because its driver died can end a moment before the process is reaped: look again
        for up to `settle_s` before calling it alive."""
        deadline = time.monotonic() + settle_s
        while True:
            with self._cond:
                if self._generation != generation or self._engine is None:
                    return self._last_error or "the driver was lost"
                proc = self._proc
            if proc is not None and proc.poll() is not None:
                return f"driver process {proc.pid} exited with status {proc.returncode}"
            if time.monotonic() >= deadline:
                return ""
            time.sleep(_POLL_S)

    # ------------------------------------------------------------------ the supervisor thread

    def _main(self) -> None:
        backoff_s = self._config.restart_backoff_initial_s
        while not self._stopping.is_set():
            started_at = time.monotonic()
            reason = self._run_once()
            if self._stopping.is_set():
                break
            with self._cond:
                failed = self._state is DriverState.FAILED
            if failed:
                log.error("%s cannot start (%s); not restarted: fix the configuration and restart", self._name, reason)
                self._stopping.wait()
                break
            if time.monotonic() - started_at > _STABLE_AFTER_S:
                backoff_s = self._config.restart_backoff_initial_s
            log.warning("%s lost (%s); restarting in %.2f s", self._name, reason, backoff_s)
            with self._cond:
                self._state = DriverState.RESTARTING
                self._last_error = reason
                self._num_restarts += 1
            self._stopping.wait(backoff_s)
            backoff_s = min(backoff_s * 2, self._config.restart_backoff_max_s)
        with self._cond:
            self._state = DriverState.STOPPED
            self._cond.notify_all()

    def _run_once(self) -> str:
        """Start a driver and an engine, serve until one fails or we stop; returns why it ended."""
        workdir = tempfile.mkdtemp(prefix="wafer-daemon-driver-")
        proc: subprocess.Popen[bytes] | None = None
        engine: Engine | None = None
        try:
            address = self._config.driver_of(self._driver)
            if address in BUILTIN_DRIVERS:
                address = f"unix:{os.path.join(workdir, 'driver.sock')}"
                proc = self._spawn(address, workdir)
                with self._cond:
                    self._pid, self._proc = proc.pid, proc
                self._wait_for_socket(proc, address, workdir)
            engine = Engine.start(
                EngineConfig(
                    driver=address,
                    speculation_depth=self._config.speculation_depth,
                    max_decode_steps=self._config.max_decode_steps,
                    multi_step_budget_ms=self._config.multi_step_budget_ms,
                    prefix_match_unit=self._config.prefix_match_unit,
                    adapter_dir=self._config.adapter_dir,
                    max_loaded_adapters=self._config.max_loaded_adapters,
                    max_run_page_fraction=self._config.run_max_pages_fraction,
                    max_group_page_fraction=self._config.key_max_pages_fraction,
                    group_reserve_page_fraction=self._config.key_reserve_pages_fraction,
                    max_run_contexts=self._config.run_max_contexts,
                    startup_timeout_s=self._config.driver_startup_timeout_s,
                    progress=log.info,
                    grammar_budget=GrammarBudget(
                        self._config.grammar_compile_budget_s,
                        self._config.grammar_max_mib,
                        self._config.grammar_cache_mib,
                    ),
                )
            )
            with self._cond:
                self._generation += 1
                generation = self._generation
                self._engine = engine
                self._state = DriverState.READY
                self._last_error = ""
                self._cond.notify_all()
            log.info("%s ready: %s (model %s)", self._name, address, engine.model.name)
            reason = self._watch(proc, engine)
            self._lose(generation, reason)
            return reason
        except _DriverRejected as exc:
            with self._cond:
                self._state = DriverState.FAILED
                self._last_error = f"driver start failed: {exc}"
                self._cond.notify_all()
            return self._last_error
        except (HostError, DriverUnavailable, OSError) as exc:
            return f"driver start failed: {exc}"
        finally:
            with self._cond:
                self._engine = None
                self._pid, self._proc = None, None
            if engine is not None:
                engine.close()  # fails every pass still waiting, so runs on it end now
            if proc is not None:
                stop_process(proc)
            shutil.rmtree(workdir, ignore_errors=True)

    def _lose(self, generation: int, reason: str) -> None:
        with self._cond:
            self._engine = None
            if not self._stopping.is_set():
                self._state = DriverState.RESTARTING
        if self._on_lost is not None:
            self._on_lost(generation, reason)

    def _spawn(self, address: str, workdir: str) -> subprocess.Popen[bytes]:
        module = f"drivers.{self._config.driver_of(self._driver)}"
        argv = driver_argv(module, address, self._config.driver_argv_of(self._driver))
        # Its own session: a Ctrl-C meant for the daemon must not kill the driver before the
        # daemon has drained its runs.
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=owned_driver_env(),
        )
        assert proc.stdout is not None
        self._output = threading.Thread(
            target=_forward_output,
            args=(proc.stdout, os.path.join(workdir, "driver.log"), proc.pid),
            name=f"wafer-driver-output-{proc.pid}",
            daemon=True,
        )
        self._output.start()
        return proc

    def _wait_for_socket(self, proc: subprocess.Popen[bytes], address: str, workdir: str) -> None:
        path = socket_path(address)
        deadline = time.monotonic() + self._config.driver_startup_timeout_s
        while not os.path.exists(path):
            if proc.poll() is not None:
                if self._output is not None:
                    self._output.join(timeout=2.0)  # its last words, before quoting them
                kind = _DriverRejected if proc.returncode == _EXIT_REJECTED else DriverUnavailable
                raise kind(f"driver exited with status {proc.returncode}: {_tail(workdir)}")
            if time.monotonic() > deadline or self._stopping.is_set():
                raise DriverUnavailable(f"driver did not listen within the startup timeout: {_tail(workdir)}")
            time.sleep(_POLL_S)

    def _watch(self, proc: subprocess.Popen[bytes] | None, engine: Engine) -> str:
        next_health = time.monotonic() + _HEALTH_EVERY_S
        while not self._stopping.wait(_POLL_S):
            if proc is not None and proc.poll() is not None:
                return f"driver process {proc.pid} exited with status {proc.returncode}"
            if time.monotonic() >= next_health:
                try:
                    engine.driver_health()
                except HostError as exc:
                    return f"driver health check failed: {exc}"
                next_health = time.monotonic() + _HEALTH_EVERY_S
        return "daemon stopping"


def _forward_output(stream: IO[bytes], log_path: str, pid: int) -> None:
    """Until the driver closes its output: each line into the daemon's log (the driver's loading
    progress, its warnings) and into `log_path` (the tail quoted when the driver fails)."""
    # The driver blocks once the pipe is full: whatever happens to the file, keep reading.
    try:
        log_file: IO[bytes] | None = open(log_path, "ab")  # closed below
    except OSError:
        log_file = None
    with stream:
        for raw in stream:
            if log_file is not None:
                try:
                    log_file.write(raw)
                    log_file.flush()
                except OSError:
                    log_file = None
            line = raw.decode("utf-8", errors="replace").rstrip()
            if line:
                log.info("driver %d: %s", pid, line)
    if log_file is not None:
        log_file.close()


def _tail(workdir: str) -> str:
    return output_tail(os.path.join(workdir, "driver.log"), 2000)
