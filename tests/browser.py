"""Headless Chromium for tests that look at rendered pages (the Prefect UI, report.html).

Driven over the Chrome DevTools Protocol with `websockets` (a Prefect dependency), at a
1280 x 1000 window. Tests that use it skip where no Chromium or Chrome is installed.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from pipeline.stages.teacher.ddp import stop_group  # noqa: F401 (tests import it from here)

BROWSER = next(
    (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable") if shutil.which(b)),
    None,
)


class Chromium:
    """Headless Chromium driven over the DevTools Protocol: navigate, read text, click, screenshot."""

    def __init__(self, binary: str):
        self.profile = Path(tempfile.mkdtemp(prefix="dashboard-chromium-"))
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage", "--no-first-run",
             "--remote-debugging-port=0", f"--user-data-dir={self.profile}", "--window-size=1280,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self._id = 0
        try:
            self.ws = self._connect()
        except BaseException:
            self.close()
            raise

    def _connect(self):
        from websockets.sync.client import connect

        port_file = self.profile / "DevToolsActivePort"  # Chromium writes its chosen port here
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert self.proc.poll() is None, f"{self.proc.args[0]} exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, "Chromium did not open its DevTools port within 30 s"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        return connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10)

    def call(self, method: str, **params):
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:  # skip events until our answer arrives
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        return self.js("document.body ? document.body.innerText : ''") or ""

    def wait_for(self, *strings: str, timeout: float = 60) -> str:
        """The page's visible text once every string appears in it."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            missing = [s for s in strings if s not in text]
            if not missing:
                return text
            # The page text may hold run logs: name only what is missing, never quote the page.
            assert time.monotonic() < deadline, f"{self.js('location.href')} did not render {missing} in {timeout} s"
            time.sleep(0.5)

    def click_tab(self, label: str) -> None:
        clicked = self.js(
            f"(() => {{ const t = [...document.querySelectorAll('.p-tab')].find(e => e.innerText.trim() === {label!r});"
            " if (t) t.click(); return !!t; })()"
        )
        assert clicked, f"no tab {label!r} on {self.js('location.href')}"

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        stop_group(self.proc)
        shutil.rmtree(self.profile, ignore_errors=True)
