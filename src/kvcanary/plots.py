"""Figures for people: the event log's timeline and the self-test's detection matrix (PNG via matplotlib).

matplotlib is optional (the ``plots`` extra); the text and JSON outputs never need it.  Figures are
drawn on a bare ``matplotlib.figure.Figure`` with the Agg canvas, never through pyplot, so nothing
global (the pyplot figure list, the interactive backend) is touched.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcanary.events_report import EventSummary
    from kvcanary.selftest.runner import SelftestResult

PLOTS_HINT = "pip install 'matplotlib>=3.8' (or the plots extra: pip install -e '.[plots]')"


class PlotsUnavailable(ImportError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Raise :class:`PlotsUnavailable`, with the install hint, unless matplotlib can be imported."""
    try:
        import matplotlib.backends.backend_agg  # noqa: F401
    except ImportError as exc:
        raise PlotsUnavailable(f"--plot needs matplotlib ({PLOTS_HINT}): {exc}") from None


def new_figure(width: float, height: float) -> Any:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Any, path: str | Path) -> Path:
    out = Path(path)
    fig.savefig(out, format="png")
    return out


def events_timeline(summary: EventSummary, path: str | Path) -> Path:
    """Violation rows per step, one bar colour per group, and a mark at every failed health check."""
    fig = new_figure(9, 4)
    ax = fig.add_subplot()
    groups = sorted({str(g) for e in summary.steps for g in e.get("group_counts", {})})
    bottoms: dict[int, int] = {}
    for group in groups:
        points = [(int(e["step"]), int(e["group_counts"].get(group, 0))) for e in summary.steps]
        points = [(s, n) for s, n in points if n]
        xs = [s for s, _ in points]
        ax.bar(xs, [n for _, n in points], bottom=[bottoms.get(s, 0) for s in xs], width=0.8, label=group)
        for s, n in points:
            bottoms[s] = bottoms.get(s, 0) + n
    for e in summary.health:
        ax.axvline(int(e["step"]), color="red", linestyle=":", linewidth=1)
    if summary.health:
        ax.plot([], [], color="red", linestyle=":", label="failed health check")
    ax.set_xlabel("engine step")
    ax.set_ylabel("violation rows")
    ax.yaxis.get_major_locator().set_params(integer=True)
    verdict = "clean" if summary.clean else f"{summary.rows_total:,} violation rows in {len(bottoms)} steps"
    ax.set_title(f"kvcanary events: {Path(summary.path).name or 'log'} ({verdict})")
    if groups or summary.health:
        ax.legend(loc="upper right")
    else:
        ax.text(0.5, 0.5, "no violations recorded", ha="center", va="center", transform=ax.transAxes)
    last = summary.stats[-1]["step"] if summary.stats else None
    if last is not None:
        ax.set_xlim(left=-0.5, right=max(int(last), *bottoms, 0) + 0.5)
    return save(fig, path)


def selftest_matrix(result: SelftestResult, path: str | Path) -> Path:
    """Left: trials caught / late / missed / errors per fault; right: steps to detection per trial.

    Faults expected to be missed are labelled so: a miss there is the documented limit, not a failure.
    """
    rows = list(result.rows)
    fig = new_figure(12, 2.4 + 0.4 * len(rows))
    counts_ax, steps_ax = fig.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    ys = list(range(len(rows)))
    colours = {"caught": "tab:green", "late": "tab:orange", "missed": "tab:gray", "error": "tab:red"}
    left = [0] * len(rows)
    for outcome, colour in colours.items():
        widths = [r.count(outcome) for r in rows]
        counts_ax.barh(ys, widths, left=left, color=colour, label=outcome)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for y, r in zip(ys, rows, strict=True):
        counts_ax.text(len(r.trials), y, f" {r.detected}/{len(r.trials)}", va="center", fontsize="small")
    counts_ax.set_yticks(ys, [f"{r.spec.name} ({r.spec.expected.value})" for r in rows])
    counts_ax.invert_yaxis()
    counts_ax.set_xlim(0, max([len(r.trials) for r in rows] + [1]) * 1.12)
    counts_ax.set_xlabel("trials")
    counts_ax.xaxis.get_major_locator().set_params(integer=True)
    all_steps = [0, 1]
    for y, r in zip(ys, rows, strict=True):
        steps = collections.Counter(t.steps for t in r.trials if t.steps is not None)
        all_steps += list(steps)
        xs = sorted(steps)
        steps_ax.scatter(xs, [y] * len(xs), s=[16 + 10 * steps[x] for x in xs], color="tab:blue", label="_trials")
        for x in xs:
            steps_ax.annotate(f"{steps[x]}", (x, y), xytext=(6, 4), textcoords="offset points", fontsize="x-small")
    steps_ax.axvline(1, color="tab:green", linestyle="--", linewidth=1, label="limit: 1 step")
    steps_ax.set_xlim(min(all_steps) - 0.5, max(all_steps) + 0.5)
    steps_ax.xaxis.get_major_locator().set_params(integer=True)
    steps_ax.set_xlabel("steps, first affected read to report (number of trials)")
    fig.legend(loc="outside lower center", ncols=5, fontsize="small")
    controls = f"{len(result.controls)} clean control run(s): {result.false_positives} false positive(s)"
    if result.control_errors:
        controls += f", {result.control_errors} with errors"
    fig.suptitle(
        f"kvcanary selftest, {result.engine} {result.engine_version}: {'PASS' if result.passed else 'FAIL'}; "
        f"{result.requested_trials} trials per fault; {controls}"
    )
    return save(fig, path)
