"""Errors of the daemon, and the one place their wire form (the OpenAI error envelope) is drawn.

DaemonError                  root of everything the daemon raises
├── DaemonConfigError        the configuration (file, environment, flags) is invalid
└── ApiError                 an HTTP request fails; carries status, type, param and code
    ├── BadRequest           400: bad types, ranges, unsupported or inconsistent fields
    ├── Unauthorized         401: no or a wrong API key
    ├── Forbidden            403: the endpoint is disabled by the configuration
    ├── NotFound             404: unknown model, inferlet or run
    ├── PayloadTooLarge      413: the body exceeds the configured limit
    ├── RunInboxFull         413: a run's waiting messages would pass run_max_inbound_mib
    ├── TooManyRuns          429: every run slot is taken
    ├── PagesExhausted       503: every KV page is held by running runs
    ├── DriverUnavailable    503: the driver is down or restarting
    └── GenerationFailed     502: the run failed for a reason that is not the client's
"""

from __future__ import annotations

from typing import Any


class DaemonError(Exception):
    """Root of every error the daemon raises."""


class DaemonConfigError(DaemonError):
    """`key` names the configuration key at fault (as written in the TOML file)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"configuration key {key!r}: {message}")
        self.key = key


class ApiError(DaemonError):
    status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def envelope(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class BadRequest(ApiError):
    status = 400
    error_type = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    error_type = "invalid_request_error"

    def __init__(self, message: str = "missing or invalid API key: send 'Authorization: Bearer <key>'") -> None:
        super().__init__(message, code="invalid_api_key")


class Forbidden(ApiError):
    status = 403
    error_type = "permission_error"


class NotFound(ApiError):
    status = 404
    error_type = "invalid_request_error"


class PayloadTooLarge(ApiError):
    status = 413
    error_type = "invalid_request_error"

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(f"request body exceeds the limit of {limit_bytes} bytes", code="request_too_large")


class RunInboxFull(ApiError):
    """A message to a run that has not received enough of the earlier ones."""

    status = 413
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="message", code="inbox_full")


class TooManyRuns(ApiError):
    status = 429
    error_type = "rate_limit_error"

    def __init__(self, limit: int, setting: str = "") -> None:
        if setting == "key_max_concurrent_runs":
            message = f"this API key has {limit} runs running, the most one key may ({setting}); retry when one ends"
        elif setting:
            message = f"{limit} run slots are busy and the rest are kept for other API keys ({setting}); retry later"
        else:
            message = f"all {limit} run slots are busy; retry later"
        super().__init__(message, code="too_many_runs")


class PagesExhausted(ApiError):
    """Every KV page is held by running runs: a new run could not even start generating."""

    status = 503
    error_type = "server_error"

    def __init__(self, num_pages: int) -> None:
        super().__init__(
            f"all {num_pages} KV pages are held by running runs; retry when they finish", code="kv_pages_exhausted"
        )


class DriverUnavailable(ApiError):
    status = 503
    error_type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="driver_unavailable")


class GenerationFailed(ApiError):
    status = 502
    error_type = "server_error"

    def __init__(self, message: str, code: str = "generation_failed") -> None:
        super().__init__(message, code=code)
