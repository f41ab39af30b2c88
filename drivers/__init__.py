"""Drivers execute the host's passes: `dummy` (no compute, for tests) and `torch` (real models).
They import `bridge_schema`, never `host`; only `drivers.torch` imports torch or triton."""
