"""The console: a page at `/dashboard` (static HTML, JS and CSS shipped in this package, no
build step) that polls `/dashboard/state` for live runs, engine rates and replicas, and starts
and follows runs through the run API."""

from host.daemon.console.routes import OPEN_PATHS, STATE_PATH, router

__all__ = ["OPEN_PATHS", "STATE_PATH", "router"]
