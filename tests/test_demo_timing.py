"""The demo's timing lines.  The share of step time: alternating pairs, the median of their shares, every timed
canary run a clean run (a violation in any of them fails the demo); the steady steps where there were any."""

from __future__ import annotations

import dataclasses

import pytest

from kvcanary.demo_timing import (
    FIRST_STEPS,
    ShareTiming,
    added_time_line,
    graph_line,
    host_time_lines,
    step_by_step_line,
    time_share,
    timed_host_line,
    timing_lines,
)


def test_pairs_alternate_and_the_share_is_the_median_of_the_pairs() -> None:
    order: list[str] = []
    with_seconds, without_seconds = iter([10.0, 12.0, 10.5]), iter([9.0, 9.0, 10.5])

    def run_with(i: int) -> tuple[float, int]:
        order.append(f"with{i}")
        return next(with_seconds), 0

    def run_without() -> float:
        order.append("without")
        return next(without_seconds)

    timing, violations = time_share(run_with, run_without, rounds=3)
    assert order == ["without", "with0", "with1", "without", "without", "with2"]  # the order flips each pair
    assert violations == [0, 0, 0]
    assert timing.shares == pytest.approx([0.1, 0.25, 0.0])  # a pair where the canary added nothing: 0
    assert timing.share == pytest.approx(0.1)
    line = timing.line()
    assert "the canary's share of step time: 10.0%" in line and "0.0%, " not in line.split("pairs:")[0]
    assert "without the canary: 9.00 s, with it: 10.50 s" in line and "wall time" not in line
    # With the runs' wall seconds kept too (the steps' compared), their share is given beside: pairs 5, 20 and 0 %.
    walled = dataclasses.replace(timing, walls=((19.0, 20.0, 21.0), (20.0, 25.0, 20.0)))
    assert walled.share == timing.share and walled.wall_share == pytest.approx(0.05)
    assert walled.line().endswith("; of the runs' wall time: 5.0%") and walled.cpu_shares is None
    # With the loop thread's CPU time kept: pairs 4, 0 (it ran less with the canary) and 50 %, the median given.
    cpued = dataclasses.replace(walled, cpus=((4.8, 5.0, 1.0), (5.0, 4.0, 2.0)))
    assert cpued.cpu_shares == pytest.approx([0.04, 0.0, 0.5]) and cpued.share == timing.share
    assert cpued.line().endswith("; of the loop thread's CPU time in the steps: 4.0% (pairs: 4.0%, 0.0%, 50.0%)")


def test_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        time_share(lambda i: (1.0, 0), lambda: 1.0, rounds=0)


def test_a_violation_in_a_timed_clean_run_fails_the_demo() -> None:
    pytest.importorskip("transformers")
    from kvcanary.demo_summary import summary
    from test_cli_demo import fake_result

    good = fake_result(0, True)
    timed = dataclasses.replace(good, timing=ShareTiming((1.0,), (1.25,)))
    assert timed.passed and "share of step time: 20.0%" in summary(timed)
    bad = dataclasses.replace(timed, timed_violations=3)
    assert not bad.passed
    assert "the timed clean runs raised 3 violations" in summary(bad)


def test_the_host_time_line_names_steady_steps_only_where_there_were_some() -> None:
    stats = {"steps": 720, "tap_us": 720 * 300}
    assert host_time_lines(stats, {"steady_steps": 0}) == ["  host time in the canary: 0.30 ms per step"]
    lines = host_time_lines(stats, {"steady_steps": 448})
    assert lines[1] == "  steady steps (a kept translation of their shape class reused): 448 of 720"


def test_the_step_graph_line_says_what_captures_and_eager_steps_cost_a_step_where_graphs_ran() -> None:
    stats = {"steps": 720, "tap_us": 720 * 300, "graph_replays": 0, "graph_captures": 0}
    assert graph_line(stats) is None and len(host_time_lines(stats, {})) == 1  # the CPU: no graph
    stats |= {"graph_replays": 712, "graph_captures": 4, "graph_capture_us": 18_000, "graph_eager_steps": 8,
              "graph_eager_us": 9_000}  # fmt: skip
    want = (
        "  canary step graphs: 712 steps replayed, 4 captured (4.5 ms each), 8 run eagerly (1.12 ms each): "
        "captures and eager steps 0.037 ms a step"
    )
    assert graph_line(stats) == want and host_time_lines(stats, {})[-1] == want
    assert graph_line(stats | {"graph_capture_failures": 2}) == want + "; 2 captures failed (those steps ran eagerly)"


