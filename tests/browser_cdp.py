"""Drive headless Chromium over the DevTools protocol, with no browser-automation dependency.

The browser test needs five things from a real browser: open a URL, run
JavaScript and read the result, wait until a condition on the page holds,
type text, and take screenshots at desktop and phone sizes. Chromium offers
all of them over its DevTools protocol (CDP), a JSON-RPC over a WebSocket, so
this module speaks it directly with the ``websockets`` package the project
already depends on:

* :func:`find_chromium` says where the browser is, or ``None``;
* :func:`launch` starts it headless in a fresh profile and yields a
  :class:`Page` (one tab), killing the browser and deleting the profile on exit;
* :class:`Page` sends commands (``call``) and offers the few conveniences the
  test reads naturally with (``navigate``, ``evaluate``, ``wait_for``,
  ``insert_text``, ``set_viewport``, ``screenshot``).

Events Chromium sends are read between answers; all are dropped except
uncaught page exceptions and console errors, which :attr:`Page.errors`
collects so a test can say the page ran cleanly. Every wait is a poll of
``Runtime.evaluate``, which keeps the client a plain request/answer loop.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import logging
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

from websockets.sync.client import ClientConnection, connect

logger = logging.getLogger(__name__)

CHROMIUM_CANDIDATES: Final = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")
"""Where to look for the browser, first match wins (Debian's ``chromium`` package first)."""
CHROMIUM_FLAGS: Final = (
    "--headless",
    "--no-sandbox",                       # containers run as root without user namespaces
    "--disable-gpu",
    "--disable-quic",
    "--disable-dev-shm-usage",            # a container's /dev/shm is often 64 MiB
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",    # nothing but the page under test touches the network
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
    "--mute-audio",
    "--remote-debugging-port=0",          # any free port; Chromium writes it to DevToolsActivePort
)
START_TIMEOUT_S: Final = 30.0
"""How long Chromium may take to open its DevTools port."""
CALL_TIMEOUT_S: Final = 30.0
"""Longest wait for the answer to one CDP command."""
POLL_INTERVAL_S: Final = 0.05
"""Pause between two evaluations of a :meth:`Page.wait_for` condition."""
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
"""Largest CDP message accepted (a full-page screenshot is the biggest)."""
STOP_TIMEOUT_S: Final = 10.0
MAX_KEPT_ERRORS: Final = 100
"""Most page errors :attr:`Page.errors` keeps (the first ones are the telling ones)."""

FRAMES_PAINTED: Final = "new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(() => done(true))))"
"""JS: a promise that resolves after two animation frames (one full layout and paint)."""

EventHandler = Callable[[dict[str, Any]], None]


class CdpError(RuntimeError):
    """A CDP command failed, a page script threw, or a wait ran out of time."""


def find_chromium() -> str | None:
    """The path of a Chromium binary on this machine, or ``None`` when there is none."""
    for candidate in CHROMIUM_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    return None


class Page:
    """One browser tab, attached through a flattened CDP session."""

    def __init__(self, ws: ClientConnection, session_id: str) -> None:
        self._ws = ws
        self._session_id = session_id
        self._ids = itertools.count(1)
        self.errors: list[str] = []
        """Uncaught exceptions and ``console.error`` messages of the page, in order."""

    def call(self, method: str, timeout_s: float = CALL_TIMEOUT_S, **params: Any) -> dict[str, Any]:
        """Send one CDP command to this tab and return its ``result``; raise :class:`CdpError` on error."""
        return _call(self._ws, next(self._ids), method, params, self._session_id, timeout_s, self._on_event)

    def _on_event(self, event: dict[str, Any]) -> None:
        """Keep the page's uncaught exceptions and console errors."""
        if len(self.errors) >= MAX_KEPT_ERRORS or event.get("sessionId") != self._session_id:
            return
        params = event.get("params", {})
        if event.get("method") == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append(details.get("exception", {}).get("description") or details.get("text", "exception"))
        elif event.get("method") == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.errors.append(" ".join(str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", [])))

    def navigate(self, url: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Open ``url`` and wait until its document has loaded."""
        answer = self.call("Page.navigate", url=url)
        if answer.get("errorText"):
            raise CdpError(f"navigating to {url} failed: {answer['errorText']}")
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'",
                      timeout_s, what=f"{url} to load")

    def evaluate(self, expression: str, *, await_promise: bool = False) -> Any:
        """Run ``expression`` in the page and return its value (JSON-serialisable values only)."""
        answer = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=await_promise)
        if "exceptionDetails" in answer:
            details = answer["exceptionDetails"]
            message = details.get("exception", {}).get("description") or details.get("text", "error")
            raise CdpError(f"page script failed: {message}\n  in: {expression[:200]}")
        return answer.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout_s: float, *, what: str) -> Any:
        """Evaluate ``expression`` until it is truthy and return that value.

        On timeout the error says ``what`` was awaited and shows the page's
        visible text, which is usually the fastest way to see why.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                text = self.evaluate("document.body ? document.body.innerText : ''") or ""
                raise CdpError(f"timed out after {timeout_s:.0f} s waiting for {what}; the page shows:\n{text[:3000]}")
            time.sleep(POLL_INTERVAL_S)

    def insert_text(self, text: str) -> None:
        """Type ``text`` into the focused element, as an input method would (fires ``input`` events)."""
        self.call("Input.insertText", text=text)

    def set_viewport(self, width: int, height: int, *, mobile: bool = False, scale: float = 1.0) -> None:
        """Emulate a screen of ``width`` × ``height`` CSS pixels (a phone when ``mobile``)."""
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=scale, mobile=mobile)
        self.call("Emulation.setTouchEmulationEnabled", enabled=mobile)
        self.settle()

    def settle(self) -> None:
        """Wait until the page has painted twice, so layout and paint have caught up with changes."""
        self.evaluate(FRAMES_PAINTED, await_promise=True)

    def screenshot(self, path: Path, *, full_page: bool = True) -> Path:
        """Save a PNG of the page (the whole scrollable page when ``full_page``) to ``path``."""
        self.settle()
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            metrics = self.call("Page.getLayoutMetrics")
            size = metrics.get("cssContentSize") or metrics["contentSize"]
            viewport = metrics.get("cssLayoutViewport") or metrics["layoutViewport"]
            params["captureBeyondViewport"] = True
            params["clip"] = {"x": 0, "y": 0, "scale": 1,
                              "width": max(size["width"], viewport["clientWidth"]),
                              "height": max(size["height"], viewport["clientHeight"])}
        data = self.call("Page.captureScreenshot", **params)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        logger.info("screenshot saved: %s", path)
        return path


def _call(ws: ClientConnection, call_id: int, method: str, params: dict[str, Any],
          session_id: str | None, timeout_s: float, on_event: EventHandler | None = None) -> dict[str, Any]:
    """Send a command and read messages until its answer arrives; events go to ``on_event``."""
    message: dict[str, Any] = {"id": call_id, "method": method, "params": params}
    if session_id:
        message["sessionId"] = session_id
    ws.send(json.dumps(message))
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CdpError(f"no answer to {method} within {timeout_s:.0f} s")
        try:
            raw = ws.recv(timeout=remaining)
        except TimeoutError:
            continue
        answer = json.loads(raw)
        if "method" in answer:
            if on_event is not None:
                on_event(answer)
            continue
        if answer.get("id") != call_id or answer.get("sessionId") != session_id:
            continue
        if "error" in answer:
            raise CdpError(f"{method} failed: {answer['error'].get('message')} {answer['error'].get('data', '')}")
        result: dict[str, Any] = answer.get("result", {})
        return result


def _devtools_url(profile: Path, proc: subprocess.Popen[bytes], log_path: Path) -> str:
    """Wait for Chromium to write ``DevToolsActivePort`` and return its browser WebSocket URL."""
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CdpError(f"chromium exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(OSError):
            lines = port_file.read_text().split()
            if len(lines) >= 2:
                return f"ws://127.0.0.1:{int(lines[0])}{lines[1]}"
        time.sleep(POLL_INTERVAL_S)
    raise CdpError(f"chromium did not open its DevTools port within {START_TIMEOUT_S:.0f} s:\n"
                   f"{log_path.read_text(errors='replace')[-3000:]}")


@contextlib.contextmanager
def launch(binary: str | None = None, *, width: int = 1280, height: int = 900) -> Iterator[Page]:
    """Start headless Chromium in a fresh profile and yield one blank tab of ``width`` × ``height``.

    The browser is killed and its profile deleted on exit, whatever happened.
    """
    binary = binary or find_chromium()
    if binary is None:
        raise CdpError("no chromium binary found (looked for: " + ", ".join(CHROMIUM_CANDIDATES) + ")")
    profile = Path(tempfile.mkdtemp(prefix="meshnet-chromium-"))
    log_path = profile.parent / f"{profile.name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                 f"--window-size={width},{height}", "about:blank"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        url = _devtools_url(profile, proc, log_path)
        with connect(url, max_size=MAX_MESSAGE_BYTES, open_timeout=START_TIMEOUT_S) as ws:
            ids = itertools.count(1_000_000)   # browser-level ids, apart from any tab's
            target = _call(ws, next(ids), "Target.createTarget", {"url": "about:blank"}, None, CALL_TIMEOUT_S)
            attached = _call(ws, next(ids), "Target.attachToTarget",
                             {"targetId": target["targetId"], "flatten": True}, None, CALL_TIMEOUT_S)
            page = Page(ws, attached["sessionId"])
            page.call("Page.enable")
            page.call("Runtime.enable")
            page.set_viewport(width, height)
            yield page
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
        shutil.rmtree(profile, ignore_errors=True)
        log_path.unlink(missing_ok=True)
