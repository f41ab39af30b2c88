"""The console in a real browser: Debian's chromium, headless, loads /dashboard from a daemon on
the dummy driver and dumps the DOM after its scripts ran. It shows a run started during the
test, fills in live values, updates them, and shows nothing of another key's runs. Skipped,
naming what is missing, where chromium is not installed (`.ci/run` installs it as root)."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from tests.host.daemon.conftest import API_KEY, OTHER_KEY, Server
from tests.host.daemon.sse import events
from tests.host.daemon.test_dashboard import echo_id, end, key_digest, roomy, start, state_of

__all__ = ["echo_id", "roomy"]  # module fixtures shared with the state endpoint's tests: a daemon of its own here

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed: `apt-get install -y chromium` (Debian; .ci/run does it when root)",
)
VIRTUAL_TIME_MS = 3500  # page time the browser runs before dumping: a few polls a second apart
BLANK = ("", "–")  # what an element shows before a value is filled in


class Dom(HTMLParser):
    """What a dumped page shows: each data-metric element's text, run rows, hidden elements."""

    VOID = frozenset(("meta", "link", "input", "br", "img", "hr"))

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, list[str]] = {}
        self.run_rows: dict[int, dict[str, str]] = {}
        self.hidden_ids: set[str] = set()
        self.texts: dict[str, str] = {}  # element id -> its text
        self._open: list[tuple[str, str | None, str | None, int | None]] = []
        self._text: list[list[str]] = []
        self._row: int | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id") and "hidden" in a:
            self.hidden_ids.add(str(a["id"]))
        if a.get("data-run-id"):
            self._row = int(str(a["data-run-id"]))
            self.run_rows[self._row] = {}
        if tag in self.VOID:
            return
        self._open.append((tag, a.get("data-metric"), a.get("id"), self._row))
        self._text.append([])

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID or not self._open:
            return
        _tag, metric, element_id, row = self._open.pop()
        text = "".join(self._text.pop()).strip()
        if self._text:
            self._text[-1].append(text)
        if metric is not None:
            self.metrics.setdefault(metric, []).append(text)
            if row is not None and metric.startswith("run."):
                self.run_rows[row][metric.removeprefix("run.")] = text
        if element_id is not None:
            self.texts[element_id] = text
        if tag == "tr":
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._text:
            self._text[-1].append(data)

    def filled(self) -> dict[str, str]:
        """The metrics filled in (their first element's text)."""
        return {name: texts[0] for name, texts in self.metrics.items() if texts and texts[0] not in BLANK}


def dump(srv: Server, fragment: str, profile: Path) -> Dom:
    assert CHROMIUM is not None
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={VIRTUAL_TIME_MS}",
        "--dump-dom",
        f"{srv.url}/dashboard{fragment}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = Dom()
    dom.feed(done.stdout)
    assert dom.metrics, f"no page in chromium's output: {done.stdout[:500]} {done.stderr[-1000:]}"
    return dom


@pytest.fixture
def decoding(roomy: Server, echo_id: str) -> Iterator[tuple[int, int]]:
    """A run of this key that decodes (passes flow) and a run of the other key."""
    mine = start(roomy, API_KEY, echo_id, "decode")
    theirs = start(roomy, OTHER_KEY, echo_id, "echo")
    try:
        with roomy.http() as http, http.stream("GET", f"/v1/runs/{mine}/events") as response:
            next(data for name, data in events(response) if name == "output")
        state_of(roomy)
        time.sleep(0.6)  # two readings apart: rates are there when the page first asks
        yield mine, theirs
    finally:
        end(roomy, API_KEY, mine)
        end(roomy, OTHER_KEY, theirs)


def test_the_console_shows_live_values_and_only_the_keys_runs(
    roomy: Server, decoding: tuple[int, int], tmp_path: Path
) -> None:
    mine, theirs = decoding
    first = dump(roomy, f"#key={API_KEY}", tmp_path / "a")
    assert mine in first.run_rows and theirs not in first.run_rows, first.run_rows
    row = first.run_rows[mine]
    assert row["state"] == "running" and row["kind"] == "inferlet" and row["key"] == key_digest(API_KEY)[:8]
    assert int(row["tokens"]) > 0 and int(row["pages"].split()[0]) >= 1
    filled = first.filled()
    live = {name for name in filled if not name.startswith(("run.", "replica.", "stream."))} - {"updates"}
    assert len(live) >= 6, filled
    assert filled["driver_state"] == "ready" and float(filled["passes_per_s"]) > 0, filled
    assert int(filled["updates"]) >= 2, filled  # polled more than once in one page life
    assert "key-form" in first.hidden_ids  # the key from the fragment was taken: no prompt
    assert key_digest(OTHER_KEY)[:8] not in str(first.metrics)
    second = dump(roomy, f"#key={API_KEY}", tmp_path / "b")
    assert second.run_rows[mine]["age"] != row["age"]  # the run's age moved on between the two
    assert second.filled()["updated_at"] != filled["updated_at"] or second.run_rows[mine] != row


