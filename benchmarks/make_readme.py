"""Regenerate benchmarks/README.md and the top README's performance table from the newest results file
(by its meta date), and the plot
(benchmarks/per_step_time.png: per-step time against verified entries, with the floor and the original
sglang canary's numbers; needs matplotlib, the ``plots`` extra -- without it the plot is left as it is).

Usage: python benchmarks/make_readme.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLOT = "per_step_time.png"
# The original sglang canary's kernels on an H200, per step (microseconds), as quoted in the top README's
# Performance section: decode at batch 1 (any prefix), 32 x 4k and 256 x 16k; a 16k prefill chunk.
ORIGINAL_US = {"decode_b1_p512": 22, "decode_b1_p4k": 22, "decode_b1_p16k": 22, "decode_b32_p4k": 53}
ORIGINAL_US |= {"decode_b256_p16k": 449, "prefill_16k": 8500}

INTRO = """# Benchmarks

`bench_kernels.py` times one group's per-step canary work (plan -> verify -> stamp, Triton kernels) on a
CUDA GPU under CUDA-graph replay with rotating input sets, and the PyTorch reference path eagerly on
the same GPU as the baseline.  Results are saved in `results/<gpu>-<commit>.json`; this page is
regenerated from the newest one by `make_readme.py` (do not edit the table by hand).

Run on a GPU machine: `PYTHONPATH=src python benchmarks/bench_kernels.py --commit $(git rev-parse --short HEAD)`
then `python benchmarks/make_readme.py`.

Columns: `median / p20 / p80` microseconds per step; `entries` verified per step; `bytes` the step must
move (table and lookup entries and records of the verified entries; inputs and records of the written
tokens; row lengths and plan outputs); `floor` = max(bytes / measured copy bandwidth, one
graph-replayed kernel); `x floor` = median / floor; `reference` = eager reference step (ms).

