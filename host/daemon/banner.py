"""What `wafer serve` prints for people once the driver is ready: the URL and a curl and an
`openai` example that work against this daemon as configured."""

from __future__ import annotations

import json
import sys
import threading

from host.daemon.daemon import Daemon
from host.daemon.errors import DaemonError


def banner(url: str, model: str, has_keys: bool) -> str:
    # Keys are never printed: terminals and log collectors keep what they see.
    auth = ' -H "Authorization: Bearer $KEY"' if has_keys else ""
    api_key = "os.environ['KEY']" if has_keys else "'none'"
    note = "  (KEY: one of your api_keys)\n" if has_keys else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    return (
        f"\nwafer is serving {model} at {url}\n{note}\n"
        f"  curl -s {url}/v1/chat/completions{auth} -H 'content-type: application/json' \\\n"
        f"    -d '{body}'\n\n"
        f"  python -c \"import os; from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key={api_key}); "
        f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello!'}}])"
        f'.choices[0].message.content)"\n\n'
        f"  health: {url}/health   metrics: {url}/metrics   API document: {url}/docs\n"
    )


def announce_when_ready(daemon: Daemon, url: str) -> None:
    """In the background: print the banner to stderr once the driver has said its model name."""

    def wait_and_print() -> None:
        try:
            model = daemon.served_model_waiting(daemon.config.driver_startup_timeout_s)
        except DaemonError as exc:
            if daemon.supervisor.is_stopping:
                return  # shut down before the driver was ready: nothing to announce
            print(f"wafer serve: {exc}", file=sys.stderr, flush=True)
            return
        print(banner(url, model, bool(daemon.config.api_keys)), file=sys.stderr, flush=True)

    threading.Thread(target=wait_and_print, name="wafer-banner", daemon=True).start()