def test_the_other_key_sees_its_run_and_not_this_ones(roomy: Server, decoding: tuple[int, int], tmp_path: Path) -> None:
    mine, theirs = decoding
    dom = dump(roomy, f"#key={OTHER_KEY}", tmp_path / "other")
    assert theirs in dom.run_rows and mine not in dom.run_rows, dom.run_rows
    assert {r["key"] for r in dom.run_rows.values()} == {key_digest(OTHER_KEY)[:8]}
    # Engine-wide rates are everyone's: this key sees the passes the first key's run causes.
    assert float(dom.filled()["passes_per_s"]) > 0


def test_without_a_key_the_page_shows_the_engine_and_no_runs(
    roomy: Server, decoding: tuple[int, int], tmp_path: Path
) -> None:
    """The bare URL (as `chromium --headless --dump-dom HOST/dashboard` opens it): live
    engine-wide values, no run of any key, and a button to give a key."""
    dom = dump(roomy, "", tmp_path / "nokey")
    assert not dom.run_rows, dom.run_rows
    filled = dom.filled()
    live = {name for name in filled if not name.startswith(("run.", "replica.", "stream."))} - {"updates"}
    assert len(live) >= 6 and float(filled["passes_per_s"]) > 0, filled
    assert dom.metrics["runs_running"][0] == "–" and "key-open" not in dom.hidden_ids
    assert key_digest(API_KEY)[:8] not in str(dom.metrics) and key_digest(OTHER_KEY)[:8] not in str(dom.metrics)


class Browser:
    """Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON
    messages ended by NUL on fds 3 and 4), for what a dumped DOM cannot show: clicks."""

    def __init__(self, profile: Path) -> None:
        assert CHROMIUM is not None
        to_browser, self._to = os.pipe()
        self._from, from_browser = os.pipe()
        # Chromium reads commands on fd 3 and writes replies on fd 4.
        launch = f'exec "$0" "$@" 3<&{to_browser} 4>&{from_browser}'
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}"]
        self._process = subprocess.Popen(
            ["bash", "-c", launch, CHROMIUM, *flags, "--remote-debugging-pipe", "about:blank"],
            pass_fds=(to_browser, from_browser),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._events: list[dict[str, Any]] = []
        self._next_id = 0

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout_s=10)
        except (AssertionError, OSError):
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._to)
        os.close(self._from)

    def call(self, method: str, params: dict[str, Any] | None = None, session: str = "", timeout_s: float = 60) -> Any:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                assert "error" not in reply, (method, reply["error"])
                return reply["result"]
            if "method" in reply:
                self._events.append(reply)

    def wait_event(self, method: str, timeout_s: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            for event in self._events:
                if event["method"] == method:
                    self._events.remove(event)
                    return event
            self._events.append(self._read(deadline))

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, "chromium did not answer in time"
            chunk = os.read(self._from, 1 << 16)
            assert chunk, "chromium closed its pipe"
            self._buffer += chunk
        frame, _, self._buffer = self._buffer.partition(b"\0")
        message: dict[str, Any] = json.loads(frame)
        return message

    def open(self, url: str) -> str:
        """A new tab at `url`, loaded; its session id."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = str(self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"])
        self.call("Page.enable", session=session)
        self.call("Page.navigate", {"url": url}, session=session)
        self.wait_event("Page.loadEventFired")
        return session

    def evaluate(self, session: str, expression: str, timeout_s: float = 60) -> Any:
        params = {"expression": expression, "awaitPromise": True, "returnByValue": True}
        result = self.call("Runtime.evaluate", params, session=session, timeout_s=timeout_s)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")


# Fills the start form, sends the run a message, closes its input and waits for its end: what a
# person does with the form, through the page's own handlers.
USE_THE_FORM = """
(async () => {
  const until = async (what, check) => {
    const end = Date.now() + 20000;
    while (!check()) {
      if (Date.now() > end) throw new Error("timed out waiting for " + what);
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
  };
  const byId = (id) => document.getElementById(id);
  const streamState = () => document.querySelector('[data-metric="stream.state"]').textContent;
  await until("the inferlet list", () => [...byId("inferlet").options].some((o) => o.value === INFERLET));
  byId("inferlet").value = INFERLET;
  byId("args").value = "echo";
  byId("run-form").requestSubmit();
  await until("the stream", () => streamState() === "running");
  byId("message-input").value = "hello from the console";
  byId("message-form").requestSubmit();
  await until("the echo", () => byId("run-output").textContent.includes("echo: hello from the console"));
  byId("close-inbox").click();
  await until("the end", () => streamState().startsWith("succeeded"));
  return {runId: byId("run-id").textContent, output: byId("run-output").textContent, state: streamState()};
})()
"""


def test_the_form_starts_a_run_and_follows_its_stream(roomy: Server, echo_id: str, tmp_path: Path) -> None:
    browser = Browser(tmp_path / "form")
    try:
        session = browser.open(f"{roomy.url}/dashboard#key={API_KEY}")
        seen = browser.evaluate(session, USE_THE_FORM.replace("INFERLET", json.dumps(echo_id)))
    finally:
        browser.close()
    assert seen["state"] == "succeeded" and "echo: hello from the console\n" in seen["output"], seen
    assert '[message] {"received": 1}' in seen["output"], seen
    with roomy.http() as http:
        run = http.get(f"/v1/runs/{seen['runId']}").json()
    assert run["inferlet"] == echo_id and run["state"] == "succeeded"  # a run of this key, started by the page
