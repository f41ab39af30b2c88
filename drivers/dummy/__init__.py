"""The dummy driver: no compute, real validation. See `drivers.dummy.driver`."""

from drivers.dummy.driver import DummyConfig, DummyDriver

__all__ = ["DummyConfig", "DummyDriver"]
