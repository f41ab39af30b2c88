"""wafer's pytest plugin, registered by the distribution (entry point `pytest11`): the
`inferlet_runner` fixture, a `host.testing.InferletRunner` on the dummy driver for one test.

    @pytest.mark.dummy(say="42", page_size=4)          # the dummy driver's knobs, optional
    def test_answer(inferlet_runner):
        result = inferlet_runner.run("my_inferlet", "--question", "6*7")
        assert result.ok and result.output == "42" and result.pages_held == 0
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from host.testing import InferletRunner


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "dummy(**knobs): InferletRunner's knobs for the inferlet_runner fixture "
        "(say, logits, vocab_size, page_size, num_pages, seed, speculation_depth, memory_mib, timeout_s, host_limits)",
    )


@pytest.fixture
def inferlet_runner(request: pytest.FixtureRequest) -> Iterator[InferletRunner]:
    """An InferletRunner for this test, closed after it; `@pytest.mark.dummy(...)` sets its knobs."""
    from host.testing import InferletRunner  # here: pytest starts without loading the host

    marker = request.node.get_closest_marker("dummy")
    with InferletRunner(**(marker.kwargs if marker else {})) as runner:
        yield runner
