"""The engine: pages, scheduling and the driver link behind `host.services.Services`.

- `config`: `EngineConfig`, what an engine is started with;
- `core`: `EngineCore`, every piece of engine state and the verbs that change it (thread-free);
- `contexts`: `Contexts`, the one owner of a context's lifecycle;
- `chain`: host-side generation on the core's verbs;
- `loop`: the loop thread that opens the link and drives the core;
- `facade`: `Engine`, the thread-facing side the run threads call;
- `replicas`: `ReplicatedEngine`, several engines (one per driver) behind the same calls, with
  `placement` (where a run goes) and `replica_rules` (what replicas must agree on).

See docs/engine.md.
"""

from host.engine.config import EngineConfig, GrammarBudget
from host.engine.facade import Engine
from host.engine.replicas import ReplicatedEngine

__all__ = ["Engine", "EngineConfig", "GrammarBudget", "ReplicatedEngine"]
