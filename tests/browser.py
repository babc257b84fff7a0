"""What the browser tests share (a pytest plugin: tests/conftest.py lists it in `pytest_plugins`): an app served on a
real loopback port, a headless Chromium driven by Selenium, and a wait on the page's (or the database's) state.

The browser is Debian's `chromium` + `chromium-driver` (`scripts/install-browser.sh`, `make browser`). When it is
missing the `driver` fixture FAILS on CI (CI=true) and skips elsewhere.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--window-size=1200,900")


def browser_missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (Path(path).exists() or shutil.which(Path(path).name)):
            return f"{path} is not installed (run scripts/install-browser.sh)"
    return None


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    """One headless Chromium per test module."""
    missing = browser_missing()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"browser test cannot run on CI: {missing}")
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver") or CHROMEDRIVER), options=options)
    browser.set_page_load_timeout(30)
    yield browser
    browser.quit()


@pytest.fixture
def serve_app() -> Iterator[Callable[..., str]]:
    """Serve an app on a real port with uvicorn, as `python -m assets.conversion.api serve` does. uvicorn's own
    logging config is not installed, so its records (tracebacks included) reach the root logger and caplog."""
    import uvicorn

    started: list[tuple[uvicorn.Server, threading.Thread, socket.socket]] = []

    def serve(app: object) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="info", log_config=None))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 15
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        started.append((server, thread, sock))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield serve
    for server, thread, sock in started:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def wait_until(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "the page") -> Any:
    """Poll `predicate` (Selenium's WebDriverWait) until it returns something truthy, and return that; an exception
    counts as "not yet" (the DOM is being re-rendered). AssertionError naming `what` on timeout."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.wait import WebDriverWait

    waiting = WebDriverWait(None, timeout, poll_frequency=0.1, ignored_exceptions=(Exception,))
    try:
        return waiting.until(lambda _: predicate())
    except TimeoutException:
        raise AssertionError(f"timed out waiting for {what}") from None
