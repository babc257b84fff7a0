"""Run keys (`redrive.run_keys`): one key per entity and attempt or replay, never ambiguous, never the clock."""

from __future__ import annotations

import pytest

from redrive.run_keys import run_key


@pytest.mark.parametrize("kw", [{}, {"attempt": 2, "replay": 1}, {"attempt": None, "replay": None}])
def test_a_key_names_exactly_one_of_attempt_or_replay(kw) -> None:
    """Neither (a key Dagster would dedupe for ever: every retry of a failed entity blocked) or both (a replay
    whose key collides with an attempt's) is refused."""
    with pytest.raises(ValueError, match="exactly one"):
        run_key("demo", "e-1", **kw)


def test_each_attempt_and_replay_gets_its_own_key_and_a_rerun_derives_the_same() -> None:
    """Attempt 1, attempt 2 and replay 1 differ (Dagster starts each), and the same inputs give the same key."""
    keys = [run_key("demo", "e-1", attempt=1), run_key("demo", "e-1", attempt=2), run_key("demo", "e-1", replay=1),
            run_key("demo", "e-1", replay=1, purpose="drain")]
    assert len(set(keys)) == 4
    assert run_key("demo", "e-1", attempt=1) == "demo:run:e-1:attempt-1" == keys[0]