def test_the_timed_runs_line_gives_each_runs_host_time_per_step_and_their_median() -> None:
    runs = [{"steps": 100, "tap_us": 100 * 660}, {"steps": 100, "tap_us": 100 * 410}, {"steps": 50, "tap_us": 50 * 430}]
    line = timed_host_line(runs)
    assert line == "  host time per step of each timed run: 0.66, 0.41, 0.43 ms (median 0.43 ms)"
    assert timed_host_line(runs[:1]) is None and timed_host_line([*runs[:1], {"steps": 0, "tap_us": 0}]) is None


def test_the_added_time_is_split_into_the_canarys_timed_work_and_the_rest() -> None:
    timing = ShareTiming((4.0, 4.2, 4.1), (4.5, 4.6, 4.9))  # added 0.5, 0.4, 0.8 s
    run = {"steps": 500, "tap_us": 500 * 400, "setup_us": 20_000, "mirror_us": 10_000}  # per step 0.40, 0.04, 0.02
    line = added_time_line(timing, [run, run, run])
    assert line is not None and line.startswith("  time added per step (medians of the pairs): 1.000 ms;")
    assert "host time in the step 0.400, each cache's set-up 0.040, mirroring the engine's block moves 0.020" in line
    assert "the rest 0.540 " in line  # 1.000 - 0.460
    # the timed work alone: 0.46 ms a step of 4.6 / 500 = 9.2 ms (the median pair's time with the canary)
    assert "the canary's timed work alone is 5.0% of the time with it" in line
    assert added_time_line(timing, [run, run]) is None  # a run's stats missing: nothing to split
    lines = timing_lines(timing, [run, run, run])
    assert len(lines) == 3 and "share of step time" in lines[1] and lines[2] == line
    assert timing_lines(None, [run]) == []


def test_the_demo_times_as_many_pairs_as_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from kvcanary import demo

    asked: list[int] = []

    class Stop(Exception):
        pass

    def share(run_with: object, run_without: object, rounds: int) -> None:
        asked.append(rounds)
        raise Stop

    monkeypatch.setattr(demo, "time_share", share)
    monkeypatch.setattr(
        demo, "time_baseline", lambda *a: demo.TimedRun(0, 1.0, None, ())
    )  # no engine run: only the wiring is under test
    monkeypatch.setattr(demo, "run_workload", lambda *a, **k: None)
    monkeypatch.setattr(demo, "build_model", lambda *a: None)
    for rounds in (5, demo.ROUNDS):
        with pytest.raises(Stop):
            demo.run_demo(demo.DemoOptions(baseline=True, rounds=rounds), progress=None)
    assert asked == [5, 3]


def test_step_by_step_takes_each_steps_median_over_the_runs_and_sets_the_first_steps_apart() -> None:
    """Three runs a side of 7 steps: one run of each side has a slow stretch (a collection, say), which the medians
    over the runs leave out; the canary adds 5 ms to its first step, 1 ms to the next two and 0.25 ms to the rest."""
    base = [1.0e-3] * 7
    canary = [6.0e-3, 2.0e-3, 2.0e-3] + [1.25e-3] * 4
    slow_base, slow_canary = [*base[:5], 9e-3, 1e-3], [*canary[:4], 9e-3, *canary[5:]]
    timing = ShareTiming(
        (1.0, 1.0, 1.0), (1.0, 1.0, 1.0), steps=((base, slow_base, base), (slow_canary, canary, canary))
    )
    line = step_by_step_line(timing)
    assert FIRST_STEPS == 3 and line is not None
    assert f"the first {FIRST_STEPS} steps added 5.00, 1.00, 1.00 ms" in line
    assert "the other 4 added 0.250 ms a step (median 0.250), 20.0% of their time with the canary" in line
    assert timing_lines(timing, [])[-1] == line
    # Not comparable step by step: runs of different lengths, too few steps, or the steps not timed.
    uneven = dataclasses.replace(timing, steps=((base, base[:6], base), (canary, canary, canary)))
    short = dataclasses.replace(timing, steps=(((1e-3,) * 3,), ((2e-3,) * 3,)))
    for none in (uneven, short, dataclasses.replace(timing, steps=None)):
        assert step_by_step_line(none) is None
    # A canary that added nothing after its first steps: 0 %, never a negative share.
    faster = dataclasses.replace(timing, steps=((base,), ([*canary[:3], *[0.9e-3] * 4],)))
    assert "0.0% of their time" in (step_by_step_line(faster) or "")


def test_the_host_time_lines_say_how_many_block_moves_were_queued_only_where_some_were() -> None:
    stats = {"steps": 352, "tap_us": 352 * 170, "queued_move_entries": 0}
    assert len(host_time_lines(stats, {})) == 1  # the CPU: each move mirrored at once
    stats |= {"queued_move_entries": 1234, "steps_with_queued_moves": 98, "move_entries_applied_at_once": 3}
    want = "  block moves queued for the step work: 1,234 moved blocks over 98 steps, 3 applied at once"
    assert host_time_lines(stats, {})[-1] == want
