"""The daemon's one configuration object, and its one reader.

Values come from a TOML file (`--config`), then `WAFER_<KEY>` environment variables, then
command-line flags; later sources win. Every key is checked here, once, and a bad value is a
`DaemonConfigError` naming the key. Nothing below the edge reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge_schema.messages import MAX_DECODE_STEPS
from host.daemon.errors import DaemonConfigError
from host.driver_link import BUILTIN_DRIVERS
from host.driver_process import DriverEntryError, split_driver
from host.engine.config import MULTI_STEP_BUDGET_MS
from host.sandbox.config import MIB, RunHostLimits, SandboxConfig, default_cache_dir

LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("debug", "info", "warning", "error")
ENV_PREFIX = "WAFER_"


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    driver: str = "dummy"  # dummy | torch (started and supervised) | unix:PATH | tcp:HOST:PORT
    # Replicas: one driver each, as `driver` (given, it replaces `driver`; empty: `driver` alone);
    # a built-in one may carry its own arguments after its name ("torch --device cuda:1").
    drivers: tuple[str, ...] = ()
    driver_args: tuple[str, ...] = ()
    model: str = ""  # torch driver: passed as --model (default: the embedded SmolLM2)
    served_model_name: str = ""  # the id in /v1/models; default: the driver's model name
    speculation_depth: int = 1
    max_decode_steps: int = 16  # multi-step requests while passes are short; 1 = off
    multi_step_budget_ms: float = MULTI_STEP_BUDGET_MS  # how long one multi-step request may hold the device
    # Prefix reuse: a prompt's whole pages already in the KV cache are not computed again (the
    # driver's page size, 16 for ours; 0 = off). With replicas, a run goes where its prefix is.
    prefix_match_unit: int = 0
    max_concurrent_runs: int = 64
    key_max_concurrent_runs: int = 64  # runs one API key may have running at once (lower it to share)
    key_reserve_run_slots: int = 8  # the last slots, which only a key with no run running may take
    # Runs of one key computing in guest code at once (0: this machine's cores less one, at least 1).
    key_guest_threads: int = 0
    # A key's host calls that cost CPU (>= 2 ms: a group of many passes) are followed by a wait
    # of this times their CPU for each other key with a run live (0: off). See docs/operating.md.
    key_host_pacing: float = 1.0
    run_memory_mib: int = 256
    run_timeout_s: float = 600.0
    run_watchdog_s: float = 30.0
    run_max_output_mib: int = 64  # what one run may emit and send, together
    run_max_inbound_mib: int = 16  # client messages waiting for one run
    # What one run's wasm may declare beyond its one linear memory (its tables come out of
    # run_memory_mib), and what it may make the host hold or log (SandboxConfig, RunHostLimits).
    run_max_tables: int = 4
    run_max_table_slots: int = 131_072
    run_max_instances: int = 32
    run_max_log_kib: int = 1024  # runtime.log, and each of stdout and stderr, in the host's log
    run_max_grammars: int = 64
    run_max_grammar_mib: int = 256
    run_max_matchers: int = 256
    run_max_matcher_tokens: int = 131_072
    completions_max_prompts: int = 128  # prompts in one /v1/completions request
    completions_max_choices: int = 256  # prompts x n in one /v1/completions request
    adapter_dir: str = ""  # where LoRA adapter names are resolved, on the driver's machine ("" = off)
    max_loaded_adapters: int = 64
    max_loaded_component_mib: int = 1024  # compiled inferlets kept in memory (LRU past it)
    component_compile_mib: int = 2048  # the memory one inferlet's compile may take (in a child process)
    run_max_pages_fraction: float = 0.5  # of the KV page pool, the most one run's contexts may hold
    key_max_pages_fraction: float = 0.75  # the most the runs of one API key may hold together
    # The pool's last pages, which only a key holding fewer may take: shares may overlap.
    key_reserve_pages_fraction: float = 0.1
    run_max_contexts: int = 1024  # contexts one run may hold at once, forks included
    # OpenAI's rule for response_format json_object: the messages must say "json" (off: vLLM,
    # SGLang and llama.cpp accept such requests, and clients written for them send them).
    json_object_requires_json_word: bool = False
    grammar_compile_budget_s: float = 10.0  # the longest a request or run waits for one compile (0: none)
    grammar_max_mib: float = 64.0  # the most one compiled grammar may take; larger ones are a 400
    grammar_cache_mib: float = 512.0  # compiled grammars kept (least recently used dropped past it)
    max_upload_bytes: int = 64 * MIB
    max_request_bytes: int = 4 * MIB
    driver_startup_timeout_s: float = 600.0  # a first --compile start: kernels ~20 s, compiling ~4 min
    restart_backoff_initial_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    drain_timeout_s: float = 10.0
    # What the daemon keeps for tenants: finished runs (by count, and by the bytes of their output,
    # messages and error text; the oldest are forgotten first), in all and per API key; uploads per key.
    max_kept_runs: int = 256
    key_max_kept_runs: int = 64
    max_kept_run_mib: int = 512
    key_max_kept_run_mib: int = 128
    key_max_uploads: int = 64  # inferlets one API key may have uploaded (DELETE frees one)
    key_max_upload_bytes: int = 2048 * MIB  # their bytes together, each counted whole for each key
    cache_dir: Path = field(default_factory=default_cache_dir)
    data_dir: Path = field(default_factory=lambda: default_cache_dir() / "daemon")  # uploaded inferlets
    log_level: str = "info"
    log_format: str = "json"

    @property
    def replica_drivers(self) -> tuple[str, ...]:
        """Each replica's driver: `drivers`, or the one `driver`."""
        return self.drivers or (self.driver,)

    @property
    def is_supervised(self) -> bool:
        """True when the daemon starts the (first) driver process itself (and so can restart it)."""
        return self.driver_of(self.replica_drivers[0]) in BUILTIN_DRIVERS

    @property
    def driver_argv(self) -> tuple[str, ...]:
        return self.driver_argv_of(self.replica_drivers[0])

    @staticmethod
    def driver_of(entry: str) -> str:
        """The driver an entry of `replica_drivers` names: a built-in name or an address."""
        return split_driver(entry, BUILTIN_DRIVERS)[0]

    def driver_argv_of(self, entry: str) -> tuple[str, ...]:
        """Options for an entry's driver process: `model` becomes `--model` for the torch driver,
        then `driver_args`, then the entry's own arguments (which win where they repeat one)."""
        driver, own = split_driver(entry, BUILTIN_DRIVERS)
        model = ("--model", self.model) if driver == "torch" and self.model else ()
        return (*model, *self.driver_args, *own)

    def sandbox_config(self) -> SandboxConfig:
        """The per-run limits of the sandbox, from this configuration."""
        return SandboxConfig(
            cache_dir=self.cache_dir,
            memory_limit_bytes=self.run_memory_mib * MIB,
            inactivity_timeout_s=self.run_watchdog_s,
            wall_budget_s=self.run_timeout_s,
            max_output_bytes=self.run_max_output_mib * MIB,
            max_inbound_bytes=self.run_max_inbound_mib * MIB,
            max_tables=self.run_max_tables,
            max_table_elements=self.run_max_table_slots,
            max_instances=self.run_max_instances,
            host_limits=RunHostLimits(
                log_bytes=self.run_max_log_kib * 1024,
                stdio_log_bytes=self.run_max_log_kib * 1024,
                grammars=self.run_max_grammars,
                grammar_bytes=self.run_max_grammar_mib * MIB,
                matchers=self.run_max_matchers,
                matcher_tokens=self.run_max_matcher_tokens,
            ),
            max_loaded_component_bytes=self.max_loaded_component_mib * MIB,
            compile_memory_bytes=self.component_compile_mib * MIB,
            group_compute_slots=self.key_guest_threads or max(1, (os.cpu_count() or 2) - 1),
            host_pacing=self.key_host_pacing,
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(DaemonConfig))


