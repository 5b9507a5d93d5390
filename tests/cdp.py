"""Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: no port, no websocket
library), for tests that open pages in a real browser: navigate, run a script in the page, take a screenshot, and
record every console message, uncaught exception and network request the page makes.

Debian's ``chromium`` package; :func:`ensure_chromium` installs it with apt-get when it is missing and this process
may (root), else says why it cannot. Flags as NOTES-platform.md gives them: without the background-networking flags
Chromium itself (not the page) contacts Google's hosts at start.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--window-size=1280,900"]  # fmt: skip


def ensure_chromium() -> tuple[str | None, str]:
    """``(path of chromium, "")``, installing Debian's package when it is missing and we are root; ``(None, why)``
    when it is not there and cannot be installed here."""
    found = shutil.which("chromium")
    if found:
        return found, ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "chromium is not installed and this user cannot install it (apt-get install chromium as root)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            return None, f"{' '.join(cmd)} failed: {proc.stderr.strip()[-300:]}"
    found = shutil.which("chromium")
    return (found, "") if found else (None, "apt-get installed chromium but it is not on PATH")


@dataclass
class PageLog:
    """What one page did: console messages of level error, uncaught exceptions, the URLs it requested."""

    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)


class Chromium:
    """One headless Chromium with one page (tab), driven over ``--remote-debugging-pipe``."""

    def __init__(self, executable: str, profile: Path) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def fds() -> None:  # the protocol: Chromium reads commands on fd 3, writes answers on fd 4
            read, write = os.dup(to_chrome_r), os.dup(from_chrome_w)  # above 4: no dup2 below overwrites them
            os.dup2(read, 3)
            os.dup2(write, 4)

        self.proc = subprocess.Popen(
            [executable, *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"],
            pass_fds=(3, 4), preexec_fn=fds, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer, self._next_id, self.log = b"", 0, PageLog()
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)

    def close(self) -> None:
        """End the browser (its pipes close with it)."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._to_chrome)
        os.close(self._from_chrome)

    def _message(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from chromium")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def _event(self, message: dict) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.log.errors.append(
                "console: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            )
        elif method == "Runtime.exceptionThrown":
            self.log.errors.append("exception: " + params["exceptionDetails"].get("text", ""))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.log.errors.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
        elif method == "Network.requestWillBeSent":
            self.log.requests.append(params["request"]["url"])

    def call(self, method: str, params: dict | None = None, session: bool = False, timeout: float = 30) -> dict:
        """Send one command (to the page's session when ``session``) and return its result; events that arrive
        meanwhile are recorded in :attr:`log`."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        while True:
            answer = self._message(timeout)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self._event(answer)

    def evaluate(self, expression: str) -> object:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, session=True)  # fmt: skip
        return result["result"].get("value")

    def open(self, url: str, timeout: float = 30) -> None:
        """Navigate to ``url`` and wait until the page has loaded (document complete)."""
        self.call("Page.navigate", {"url": url}, session=True)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'", timeout)

    def wait_for(self, condition: str, timeout: float = 20) -> bool:
        """Poll a JavaScript condition until it holds; False when ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.evaluate(f"Boolean({condition})"):
                    return True
            except RuntimeError as err:  # the page is navigating: its context is gone until the next one exists
                if "navigated" not in str(err) and "context" not in str(err).lower():
                    raise
            time.sleep(0.1)
        return False

    def screenshot(self, path: Path) -> Path:
        """A PNG of the viewport."""
        data = self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path