Workload: every request's prefix is stamped and clean; each step verifies every prefix (or window)
and writes `extend` tokens per request.  Slots come in 64-slot runs in shuffled order (a paged
allocator); the window scenarios translate through a full->window lookup table that is a random
permutation, so their record gathers have no locality at all (a worst case).  `--sweep` times a few
scenarios under several kernel tunings; its tables are kept beside the results (`*-sweep.txt`).
"""

TARGETS = (
    "Targets (the project's performance bar): at most 2x floor for every scenario with >= 1M verified entries; at most "
    "10 us per step for decode batches up to 32 at prefix up to 4k; a 16k-token chunk stamped in at most 20 us."
)


def _newest(scenario_key: str) -> tuple[Path, dict] | None:
    """The newest results file (by meta date) holding records with ``scenario_key``."""
    loaded = [(f, json.loads(f.read_text())) for f in sorted(HERE.glob("results/*.json"))]
    loaded = [(f, d) for f, d in loaded if any(scenario_key in r for r in d["records"])]
    return max(loaded, key=lambda fd: fd[1]["meta"]["date"]) if loaded else None


def _verdict(rec: dict) -> str:
    name, med = rec["scenario"], rec["median_us"]
    notes = []
    if rec["entries"] >= 1_000_000:
        notes.append(f"{'meets' if med <= 2 * rec['floor_us'] else 'misses'} <= 2x floor")
    if name.startswith("decode_b") and not name.endswith("16k"):
        b = int(name.split("_")[1][1:])
        if b <= 32:
            notes.append(f"{'meets' if med <= 10 else 'misses'} <= 10 us")
    if name == "prefill_16k":
        notes.append(f"{'meets' if med <= 20 else 'misses'} <= 20 us")
    return "; ".join(notes)


def render() -> str:
    newest = _newest("entries")
    if newest is None:
        raise SystemExit("no kernel results in benchmarks/results")
    path, data = newest
    m = data["meta"]
    lines = [INTRO, f"## Latest: {m['gpu']}, commit {m['commit']}, {m['date']}", ""]
    lines.append(
        f"driver {m['driver']}, torch {m['torch']}, triton {m['triton']}; copy bandwidth "
        f"{m.get('copy_bandwidth_tb_s', '?')} TB/s; one graph-replayed kernel {m.get('graph_kernel_us', '?')} us; "
        f"{m.get('steps_per_graph', '?')} steps per graph over {m.get('rotations', '?')} input sets. "
        f"Source: `{path.relative_to(HERE)}`."
    )
    if "tuning" in m:
        lines += ["", "Kernel tuning: " + ", ".join(f"{k}={v}" for k, v in m["tuning"].items()) + "."]
    lines += ["", TARGETS, "", f"![per-step time against verified entries]({PLOT})", ""]
    lines.append("| scenario | entries | median us | p20 | p80 | bytes | floor us | x floor | reference ms | target |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in data["records"]:
        lines.append(
            f"| {r['scenario']} | {r['entries']:,} | {r['median_us']:.2f} | {r['p20_us']:.2f} | {r['p80_us']:.2f} "
            f"| {r['bytes']:,} | {r['floor_us']:.2f} | {r['median_us'] / r['floor_us']:.2f} "
            f"| {r['reference_median_us'] / 1000:.2f} | {_verdict(r)} |"
        )
    lines += _host_section()
    return "\n".join(lines) + "\n"


def _host_section() -> list[str]:
    """Host (Python) time per step of the runtime on the GPU path (benchmarks/bench_host_step.py)."""
    hosts = []
    for f in sorted(HERE.glob("results/*.json")):
        d = json.loads(f.read_text())
        hosts += [(d["meta"], f, r) for r in d["records"] if str(r.get("scenario", "")).startswith("host_step")]
    if not hosts:
        return []
    date = max(m["date"] for m, _, _ in hosts)
    lines = ["", f"## Host time per step (`bench_host_step.py`), {date}", ""]
    lines.append("Target: at most 15 us of host (Python) work per step on the GPU path with graphs.")
    lines += ["", "| scenario | commit | median us | p20 | p80 | target | source |", "|---|---|---:|---:|---:|---|---|"]
    for m, f, r in hosts:
        if m["date"] != date:
            continue
        verdict = "meets" if r["median_us"] <= 15 else "misses"
        lines.append(
            f"| {r['scenario']} | {m['commit']} | {r['median_us']:.1f} | {r['p20_us']:.1f} | {r['p80_us']:.1f} "
            f"| {verdict} <= 15 us | `{f.relative_to(HERE)}` |"
        )
    return lines


def plot(out: Path) -> Path:
    """Median per-step time (p20..p80 bars) against verified entries per step, log-log, with each
    scenario's floor and the original canary's numbers; the prefill scenarios (no verified entries) sit
    at the left edge, labelled."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    newest = _newest("entries")
    if newest is None:
        raise SystemExit("no kernel results in benchmarks/results")
    path, data = newest
    records = data["records"]
    edge = min(r["entries"] for r in records if r["entries"] > 0) / 4  # where entries == 0 is drawn
    x = {r["scenario"]: max(r["entries"], edge) for r in records}
    fig = Figure(figsize=(9, 5.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    med = [r["median_us"] for r in records]
    err = [[m - r["p20_us"] for m, r in zip(med, records, strict=True)]]
    err.append([r["p80_us"] - m for m, r in zip(med, records, strict=True)])
    xs = [x[r["scenario"]] for r in records]
    ax.errorbar(
        xs, med, yerr=err, fmt="o", color="tab:blue", label=f"kvcanary (Triton, commit {data['meta']['commit']})"
    )
    ax.scatter(
        xs, [r["floor_us"] for r in records], marker="_", s=200, color="black", label="floor (bytes / bandwidth)"
    )
    orig = [(x[name], us) for name, us in ORIGINAL_US.items() if name in x]
    ax.scatter([p[0] for p in orig], [p[1] for p in orig], marker="x", color="tab:red", label="original sglang canary")
    labelled = [r for r in records if r["entries"] == 0 or r["scenario"] in ORIGINAL_US]
    for k, r in enumerate(labelled):
        nudge = -10 if r["entries"] or k % 2 == 0 else 5  # the two prefill points share an x
        where = (x[r["scenario"]], r["median_us"])
        ax.annotate(r["scenario"], where, xytext=(5, nudge), textcoords="offset points", fontsize="x-small")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"verified entries per step (prefill, no entries, drawn at {edge:g})")
    ax.set_ylabel("microseconds per step")
    ax.set_title(f"per-step canary time, {data['meta']['gpu']} ({path.name})")
    ax.grid(True, which="major", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=3)
    fig.savefig(out, format="png")
    return out


TOP_README = HERE.parent / "README.md"
TOP_START, TOP_END = "<!-- perf-table: generated by benchmarks/make_readme.py -->", "<!-- perf-table end -->"
TOP_SCENARIOS = ("decode_b1_p512", "decode_b32_p4k", "decode_b256_p16k", "prefill_16k", "window128_b128_p16k")


def top_table() -> str:
    """The top README's short table: a few scenarios of the newest results, beside the original canary."""
    newest = _newest("entries")
    if newest is None:
        raise SystemExit("no kernel results in benchmarks/results")
    path, data = newest
    m = data["meta"]
    lines = [
        TOP_START,
        f"{m['gpu']}, commit {m['commit']} (torch {m['torch']}, triton {m['triton']}; source "
        f"`benchmarks/{path.relative_to(HERE)}`), microseconds per step under graph replay:",
        "",
        "| scenario | kvcanary us | x floor | original canary us |",
        "|---|---:|---:|---:|",
    ]
    by_name = {r["scenario"]: r for r in data["records"]}
    for name in TOP_SCENARIOS:
        r = by_name.get(name)
        if r is not None:
            orig = ORIGINAL_US.get(name)
            lines.append(
                f"| {name} | {r['median_us']:.1f} | {r['median_us'] / r['floor_us']:.1f} | "
                f"{'-' if orig is None else f'{orig:,}'} |"
            )
    return "\n".join([*lines, TOP_END])


def write_top_table() -> None:
    text = TOP_README.read_text()
    if TOP_START not in text or TOP_END not in text:
        raise SystemExit(f"{TOP_README} has no {TOP_START!r} ... {TOP_END!r} block")
    head, rest = text.split(TOP_START, 1)
    tail = rest.split(TOP_END, 1)[1]
    TOP_README.write_text(head + top_table() + tail)


def main() -> None:
    (HERE / "README.md").write_text(render())
    print(f"wrote {HERE / 'README.md'}")
    write_top_table()
    print(f"wrote the performance table of {TOP_README}")
    try:
        print(f"wrote {plot(HERE / PLOT)}")
    except ImportError as exc:
        print(f"{PLOT} not redrawn (needs matplotlib: pip install 'matplotlib>=3.8'): {exc}")


if __name__ == "__main__":
    main()