def load_config(
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config_path: str | Path | None = None,
) -> DaemonConfig:
    """The configuration from a TOML file, the environment and flags (None values are unset).
    `environ` defaults to `os.environ`; `WAFER_CONFIG` names the file when `config_path` is None."""
    env = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    path = config_path if config_path is not None else env.get(f"{ENV_PREFIX}CONFIG")
    if path:
        _merge(raw, _read_file(Path(path)), str(path))
    from_env = {key: _from_env(key, env[ENV_PREFIX + key.upper()]) for key in KEYS if ENV_PREFIX + key.upper() in env}
    _merge(raw, from_env, "the environment")
    for key in flags or {}:
        if key not in KEYS:
            raise DaemonConfigError(key, "unknown configuration key")
    _merge(raw, {key: value for key, value in (flags or {}).items() if value is not None}, "the flags")
    if raw.get("model") and "driver" not in raw and "drivers" not in raw:
        raw["driver"] = "torch"  # a model and no driver chosen anywhere: the driver that loads models
    return _build(raw)


def _merge(raw: dict[str, Any], source: Mapping[str, Any], where: str) -> None:
    """A later source's values over the earlier ones'; `driver` and `drivers` say the same thing,
    so one replaces the other, and one source may not give both."""
    if "driver" in source and "drivers" in source:
        raise DaemonConfigError("drivers", f"give driver or drivers, not both (in {where})")
    for key in ("driver", "drivers"):
        if key in source:
            raw.pop("drivers" if key == "driver" else "driver", None)
    raw.update(source)


