"""Errors the engine raises to the inferlet API (through `host.services.Services`).

    HostError                   root of everything the engine raises
    ├── InvalidRequest          a call's arguments are wrong (bad token id, length, row, position)
    ├── ContextError            a context handle cannot be used
    │   ├── ContextNotFound     no live context has this id (never created, or released)
    │   ├── ContextNotOwned     the context belongs to another run
    │   └── ContextLimitExceeded the run holds as many contexts as a run may
    ├── OutOfPages              the KV page pool cannot hold what was asked; nothing was allocated
    │   └── PageQuotaExceeded   the run would hold more pages than its quota; nothing was allocated
    ├── DriverFailed            the driver answered a pass with an error, or the link to it broke
    ├── RunEnded                the run ended (or released the context) while its pass waited
    ├── FeatureUnavailable      the feature needs an optional dependency that is not installed
    └── EngineClosed            the engine is shut down (or shutting down) and takes no more work

Each message says what happened and, where it can, what to do about it.
"""

from __future__ import annotations


class HostError(Exception):
    """Root of every error the engine raises."""


class InvalidRequest(HostError):
    """A call's arguments are invalid; the engine state is unchanged."""


class ContextError(HostError):
    """A context handle that cannot be used by this run."""


class ContextNotFound(ContextError):
    def __init__(self, context_id: int) -> None:
        super().__init__(f"context {context_id} does not exist (never created, or already released)")
        self.context_id = context_id


class ContextNotOwned(ContextError):
    def __init__(self, context_id: int, run_id: int) -> None:
        super().__init__(f"context {context_id} does not belong to run {run_id}")
        self.context_id = context_id
        self.run_id = run_id


class ContextLimitExceeded(ContextError):
    def __init__(self, run_id: int, limit: int) -> None:
        super().__init__(
            f"run {run_id} holds {limit} contexts, the most a run may (run_max_contexts): release contexts "
            "before creating or forking more"
        )
        self.run_id, self.limit = run_id, limit


class OutOfPages(HostError):
    """Raised at once (never waits for pages to free up, so it cannot deadlock)."""

    def __init__(self, num_needed: int, num_free: int, num_total: int, page_size: int) -> None:
        super().__init__(
            f"out of KV pages: need {num_needed} more page(s) of {page_size} tokens, "
            f"{num_free} of {num_total} free; release or truncate contexts, or start the "
            f"driver with more pages"
        )
        self.num_needed = num_needed
        self.num_free = num_free
        self.num_total = num_total


class DriverFailed(HostError):
    """`status` and `code` come from the driver's `ErrorReply` when there was one."""

    def __init__(self, message: str, status: int = 0, code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class FeatureUnavailable(HostError):
    """The feature needs an optional dependency (an extra of the `wafer` package) that this
    installation lacks; the message names the extra to install."""


class RunEnded(HostError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)


class EngineClosed(HostError):
    def __init__(self, reason: str = "the engine is closed") -> None:
        super().__init__(reason)


class PageQuotaExceeded(OutOfPages):
    """A pass would take its run past the run's share of the page pool."""

    def __init__(self, holder: str, held: int, needed: int, quota: int, setting: str, limit: str = "") -> None:
        limit = limit or f"the quota of {quota} (the daemon's {setting} of the pool)"
        HostError.__init__(
            self,
            f"{holder} hold{'s' if holder.startswith('run ') else ''} {held} KV pages and this pass needs {needed} "
            f"more, past {limit}: release or truncate contexts first",
        )
        self.held, self.needed, self.quota = held, needed, quota
