"""The soak benchmark's pure verdicts (bench/soak.py): when a table is judged, and what the live windows must show."""

from __future__ import annotations

import math

from bench.soak import Window, serve_verdicts, steady_from, tick_growth

SAMPLES = (1, 30, 60, 90, 120)


def test_a_table_is_judged_from_the_first_sample_its_window_is_full_and_not_before_day_30() -> None:
    assert steady_from(7, SAMPLES) == 30
    assert steady_from(0, SAMPLES) == 30
    assert steady_from(30, SAMPLES) == 30
    assert steady_from(90, SAMPLES) == 90


def test_a_table_still_filling_at_the_last_sample_is_not_judged() -> None:
    assert steady_from(90, (1, 30, 60, 90)) is None  # full only at the last sample: nothing after it to compare
    assert steady_from(365, SAMPLES) is None
    assert steady_from(math.inf, SAMPLES) is None


def window(day: int, *, tick: float = 100.0, scrape: float = 50.0, loaded: float = 80.0, lost: int = 0,
           dup: int = 0, died: dict[str, int] | None = None) -> Window:
    return Window(day, {"criticizer": 17}, {"criticizer": lost}, {"criticizer": dup}, 3.0,
                  {"criticizer_due_work": tick, "redrive_run_watchdog": 2 * tick}, loaded, died or {},
                  quiet_scrape_ms=scrape)


def test_the_windows_pass_when_ticks_and_scrape_hold_and_nothing_is_lost_or_doubled() -> None:
    verdicts = serve_verdicts({1: window(1), 60: window(60, tick=500.0), 120: window(120, tick=115.0, scrape=60.0)})
    assert all(verdicts.values()), verdicts


def test_the_scrape_is_judged_after_the_window_not_under_its_load() -> None:
    """Under a window's traffic a scrape waits for the cores (day-1 windows gave 32 to 53 ms): the verdict reads
    the scrapes taken once the window's work finished."""
    assert all(serve_verdicts({1: window(1, loaded=41.0), 90: window(90, loaded=64.0)}).values())
    verdicts = serve_verdicts({1: window(1, scrape=40.0, loaded=41.0), 90: window(90, scrape=54.0, loaded=41.0)})
    assert [ok for what, ok in verdicts.items() if "scrape" in what] == [False]


def test_the_ticks_are_judged_summed_first_window_against_last() -> None:
    verdicts = serve_verdicts({1: window(1), 120: window(120, tick=125.0)})
    assert [ok for what, ok in verdicts.items() if what.startswith("every sensor")] == [False]


def test_a_slower_scrape_a_lost_entity_a_duplicate_or_a_dead_service_fails_its_verdict() -> None:
    for last, key in ((window(90, scrape=66.0), "scrape"), (window(90, lost=1), "lost"),
                      (window(90, dup=1), "duplicate"), (window(90, died={"daemon": -9}), "died")):
        verdicts = serve_verdicts({1: window(1), 90: last})
        assert [what for what, ok in verdicts.items() if not ok and key in what], (key, verdicts)
        assert sum(not ok for ok in verdicts.values()) == 1, (key, verdicts)


def test_a_sensor_whose_tick_reads_more_pages_as_the_months_pass_is_named() -> None:
    pages = {1: {"redrive_dead_letter_reconciliation": 137, "criticizer_due_work": 3, "redrive_stall_watch": 0},
             120: {"redrive_dead_letter_reconciliation": 1374, "criticizer_due_work": 8, "redrive_stall_watch": 5}}
    assert tick_growth(pages, 1, 120) == ["redrive_dead_letter_reconciliation"]  # 3 -> 8 and 0 -> 5: the floor
    pages[120]["redrive_dead_letter_reconciliation"] = 169
    assert tick_growth(pages, 1, 120) == []


def test_a_sensors_first_tick_in_a_new_storage_is_left_out_of_its_median() -> None:
    """The first tick has no cursor (a new Dagster storage each window): 5,000 ms there, 300 after; a sensor
    that ticked once keeps its one tick."""
    from bench.soak import steady_tick_medians

    def tick(name: str, at: float, ms: float) -> dict:
        return {"instigator_name": name, "timestamp": at, "end_timestamp": at + ms / 1000}

    ticks = [tick("recon", 300.0, 310), tick("recon", 0.0, 5000), tick("recon", 600.0, 290), tick("once", 5.0, 40)]
    medians = steady_tick_medians(ticks)
    assert sorted(medians) == ["once", "recon"]
    assert math.isclose(medians["once"], 40.0) and math.isclose(medians["recon"], 300.0)
