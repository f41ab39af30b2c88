"""A dummy driver that skips the driver-side prefix rule, so tests can reach the host's own
check after the handshake (loaded by module name through loopback)."""

from __future__ import annotations

from bridge_schema.messages import Handshake, Hello
from drivers.dummy import DummyDriver
from drivers.dummy import create_driver as create_dummy


class LaxDriver(DummyDriver):
    def handshake(self, hello: Hello) -> Handshake:
        return super().handshake(Hello(page_size=hello.page_size, num_pages=hello.num_pages))


def create_driver(argv: list[str]) -> LaxDriver:
    return LaxDriver(create_dummy(argv).config)
