"""`wafer serve` / `python -m host.daemon`: flags registered, configuration errors reported with
the key and exit status 2, before anything starts."""

from __future__ import annotations

import argparse
import subprocess
import sys

from host.daemon.cli import add_serve_command


def test_add_serve_command() -> None:
    parser = argparse.ArgumentParser(prog="wafer")
    add_serve_command(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["serve", "--port", "9000", "--api-key", "a", "--api-key", "b", "--driver-arg=--num-pages"])
    assert ns.cfg_port == 9000 and ns.cfg_api_keys == ["a", "b"] and ns.cfg_driver_args == ["--num-pages"]
    assert callable(ns.func)
    ns = parser.parse_args(["serve", "--driver", "dummy", "--driver", "tcp:10.0.0.2:7000"])
    assert ns.cfg_drivers == ["dummy", "tcp:10.0.0.2:7000"]


def test_bad_configuration_exits_with_a_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "host.daemon", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "'port'" in proc.stderr and "65535" in proc.stderr


def test_a_bad_replica_driver_exits_with_a_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "host.daemon", "--driver", "dummy", "--driver", "gpu"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "'drivers'" in proc.stderr and "drivers[1]" in proc.stderr and "'gpu'" in proc.stderr
