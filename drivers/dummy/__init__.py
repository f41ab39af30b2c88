"""The dummy driver: no compute, real validation. See `drivers.dummy.driver`.

Every driver package exports `create_driver(argv)`: the driver its command line describes, for
hosts that serve it in-process with `drivers.serve.serve_loopback`.
"""

from drivers.dummy.cli import create_driver
from drivers.dummy.driver import DummyConfig, DummyDriver

__all__ = ["DummyConfig", "DummyDriver", "create_driver"]
