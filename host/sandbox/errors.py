"""Errors of the sandbox.

    SandboxError
    ├── ComponentLoadError   the file is missing or is not a loadable component
    ├── RunStartError        a run could not be instantiated (limits, missing imports)
    └── InboxFull            a client message would take a run's waiting messages past their limit

A run that fails *inside* the guest is not an exception: it ends with a `RunOutcome` whose
status says why (trap, timeout, guest error, cancelled).
"""

from __future__ import annotations


class SandboxError(Exception):
    """Root of the sandbox's errors."""


class ComponentLoadError(SandboxError):
    """The component could not be read, compiled or deserialized."""


class RunStartError(SandboxError):
    """The run could not be instantiated."""


class InboxFull(SandboxError):
    """A client message was refused: the run has not received enough of the earlier ones."""
