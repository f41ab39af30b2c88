"""The engine: pages, scheduling and the driver link behind `host.services.Services`.

- `config`: `EngineConfig`, what an engine is started with;
- `core`: `EngineCore`, every piece of engine state and the verbs that change it (thread-free);
- `contexts`: `Contexts`, the one owner of a context's lifecycle;
- `chain`: host-side generation on the core's verbs;
- `loop`: the loop thread that opens the link and drives the core;
- `facade`: `Engine`, the thread-facing side the run threads call.

See docs/engine.md.
"""

from host.engine.config import EngineConfig, GrammarBudget
from host.engine.facade import Engine

__all__ = ["Engine", "EngineConfig", "GrammarBudget"]
