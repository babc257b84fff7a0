"""Issue 27 §1: a matchmaking partition is green in Dagster only when every user of it is done.

Read as the UI reads it (GraphQL partition status), after runs started the way the replay sensor starts them.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from assets.matchmaking.pipeline import ASSET, partition_verdict
from assets.matchmaking.policy import Partition
from orchestration.cli import app
from redrive.stages import DEAD_LETTERED_TAG
from tests.dagster_helpers import DagsterUi, launch, tick
from tests.matchmaking.conftest import DAY, TZ, dead_letters, jobs, run
from tests.matchmaking.test_failures import break_profile, fix_profile


def replay(db_url: str, letter_id: int) -> None:
    out = CliRunner().invoke(app, ["dlq", "replay", str(letter_id), "--note", "SUP-9: profile corrected",
                                   "--confirm-safe"], env={"DATABASE_URL": db_url}, catch_exceptions=False)
    assert out.exit_code == 0, out.output


def test_partition_verdict() -> None:
    """Pure: failed now, or users still dead-lettered, fail the run; neither is a done partition."""
    p = Partition.parse(DAY, TZ)
    assert partition_verdict(p, 0, 10, 0) is None
    assert "2 users failed for good" in partition_verdict(p, 2, 8, 2)
    assert "1 users of the partition are still dead-lettered" in partition_verdict(p, 0, 1, 1)


@pytest.mark.usefixtures("sandbox")
def test_a_replay_leaving_users_dead_lettered_keeps_the_partition_failed_until_the_last_is_done(
        mm_defs, instance, engine, population, db_url) -> None:
    """Two users dead-lettered; replaying one ends the run failed and the partition stays failed in the UI
    (no materialization), with no new dead letter; replaying the other turns it materialized."""
    rows = population(16)
    first_bad, second_bad = rows[2]["id"], rows[9]["id"]
    break_profile(engine, first_bad)
    break_profile(engine, second_bad)
    with DagsterUi(mm_defs, instance) as ui:
        assert not run(mm_defs, instance).success
        assert ui.partition_stats(ASSET) | {"numPartitions": 0} == {
            "numMaterialized": 0, "numFailed": 1, "numMaterializing": 0, "numPartitions": 0}
        letters = {letter.entity_ref.rsplit(":", 1)[1]: letter for letter in dead_letters(engine)}
        assert set(letters) == {first_bad, second_bad}

        fix_profile(engine, first_bad)
        fix_profile(engine, second_bad)
        replay(db_url, letters[first_bad].id)
        [request] = tick(mm_defs, instance, "redrive_dead_letter_replays")
        assert request.run_config["ops"][ASSET]["config"]["user_ids"] == [first_bad]
        partial = launch(mm_defs, instance, request)
        assert not partial.success  # the replayed user is done, the other is not: the partition is not
        assert jobs(engine)[first_bad].status == "completed"
        assert "1 users of the partition are still dead-lettered" in partial.failure_data_for_node(ASSET).error.message
        assert instance.get_run_by_id(partial.run_id).tags.get(DEAD_LETTERED_TAG) == "true"  # no run-failure letter
        stats = ui.partition_stats(ASSET)
        assert (stats["numMaterialized"], stats["numFailed"]) == (0, 1)
        assert {(d.entity_ref.rsplit(":", 1)[1], d.status) for d in dead_letters(engine)} == {
            (first_bad, "resolved"), (second_bad, "open")}

        replay(db_url, letters[second_bad].id)
        [request] = tick(mm_defs, instance, "redrive_dead_letter_replays")
        assert launch(mm_defs, instance, request).success
        stats = ui.partition_stats(ASSET)
        assert (stats["numMaterialized"], stats["numFailed"]) == (1, 0)
        assert {d.status for d in dead_letters(engine)} == {"resolved"}
