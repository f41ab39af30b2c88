"""The wafer host: sandbox, inferlet API, scheduler, speculator, pages, daemon and CLI.
Imports `bridge_schema`, never `drivers`."""
