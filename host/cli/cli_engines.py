"""The engines `wafer run` and `wafer dev` start from their options: one per `--driver`
(replicas when it is repeated), on a kept driver (`wafer driver start`) where one is running.
Imported only by commands that run inferlets (the bridge and anyio; `wafer build` needs neither)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from bridge_schema.transport import DRIVER_BUSY
from host.cli import kept_drivers
from host.driver_link import BUILTIN_DRIVERS
from host.driver_process import split_driver
from host.engine import Engine, EngineConfig, ReplicatedEngine
from host.errors import DriverFailed


def engine_configs(ns: argparse.Namespace, say: Callable[[str], None]) -> list[EngineConfig]:
    """One engine configuration per `--driver` (replicas when it is given more than once)."""
    model = getattr(ns, "model", "")
    entries = [split_driver(entry, BUILTIN_DRIVERS) for entry in ns.driver or ["torch" if model else "dummy"]]
    if model and all(driver != "torch" for driver, _ in entries):
        raise ValueError(f"--model {model!r}: only the torch driver loads a model (--driver torch)")
    return [
        EngineConfig(
            driver=_kept_or_fresh(ns, driver, say) if len(entries) == 1 and not own else driver,
            driver_args=(*(("--model", model) if model and driver == "torch" else ()), *ns.driver_arg, *own),
            speculation_depth=ns.speculation_depth,
            max_decode_steps=ns.max_decode_steps,
            multi_step_budget_ms=ns.multi_step_budget_ms,
            adapter_dir=ns.adapter_dir,
            progress=say,
        )
        for driver, own in entries
    ]


def fresh_configs(ns: argparse.Namespace, configs: list[EngineConfig]) -> list[EngineConfig | None]:
    """For each of `configs` that names a kept driver, the configuration of a fresh one of the same
    built-in driver (what `wafer dev` starts if the kept one is lost); None for the others."""
    fresh = engine_configs(argparse.Namespace(**{**vars(ns), "kept": False}), lambda _: None)
    return [f if f.driver != c.driver else None for c, f in zip(configs, fresh, strict=True)]


def start_engine(ns: argparse.Namespace, say: Callable[[str], None]) -> Engine | ReplicatedEngine:
    """One engine on `--driver`, or replicas when it is given more than once (fresh drivers)."""
    configs = engine_configs(ns, say)
    try:
        return Engine.start(configs[0]) if len(configs) == 1 else ReplicatedEngine.start(configs)
    except DriverFailed as exc:
        if exc.code == DRIVER_BUSY and any(fresh is not None for fresh in fresh_configs(ns, configs)):
            hint = "`--fresh-driver` starts a driver for this run alone"
            raise DriverFailed(f"{exc}; {hint}", exc.status, exc.code) from None
        raise


def _kept_or_fresh(ns: argparse.Namespace, driver: str, say: Callable[[str], None]) -> str:
    """The driver to use: a kept one (`wafer driver start NAME`) if there is one, else `driver`."""
    if driver not in BUILTIN_DRIVERS or not ns.kept:
        return str(driver)
    kept = kept_drivers.find(ns.cache_dir, driver)
    if kept is None:
        if driver == "torch":
            say(
                "starting the torch driver for this run (it loads the model first); "
                "`wafer driver start torch` keeps one running for later runs"
            )
        return str(driver)
    model = getattr(ns, "model", "")
    if model and _model_of(kept.args) != model:
        say(f"the kept {driver} driver serves {_model_of(kept.args)!r}: starting one for {model!r} for this run")
        return str(driver)
    say(f"using the kept {driver} driver (pid {kept.pid}; `wafer driver stop {driver}` ends it)")
    if ns.driver_arg and list(ns.driver_arg) != list(kept.args):
        say(f"--driver-arg is ignored: the kept driver runs with {list(kept.args)} (--fresh-driver to use yours)")
    return kept.address


def _model_of(args: tuple[str, ...] | list[str]) -> str:
    """The model a driver's arguments name (its last `--model`), or smollm2, the default."""
    found = "smollm2"
    for i, arg in enumerate(args):
        if arg == "--model" and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith("--model="):
            found = arg.removeprefix("--model=")
    return found
