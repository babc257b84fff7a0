"""`python -m bench conversion` without the `bench` extra says what to install instead of a traceback."""

from __future__ import annotations

import importlib.util

import pytest

from bench import conversion


def test_missing_peer_packages_are_named_and_nothing_runs(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pgqueuer" else object())
    monkeypatch.setattr(conversion, "scratch_database", lambda *_: pytest.fail("no database without the peers"))
    assert conversion.main() == 2
    err = capsys.readouterr().err
    assert "pgqueuer" in err and "procrastinate" not in err
    assert "make bench" in err and "Traceback" not in err
