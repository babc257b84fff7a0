"""Issue 13 item 2: runtime bugs inside a stage are named (002 §8.1 "Configuration/runtime bug"), never UNCLASSIFIED."""

from __future__ import annotations

import httpx
import pytest

from redrive.failures import Code, classify_exception
from redrive.stages import StagePolicy
from redrive.backoff import CRITICIZER_BACKOFF
from redrive.vocabularies import CRITICIZER, VOCABULARIES


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - a real traceback, as a stage would see it
        return caught


def _none_dereference() -> BaseException:
    try:
        None.id  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        return exc
    raise AssertionError("unreachable")


RUNTIME_BUGS = [
    RuntimeError("illegal state: stage finished twice"),
    TypeError("'NoneType' object is not subscriptable"),
    KeyError("stage"),
    IndexError("list index out of range"),
    AssertionError("invariant broken"),
    NotImplementedError("no handler for kind 'x'"),
    RecursionError("maximum recursion depth exceeded"),
    ZeroDivisionError("division by zero"),
    ImportError("cannot import name 'Client' from 'vendor'"),
    ModuleNotFoundError("No module named 'vendor_sdk'"),
    UnboundLocalError("cannot access local variable 'x'"),
]


@pytest.mark.parametrize("exc", RUNTIME_BUGS + [_none_dereference()], ids=lambda e: type(e).__name__)
def test_runtime_bug_is_config_or_runtime_bug_for_the_criticizer(exc: BaseException) -> None:
    """Each runtime bug raised in a stage is CONFIG_OR_RUNTIME_BUG, non-retryable, in 002's vocabulary."""
    failure = StagePolicy(max_attempts=5, backoff=CRITICIZER_BACKOFF, vocabulary=CRITICIZER).classify(_raised(exc))
    assert (failure.core, failure.code, failure.retryable) == (Code.INVARIANT_VIOLATION, "CONFIG_OR_RUNTIME_BUG", False)


@pytest.mark.parametrize("exc", RUNTIME_BUGS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("name", sorted(VOCABULARIES))
def test_every_vocabulary_names_runtime_bugs_by_its_bug_row(name: str, exc: BaseException) -> None:
    """In every vocabulary a runtime bug lands on the row the table lists for INVARIANT_VIOLATION, not the default."""
    vocabulary = VOCABULARIES[name]
    assert str(Code.INVARIANT_VIOLATION) in vocabulary.table  # an explicit row, with its reason in the table
    failure = vocabulary.apply(classify_exception(_raised(exc)))
    assert failure.code == vocabulary.table[str(Code.INVARIANT_VIOLATION)].code


def test_a_runtime_error_wrapping_a_timeout_is_still_a_timeout() -> None:
    """`raise RuntimeError(...) from timeout` keeps the cause's meaning: a retry can still help."""
    try:
        try:
            raise httpx.ConnectTimeout("timed out")
        except httpx.ConnectTimeout as inner:
            raise RuntimeError("fetch failed") from inner
    except RuntimeError as exc:
        failure = classify_exception(exc)
    assert (failure.core, failure.retryable) == (Code.NETWORK_TIMEOUT, True)


def test_a_runtime_error_wrapping_a_bug_is_a_bug() -> None:
    """A wrapper around another bug stays a bug: nothing in the chain is retryable."""
    try:
        try:
            {}["missing"]
        except KeyError as inner:
            raise RuntimeError("lookup failed") from inner
    except RuntimeError as exc:
        assert classify_exception(exc).core == Code.INVARIANT_VIOLATION


def test_an_unknown_library_error_stays_unclassified() -> None:
    """Only programming errors are bugs: an exception type nothing recognises is still UNCLASSIFIED in 002."""

    class VendorError(Exception):
        pass

    failure = CRITICIZER.apply(classify_exception(_raised(VendorError("???"))))
    assert failure.code == "UNCLASSIFIED"
