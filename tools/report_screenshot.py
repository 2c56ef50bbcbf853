"""Render a run report (`report.html`) in headless Chromium, save a PNG, and fail on any console error.

Drives Debian's `chromium` (`apt-get install -y chromium`) over the DevTools protocol on a pipe
(`--remote-debugging-pipe`: JSON messages separated by NUL on file descriptors 3 and 4, so no port and no
websocket library): opens the page with the flags a root, offline, GPU-less machine needs, waits until
plotly has drawn the report's figure, sizes the viewport to the page, captures it, and collects every
uncaught exception, `console.error`/`console.assert` and browser log entry of level error. Exit 1 when
there is one (the screenshot is still written), 0 otherwise.

    uv run python -m tools.report_screenshot RUN_DIR/report.html docs/report.png
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]  # fmt: skip
DRAWN = "document.querySelectorAll('#agrpo-report .main-svg').length > 0 ? document.getElementById('agrpo-report').data.length : 0"


class DevTools:
    """A DevTools protocol client over Chromium's pipe; `call` sends and waits, events queue up."""

    def __init__(self, to_browser: int, from_browser: int) -> None:
        self.to_browser, self.from_browser = os.fdopen(to_browser, "wb"), os.fdopen(from_browser, "rb")
        self.next_id, self.events, self._buffer = 0, [], b""

    def _read(self) -> dict:
        while b"\0" not in self._buffer:
            chunk = os.read(self.from_browser.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe (did it start? see its stderr)")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        self.to_browser.write(json.dumps(message).encode() + b"\0")
        self.to_browser.flush()
        while True:
            reply = self._read()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(e.get("method") == method for e in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} within {timeout_s} s")
            self.events.append(self._read())


def _high_fd(fd: int) -> int:
    """A copy of `fd` above 10, so the child's dup2 onto 3 and 4 cannot clobber it."""
    copy = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return copy


def start_chromium(binary: str, profile: str, width: int) -> tuple[subprocess.Popen, DevTools]:
    commands_r, commands_w = map(_high_fd, os.pipe())
    replies_r, replies_w = map(_high_fd, os.pipe())

    def wire() -> None:  # in the child: DevTools reads commands on fd 3 and writes replies on fd 4
        os.dup2(commands_r, 3)
        os.dup2(replies_w, 4)

    command = [binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe",
               f"--window-size={width},900", "about:blank"]  # fmt: skip
    process = subprocess.Popen(command, preexec_fn=wire, close_fds=False, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)  # fmt: skip
    os.close(commands_r)
    os.close(replies_w)
    return process, DevTools(commands_w, replies_r)


def page_errors(events: list[dict]) -> list[str]:
    """Uncaught exceptions, console errors/asserts and error log entries among DevTools events."""
    errors = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            errors.append(
                f"exception: {details.get('exception', {}).get('description') or details.get('text')}"
            )
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            values = [a.get("value", a.get("description", "")) for a in params.get("args", [])]
            errors.append(f"console.{params['type']}: {' '.join(map(str, values))}")
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            errors.append(f"log: {params['entry'].get('text')} ({params['entry'].get('url', '')})")
    return errors


def screenshot(
    report: Path, out: Path, *, width: int = 1280, timeout_s: float = 30.0
) -> tuple[int, list[str]]:
    """Write `out` (PNG); return (traces drawn, errors)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise SystemExit("chromium not found: apt-get install -y chromium")
    with tempfile.TemporaryDirectory(prefix="agrpo-chromium-") as profile:
        process, tools = start_chromium(binary, profile, width)
        try:
            target = tools.call("Target.createTarget", url="about:blank")["targetId"]
            session = tools.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            for domain in ("Page", "Runtime", "Log"):
                tools.call(f"{domain}.enable", session)
            metrics = {"width": width, "deviceScaleFactor": 1, "mobile": False}
            tools.call("Emulation.setDeviceMetricsOverride", session, height=900, **metrics)
            tools.call("Page.navigate", session, url=report.resolve().as_uri())
            tools.wait_event("Page.loadEventFired", timeout_s)
            deadline, traces = time.monotonic() + timeout_s, 0
            while not traces and time.monotonic() < deadline:
                traces = tools.call("Runtime.evaluate", session, expression=DRAWN, returnByValue=True)[
                    "result"
                ]["value"]
                time.sleep(0.2)
            height = int(tools.call("Page.getLayoutMetrics", session)["cssContentSize"]["height"])
            tools.call("Emulation.setDeviceMetricsOverride", session, height=height, **metrics)
            time.sleep(0.5)  # plotly's responsive relayout after the resize
            png = tools.call("Page.captureScreenshot", session, format="png", captureBeyondViewport=True)[
                "data"
            ]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(base64.b64decode(png))
            tools.call("Browser.close")
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
    return traces, page_errors(tools.events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--width", type=int, default=1280)
    args = parser.parse_args()
    traces, errors = screenshot(args.report, args.out, width=args.width)
    print(
        f"{args.out}: {args.out.stat().st_size // 1024} KiB, {traces} traces drawn, {len(errors)} console errors"
    )
    for error in errors:
        print(f"  {error}")
    sys.exit(1 if errors or not traces else 0)


if __name__ == "__main__":
    main()
