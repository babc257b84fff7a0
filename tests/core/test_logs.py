"""One log configuration for every process: REDRIVE_LOG_FORMAT=json gives one redacted JSON object per line."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from redrive import logs

API_KEY = "sk-live-Zq8xW3vB6nM1kJ4hG7fD0sA2pL5o"
CARD = "4111 1111 1111 1111"
EMAIL = "jane.roe@example.com"


@pytest.fixture
def root() -> Iterator[logging.Logger]:
    """The root logger as the test found it, restored afterwards (configure() changes process state)."""
    logger = logging.getLogger()
    handlers, level = list(logger.handlers), logger.level
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


def lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def test_json_lines_carry_the_work_fields_as_json_fields(root) -> None:
    """pipeline, entity, stage, attempt, error_class and run_id given as extra= are fields, not text in the message."""
    buf = io.StringIO()
    logs.configure("json", stream=buf)
    logging.getLogger("redrive.drain").warning("attempt failed", extra=logs.fields(
        pipeline="criticizer", entity="req-1", stage="fetch", attempt=2, error_class="RATE_LIMITED", run_id="r-1",
        tenant=None))
    [line] = lines(buf)
    assert {k: line[k] for k in logs.FIELDS} == {"pipeline": "criticizer", "entity": "req-1", "stage": "fetch",
                                                 "attempt": 2, "error_class": "RATE_LIMITED", "run_id": "r-1"}
    assert (line["message"], line["level"], line["logger"]) == ("attempt failed", "WARNING", "redrive.drain")
    assert "tenant" not in line  # unknown fields are left out, not null
    assert line["ts"].endswith("+00:00")  # ISO 8601 in UTC


def test_a_canary_secret_in_an_exception_or_an_extra_field_never_reaches_the_line(root) -> None:
    """The message, the traceback and every extra field (which skip the record factory) are redacted."""
    buf = io.StringIO()
    logs.configure("json", stream=buf)
    try:
        raise RuntimeError(f"upstream said: invalid key {API_KEY}")
    except RuntimeError:
        logging.getLogger("x").exception("call for %s failed", EMAIL, extra={
            "pipeline": "matching", "detail": f"card {CARD}", "authorization": "Bearer abc.def",
            "nested": {"api_key": API_KEY}})
    raw = buf.getvalue()
    for canary in (API_KEY, CARD, EMAIL, "Bearer abc.def"):
        assert canary not in raw
    [line] = lines(buf)
    assert "RuntimeError" in line["exception"] and "[REDACTED:" in line["exception"]
    assert line["detail"].startswith("card [REDACTED:card:")
    assert line["nested"]["api_key"].startswith("[REDACTED:")


def test_a_dagster_line_names_its_run_job_and_step(root) -> None:
    """Dagster's `dagster_meta` becomes run_id, job and step; the object itself is not dumped."""
    buf = io.StringIO()
    logs.configure("json", stream=buf)
    logging.getLogger("redrive.run").info("verdict", extra={
        "dagster_meta": {"run_id": "abc123", "job_name": "rehearsal_job", "step_key": "rehearsal_ask",
                         "dagster_event": object()}, "pipeline": "rehearsal"})
    [line] = lines(buf)
    assert (line["run_id"], line["job"], line["step"], line["pipeline"]) == ("abc123", "rehearsal_job",
                                                                             "rehearsal_ask", "rehearsal")
    assert "dagster_meta" not in line


def test_text_format_keeps_the_fields_as_redacted_key_values(root) -> None:
    """A terminal's line: the message, then the fields as key=value, redacted like the JSON ones."""
    buf = io.StringIO()
    logs.configure("text", stream=buf)
    logging.getLogger("w").info("job_claimed", extra={"job_id": "j1", "attempt": 1, "owner_email": EMAIL})
    out = buf.getvalue()
    assert "job_claimed job_id=j1 attempt=1 owner_email=[REDACTED:" in out and EMAIL not in out


def test_the_switch_is_one_environment_variable(root, monkeypatch) -> None:
    """Unset: a command only redacts (no handler added); json or text: one root handler; anything else: refused."""
    monkeypatch.delenv(logs.FORMAT_ENV, raising=False)
    before = list(root.handlers)
    assert logs.configure(only_if_set=True) is None and root.handlers == before
    monkeypatch.setenv(logs.FORMAT_ENV, "json")
    assert logs.log_format() == "json"
    first = logs.configure(only_if_set=True)
    second = logs.configure()
    assert first not in root.handlers and second in root.handlers  # configuring again replaces, never stacks
    assert logs.configure(replace=False) is second
    monkeypatch.setenv(logs.FORMAT_ENV, "yaml")
    with pytest.raises(ValueError, match="REDRIVE_LOG_FORMAT"):
        logs.log_format()


def test_a_record_its_own_logger_already_wrote_is_not_written_again(root) -> None:
    """Issue 27: Dagster's loggers have a handler of their own (in the format `--log-format` gives them); the root
    handler skips their records, so each record is one line; other records still reach it."""
    buf, theirs = io.StringIO(), io.StringIO()
    logs.configure("json", stream=buf)
    dagster_like = logging.getLogger("tests.own_handler")
    own = logging.StreamHandler(theirs)
    dagster_like.addHandler(own)
    try:
        dagster_like.warning("said once")
        logging.getLogger("tests.own_handler.child").warning("child said once")
        logging.getLogger("tests.plain").warning("through the root")
    finally:
        dagster_like.removeHandler(own)
    assert theirs.getvalue().splitlines() == ["said once", "child said once"]
    assert [line["message"] for line in lines(buf)] == ["through the root"]


def test_chatty_third_party_info_lines_are_quiet(root) -> None:
    """botocore's "Found credentials in environment variables." on every client (every sensor tick) is not logged."""
    buf = io.StringIO()
    logs.configure("json", stream=buf)
    logging.getLogger("botocore.credentials").info("Found credentials in environment variables.")
    logging.getLogger("botocore.credentials").warning("credentials expire soon")
    assert [line["message"] for line in lines(buf)] == ["credentials expire soon"]


def test_an_http_call_writes_no_line_of_its_own(root) -> None:
    """httpx's "HTTP Request: POST … 200 OK" at INFO came four times an entity through the redacting formatter
    (12 % of a criticizer run worker's time); the outcome is the pipeline's own line, and a failure its own."""
    import httpx

    buf = io.StringIO()
    logs.configure("json", stream=buf)
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200))) as client:
        client.post("https://llm.example/v1/chat/completions?key=k")
    logging.getLogger("redrive.drain").info("e-1 done")
    assert [line["message"] for line in lines(buf)] == ["e-1 done"]


def test_a_services_one_off_line_is_json_when_json_is_asked_for(monkeypatch) -> None:
    """`redrive metrics serve` and `console serve` say where they listen: a JSON record, or the text as it is."""
    monkeypatch.setenv(logs.FORMAT_ENV, "json")
    said = json.loads(logs.line("serving http://127.0.0.1:9108/metrics"))
    assert said["message"] == "serving http://127.0.0.1:9108/metrics" and said["level"] == "INFO"
    monkeypatch.setenv(logs.FORMAT_ENV, "text")
    assert logs.line("serving x") == "serving x"