def _read_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise DaemonConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise DaemonConfigError("config", f"{path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise DaemonConfigError(unknown[0], f"unknown key in {path} (known keys: {', '.join(KEYS)})")
    return data


def _from_env(key: str, value: str) -> Any:
    """Environment values are strings, parsed here into the key's type: lists are
    comma-separated (driver_args: shell words)."""
    default = getattr(DaemonConfig(), key)
    if key in ("api_keys", "drivers"):
        return [k.strip() for k in value.split(",") if k.strip()]
    if key == "driver_args":
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise DaemonConfigError(key, f"cannot split {value!r} into arguments: {exc}") from None
    if isinstance(default, bool):
        word = value.strip().lower()
        if word not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise DaemonConfigError(key, f"expected true or false, got {value!r} (from {ENV_PREFIX}{key.upper()})")
        return word in ("1", "true", "yes", "on")
    if isinstance(default, int):
        try:
            return int(value.strip())
        except ValueError:
            raise DaemonConfigError(
                key, f"expected an integer, got {value!r} (from {ENV_PREFIX}{key.upper()})"
            ) from None
    if isinstance(default, float):
        try:
            return float(value.strip())
        except ValueError:
            raise DaemonConfigError(key, f"expected a number, got {value!r} (from {ENV_PREFIX}{key.upper()})") from None
    return value


def _build(raw: Mapping[str, Any]) -> DaemonConfig:
    defaults = DaemonConfig()
    values: dict[str, Any] = {}
    for f in dataclasses.fields(DaemonConfig):
        if f.name in raw:
            values[f.name] = _coerce(f.name, raw[f.name], getattr(defaults, f.name))
    if "cache_dir" in values and "data_dir" not in values:
        values["data_dir"] = values["cache_dir"] / "daemon"  # the default follows the cache
    config = dataclasses.replace(defaults, **values)
    _check(config)
    return config


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Check the value against the default's type (the environment's strings are parsed already)."""
    kind = type(default)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise DaemonConfigError(key, f"expected true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise DaemonConfigError(key, f"expected an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise DaemonConfigError(key, f"expected a number, got {value!r}")
        return float(value)
    if isinstance(default, tuple):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise DaemonConfigError(key, f"expected a list of strings, got {value!r}")
        return tuple(value)
    if isinstance(default, Path):
        if not isinstance(value, str | Path) or not str(value):
            raise DaemonConfigError(key, f"expected a path, got {value!r}")
        return Path(value).expanduser()
    if not isinstance(value, str):
        raise DaemonConfigError(key, f"expected a string, got {value!r}")
    assert kind is str
    return value


def _check_drivers(c: DaemonConfig) -> None:
    builtin = " or ".join(BUILTIN_DRIVERS)
    names = []
    for i, entry in enumerate(c.replica_drivers):
        key, shown = ("drivers", f"drivers[{i}]") if c.drivers else ("driver", "driver")
        try:
            driver = c.driver_of(entry)
        except DriverEntryError as exc:
            raise DaemonConfigError(key, f"{shown}: {exc}") from None
        if driver not in BUILTIN_DRIVERS and not driver.startswith(("unix:", "tcp:")):
            raise DaemonConfigError(
                key,
                f"{shown}: use {builtin} (its own arguments may follow), unix:PATH or tcp:HOST:PORT; got {entry!r}",
            )
        if driver not in BUILTIN_DRIVERS and driver in names:
            raise DaemonConfigError(key, f"{shown}: {driver!r} is listed twice (one replica per driver)")
        names.append(driver)
    if c.model and "torch" not in names:
        shown = ", ".join(c.replica_drivers)
        raise DaemonConfigError("model", f"only the torch driver loads a model (drivers: {shown})")


def _check(c: DaemonConfig) -> None:
    if not 0 <= c.port <= 65535:
        raise DaemonConfigError("port", f"must be between 0 and 65535, got {c.port}")
    if not c.host:
        raise DaemonConfigError("host", "must not be empty")
    if any(not k or k != k.strip() for k in c.api_keys):
        raise DaemonConfigError("api_keys", "keys must be non-empty and have no surrounding whitespace")
    _check_drivers(c)
    minimums: dict[str, float] = {
        "speculation_depth": 0,
        "max_decode_steps": 1,
        "multi_step_budget_ms": 0,
        "prefix_match_unit": 0,
        "max_concurrent_runs": 1,
        "key_max_concurrent_runs": 1,
        "key_reserve_run_slots": 0,
        "key_guest_threads": 0,
        "key_host_pacing": 0,
        "run_max_contexts": 1,
        "run_memory_mib": 20,  # the interpreter needs about 12 MiB, the tables take 4 (SandboxConfig)
        "run_max_output_mib": 1,
        "run_max_inbound_mib": 1,
        "run_max_tables": 1,
        "run_max_table_slots": 1,
        "run_max_instances": 1,
        "run_max_log_kib": 1,
        "run_max_grammars": 1,
        "run_max_grammar_mib": 1,
        "run_max_matchers": 1,
        "run_max_matcher_tokens": 1,
        "completions_max_prompts": 1,
        "completions_max_choices": 1,
        "max_loaded_adapters": 1,
        "max_loaded_component_mib": 1,
        "component_compile_mib": 64,
        "max_upload_bytes": 1,
        "max_request_bytes": 1024,
        "drain_timeout_s": 0,
        "grammar_compile_budget_s": 0,
        "grammar_max_mib": 0.001,
        "grammar_cache_mib": 1,
        "restart_backoff_initial_s": 0.01,
        "max_kept_runs": 1,
        "key_max_kept_runs": 1,
        "max_kept_run_mib": 1,
        "key_max_kept_run_mib": 1,
        "key_max_uploads": 1,
        "key_max_upload_bytes": 1,
    }
    for key, minimum in minimums.items():
        if getattr(c, key) < minimum:
            raise DaemonConfigError(key, f"must be at least {minimum:g}, got {getattr(c, key)}")
    if c.max_decode_steps > MAX_DECODE_STEPS:
        raise DaemonConfigError("max_decode_steps", f"must be at most {MAX_DECODE_STEPS}, got {c.max_decode_steps}")
    for key in ("run_max_pages_fraction", "key_max_pages_fraction"):
        if not 0 < getattr(c, key) <= 1:
            raise DaemonConfigError(key, f"must be in (0, 1], got {getattr(c, key)}")
    if not 0 <= c.key_reserve_pages_fraction < 1:
        raise DaemonConfigError("key_reserve_pages_fraction", f"must be in [0, 1), got {c.key_reserve_pages_fraction}")
    for key in ("run_timeout_s", "run_watchdog_s", "driver_startup_timeout_s"):
        if getattr(c, key) <= 0:
            raise DaemonConfigError(key, f"must be positive, got {getattr(c, key)}")
    if c.restart_backoff_max_s < c.restart_backoff_initial_s:
        raise DaemonConfigError("restart_backoff_max_s", "must be at least restart_backoff_initial_s")
    if c.log_level not in LOG_LEVELS:
        raise DaemonConfigError("log_level", f"use one of {', '.join(LOG_LEVELS)}; got {c.log_level!r}")
    if c.log_format not in LOG_FORMATS:
        raise DaemonConfigError("log_format", f"use one of {', '.join(LOG_FORMATS)}; got {c.log_format!r}")
    if c.completions_max_choices < c.completions_max_prompts:
        raise DaemonConfigError("completions_max_choices", "must be at least completions_max_prompts")
    try:
        c.sandbox_config()
    except ValueError as exc:  # the tables' share of run_memory_mib leaves too little memory
        raise DaemonConfigError("run_memory_mib", str(exc)) from None
