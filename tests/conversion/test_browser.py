"""The page in a real headless Chromium (Debian's `chromium` + `chromium-driver`, driven by Selenium).

On CI (CI=true) a missing browser FAILS these tests; `scripts/install-browser.sh` installs it.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from assets.conversion import repository as repo
from assets.conversion.api import BANNER, create_app
from redrive.breaker import CircuitBreaker
from tests.conversion.conftest import job, make_pdf

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--window-size=1200,900")


def _browser_missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (Path(path).exists() or shutil.which(Path(path).name)):
            return f"{path} is not installed (run scripts/install-browser.sh)"
    return None


@pytest.fixture(scope="module")
def driver() -> Iterator[object]:
    missing = _browser_missing()
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
def served(engine, conv_settings, serve_app) -> str:
    """The API and page on a real port."""
    return serve_app(create_app(engine, conv_settings))


def wait_until(predicate, timeout: float = 15.0, what: str = "the page"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:  # noqa: BLE001 - the DOM is being re-rendered; look again
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def fail_job(engine, job_id: str, code: str = "GW_4XX") -> None:
    with engine.begin() as conn:
        conn.execute(sa.update(repo.conversion_jobs).where(repo.conversion_jobs.c.id == job_id)
                     .values(status="failed", error_code=code, error_message="upstream answered 400",
                             dead_letter=True, attempt_count=1))


def test_retry_button_requeues_is_disabled_without_source_and_banner_follows_the_breaker(
        driver, served, engine, submit, files, clock, conv_settings, tmp_path) -> None:
    """In Chromium: failed rows show their code and a Retry button (disabled when the PDF is gone); clicking it
    requeues the job; another user's job never appears; the "Converter busy" banner shows while the breaker is open."""
    from selenium.webdriver.common.by import By

    with engine.begin() as conn:
        token = repo.create_token(conn, "alice")
    retryable, gone = submit("alice", name="invoice.pdf"), submit("alice", name="scan.pdf")
    clock.advance(1)
    theirs = submit("bob", name="bob-secret.pdf")
    fail_job(engine, retryable), fail_job(engine, gone, "GW_5XX"), fail_job(engine, theirs)
    files.delete_source(job(engine, gone).source_location)

    driver.get(served + "/")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "signin-button").click()

    def rows() -> dict[str, object]:
        found = driver.find_elements(By.CSS_SELECTOR, "#jobs tr")
        return {r.get_attribute("data-job-id"): r for r in found} if len(found) == 2 else {}

    shown = wait_until(rows, what="Alice's two jobs")
    assert theirs not in shown and "bob-secret" not in driver.page_source
    assert shown[retryable].find_element(By.CSS_SELECTOR, ".code").text == "GW_4XX"
    assert shown[gone].find_element(By.CSS_SELECTOR, ".code").text == "GW_5XX"
    assert not shown[gone].find_element(By.CSS_SELECTOR, "button.retry").is_enabled()
    button = shown[retryable].find_element(By.CSS_SELECTOR, "button.retry")
    assert button.is_enabled() and button.text == "Retry"
    assert not driver.find_element(By.ID, "banner").is_displayed()

    button.click()
    wait_until(lambda: job(engine, retryable).status == "queued", what="the retry to reach the database")
    requeued = job(engine, retryable)
    assert (requeued.attempt_count, requeued.error_code, requeued.dead_letter) == (0, None, False)
    wait_until(lambda: rows()[retryable].find_element(By.CSS_SELECTOR, ".status").text == "queued",
               what="the row to show `queued`")
    assert not rows()[retryable].find_elements(By.CSS_SELECTOR, "button.retry")
    assert job(engine, gone).status == "failed" and job(engine, theirs).status == "failed"

    breaker = CircuitBreaker(engine, "pdf-gateway", conv_settings.breaker_policy())
    for _ in range(10):
        breaker.record(ok=False)
    banner = wait_until(lambda: driver.find_element(By.ID, "banner").is_displayed()
                        and driver.find_element(By.ID, "banner"), what="the banner")
    assert banner.text == BANNER
    driver.save_screenshot(str(tmp_path / "conversion-page.png"))
    with engine.begin() as conn:
        from redrive.breaker import close

        close(conn, "pdf-gateway", clock.now().replace(year=2100))
    wait_until(lambda: not driver.find_element(By.ID, "banner").is_displayed(), what="the banner to go")

    # the page's own upload: the file's bytes go up as they are, its name percent-encoded
    pdf = tmp_path / "Relevé 7.pdf"
    pdf.write_bytes(make_pdf("uploaded from the page"))
    driver.find_element(By.ID, "file").send_keys(str(pdf))
    driver.find_element(By.ID, "upload-button").click()
    wait_until(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#jobs tr")) == 3, what="the uploaded row")
    with engine.connect() as conn:
        newest = repo.list_for(conn, "alice")[0]
    assert (newest.filename, newest.status) == ("Relevé 7.pdf", "queued")
    assert files.read_source(newest.source_location) == pdf.read_bytes()
