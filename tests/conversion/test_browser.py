"""The page in a real headless Chromium (Debian's `chromium` + `chromium-driver`, driven by Selenium).

On CI (CI=true) a missing browser FAILS these tests; `scripts/install-browser.sh` installs it. The `driver` and
`serve_app` fixtures and `wait_until` are tests/browser.py's, shared with the dead-letter console's browser test.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa

from assets.conversion import repository as repo
from assets.conversion.api import BANNER, create_app
from redrive.breaker import CircuitBreaker
from tests.browser import wait_until
from tests.conversion.conftest import job, make_pdf

pytestmark = pytest.mark.browser

SCREENSHOT_NAME = "conversion-page.png"  # docs/images/ has the one the conversion page's docs show


@pytest.fixture
def served(engine, conv_settings, clock, serve_app) -> str:
    """The API and page on a real port, on the test's frozen clock."""
    return serve_app(create_app(engine, conv_settings, clock))


def set_job(engine, job_id: str, **values) -> None:
    with engine.begin() as conn:
        conn.execute(sa.update(repo.conversion_jobs).where(repo.conversion_jobs.c.id == job_id).values(**values))


def fail_job(engine, job_id: str, code: str = "GW_4XX", message: str = "upstream answered 400") -> None:
    set_job(engine, job_id, status="failed", error_code=code, error_message=message, dead_letter=True, attempt_count=1)


def test_retry_button_requeues_is_disabled_without_source_and_banner_follows_the_breaker(
        driver, served, engine, submit, files, clock, conv_settings, tmp_path, screenshot_dir) -> None:
    """In Chromium: each row shows its code with its one-line message, its attempts and, for a scheduled retry,
    when it is due (by the server's clock); failed rows have a Retry button (disabled when the PDF is gone);
    clicking it requeues the job; another user's job never appears; the "Converter busy" banner shows while the
    breaker is open. The screenshot of that state is docs/images/conversion-page.png (`make screenshots`)."""
    from selenium.webdriver.common.by import By

    with engine.begin() as conn:
        token = repo.create_token(conn, "alice")
    converted = submit("alice", name="annual-report-2025.pdf")
    set_job(engine, converted, status="succeeded", attempt_count=1, result_location=f"{converted}.xml",
            completed_at=clock.now())
    clock.advance(1)
    scheduled = submit("alice", name="contract-scan.pdf")
    clock.advance(1)
    retryable = submit("alice", name="invoice.pdf")
    clock.advance(1)  # distinct creation times: the list's order, and so the screenshot, is the same every run
    gone = submit("alice", name="scan.pdf")
    clock.advance(1)
    untouched = submit("alice", name="Relevé de compte.pdf")
    clock.advance(1)
    theirs = submit("bob", name="bob-secret.pdf")
    due_at = clock.now() + timedelta(seconds=90)
    set_job(engine, scheduled, status="queued", attempt_count=2, error_code="GW_TIMEOUT",
            error_message="the converter did not answer within 30 s", retry_after=due_at)
    fail_job(engine, retryable), fail_job(engine, theirs)
    fail_job(engine, gone, "GW_5XX", "the converter answered 502 Bad Gateway three times")
    fail_job(engine, untouched, "GW_4XX", "the converter refused the file: encrypted PDF\nline two")
    files.delete_source(job(engine, gone).source_location)
    mine = 5

    driver.get(served + "/")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "signin-button").click()

    def rows(count: int = mine) -> dict[str, object]:
        found = driver.find_elements(By.CSS_SELECTOR, "#jobs tr")
        return {r.get_attribute("data-job-id"): r for r in found} if len(found) == count else {}

    def text(row, selector: str) -> str:
        return row.find_element(By.CSS_SELECTOR, selector).text

    shown = wait_until(rows, what="Alice's jobs")
    assert theirs not in shown and "bob-secret" not in driver.page_source
    assert (text(shown[retryable], ".code"), text(shown[retryable], ".error-message")) == ("GW_4XX",
                                                                                           "upstream answered 400")
    assert text(shown[gone], ".code") == "GW_5XX"
    assert text(shown[untouched], ".error-message") == "the converter refused the file: encrypted PDF line two"
    assert text(shown[retryable], ".attempt-count") == "1" and text(shown[scheduled], ".attempt-count") == "2"
    assert text(shown[scheduled], ".code") == "GW_TIMEOUT"
    due = shown[scheduled].find_element(By.CSS_SELECTOR, "time.retry-at")
    assert due.text == "in 1 min 30 s"  # by the server's (frozen) clock, not the browser's
    assert due.get_attribute("datetime") == due_at.isoformat()
    assert text(shown[retryable], "td.next") == "—" and text(shown[converted], "td.error") == "—"
    assert shown[converted].find_element(By.CSS_SELECTOR, "button.download").text == "Download XML"
    assert not shown[gone].find_element(By.CSS_SELECTOR, "button.retry").is_enabled()
    button = shown[retryable].find_element(By.CSS_SELECTOR, "button.retry")
    assert button.is_enabled() and button.text == "Retry"
    assert not driver.find_element(By.ID, "banner").is_displayed()
    # inline styles only: nothing is fetched from another origin
    assert not driver.find_elements(By.CSS_SELECTOR, "link[href], script[src], img[src^=http]")

    button.click()
    wait_until(lambda: job(engine, retryable).status == "queued", what="the retry to reach the database")
    requeued = job(engine, retryable)
    assert (requeued.attempt_count, requeued.error_code, requeued.dead_letter) == (0, None, False)
    wait_until(lambda: text(rows()[retryable], ".status") == "queued", what="the row to show `queued`")
    assert not rows()[retryable].find_elements(By.CSS_SELECTOR, "button.retry")
    assert job(engine, gone).status == "failed" and job(engine, theirs).status == "failed"

    breaker = CircuitBreaker(engine, "pdf-gateway", conv_settings.breaker_policy())
    for _ in range(10):
        breaker.record(ok=False)
    banner = wait_until(lambda: driver.find_element(By.ID, "banner").is_displayed()
                        and driver.find_element(By.ID, "banner"), what="the banner")
    assert banner.text == BANNER
    assert driver.save_screenshot(str(screenshot_dir / SCREENSHOT_NAME))
    with engine.begin() as conn:
        from redrive.breaker import close

        close(conn, "pdf-gateway", clock.now().replace(year=2100))
    wait_until(lambda: not driver.find_element(By.ID, "banner").is_displayed(), what="the banner to go")

    # the page's own upload: the file's bytes go up as they are, its name percent-encoded
    pdf = tmp_path / "Relevé 7.pdf"
    pdf.write_bytes(make_pdf("uploaded from the page"))
    driver.find_element(By.ID, "file").send_keys(str(pdf))
    driver.find_element(By.ID, "upload-button").click()
    wait_until(lambda: rows(mine + 1), what="the uploaded row")
    with engine.connect() as conn:
        newest = repo.list_for(conn, "alice")[0]
    assert (newest.filename, newest.status) == ("Relevé 7.pdf", "queued")
    assert files.read_source(newest.source_location) == pdf.read_bytes()
