"""Regenerate benchmarks/README.md and the top README's performance table from the newest results file
(by its meta date), and the plot
(benchmarks/per_step_time.png: per-step time against verified entries, with the floor and the original
sglang canary's numbers; needs matplotlib, the ``plots`` extra -- without it the plot is left as it is).

Usage: python benchmarks/make_readme.py
"""

from __future__ import annotations

import json
from pathlib import Path

from digest_readme import digest_section
from host_readme import demo_section, host_section
from profile_readme import profile_section

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
move (table and lookup entries, records and same-step read marks of the verified entries; inputs, records
and marks of the written tokens; row lengths and plan outputs; results without a `mark_bytes` field left
the marks out); `floor` = max(bytes / measured copy bandwidth, one
graph-replayed kernel); `x floor` = median / floor; `reference` = eager reference step (ms).

Workload: every request's prefix is stamped and clean; each step verifies every prefix (or window)
and writes `extend` tokens per request.  Slots come in 64-slot runs in shuffled order (a paged
allocator); the window scenarios translate through a full->window lookup table that is a random
permutation, so their record gathers have no locality at all (a worst case).  The tables hold slots (page 1),
so the kernels never page a position here; engines' tables hold blocks, and `bench_kernels.py --page N` (or
`kernel_sweep.py --page N`) times the same scenarios with blocks of N slots (`bench_e2e.py` below is paged).

Also here: `bench_e2e.py` (the canary inside a CUDA-graphed Qwen3-0.6B-shaped model step, below),
`bench_host_step.py` (host time of `host_step` and of an eager `before_forward` + `after_forward`),
`bench_translate.py` (host time of the transformers adapter's translation per step, by batch shape),
`steady_coverage.py` (how many of the demo's steps reuse a kept translation, the translator laid out as on
CUDA, on any device), `step_instructions.py` (a steady translation step's instructions and simulated cache-line
misses under cachegrind: counts that repeat exactly, for host-path changes where wall-clock times are too noisy;
`results/cpu-instructions/`), `step_bytecodes.py` (the bytecodes and calls of each translation and host-batch capture
of the CPU demo, laid out as on CUDA, by kind of step: steady, a request joined, full; `results/cpu-bytecodes/`),
`bench_vllm_host.py` (the vLLM adapter's host time per step on the CPU engine), `bench_digest.py` (the KV
digest, below), `kernel_sweep.py` (the goal scenarios under every combination of a grid of `KernelTuning`
fields, or a hand-picked list: `results/*-kernel-sweep.txt`, older runs `*-sweep.txt`), `digest_sweep.py`
(the digest's tile and grid, and with `--steps` its small-launch fields), `digest_mix_probe.py` (the
digest's mixing alone) and `latency_probe.py` (one graph-replayed launch and one dependent load in L2 and
in DRAM: the two terms of a small step's latency) and `canary_graph_profile.py` (the canary's
before/after graph of `bench_e2e.py`'s points, node by node under torch's profiler).
The kernel, digest, end-to-end, host-step, sweep and probe scripts store their results through
`bench_common`'s `result_path` / `save_result`, named `<gpu>-<commit><suffix>`; `digest_readme.py`,
`host_readme.py` and `profile_readme.py` render the digest, host-time and where-the-time-goes sections of this page.
"""

TARGETS = (
    "Targets (the project's performance bar): at most 2x floor for every scenario with >= 1M verified entries; at most "
    "10 us per step for decode batches up to 32 at prefix up to 4k; a 16k-token chunk stamped in at most 20 us."
)


def _newest(scenario_key: str) -> tuple[Path, dict] | None:
    """The newest results file (by meta date) holding records with ``scenario_key`` and a kernel floor (the
    host-step results also count entries)."""
    loaded = [(f, json.loads(f.read_text())) for f in sorted(HERE.glob("results/*.json"))]
    loaded = [(f, d) for f, d in loaded if any(scenario_key in r and "floor_us" in r for r in d["records"])]
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
    lines += _e2e_section()
    lines += profile_section()
    lines += demo_section()
    lines += host_section()
    lines += digest_section()
    return "\n".join(lines) + "\n"


E2E_INTRO = (
    "`bench_e2e.py`: a Qwen3-0.6B-shaped model (transformers' modelling code, random bf16 weights, `sdpa`, a "
    "static KV cache) captured in one CUDA graph per step, with and without the canary's before/after_forward; "
    "the canary's tables as a paged engine's (shuffled 16-slot pages, ground truth on). `step` = the graphed "
    "step alone; `added` = (step with the canary) - step; `canary` = the canary's before/after alone, one graph; "
    "`host_step` outside the graph. `share` = added / step (goal < 1 %); `roofline` = (weight bytes + KV bytes "
    "read) / copy bandwidth of the same run (a prefill chunk: its matmul FLOPs / the measured bf16 rate when "
    "larger); `roofline share` = canary / roofline (goal < 1 % at batch >= 32, <= 2 % at batch 1). The original "
    "sglang canary reports about 10 % of a decode step at batch 1 and about 19 % of a 16k prefill on this model "
    "size (its authors' end-to-end figures)."
)


def _e2e_goal(r: dict) -> str:
    share_ok = r["share_pct"] < 1
    roof_goal = 2.0 if r["batch"] == 1 else 1.0
    roof_ok = r["roofline_share_pct"] <= roof_goal if r["batch"] == 1 else r["roofline_share_pct"] < roof_goal
    sign = "<=" if r["batch"] == 1 else "<"
    return (
        f"share {'meets' if share_ok else 'misses'} < 1 %; roofline share {'meets' if roof_ok else 'misses'} "
        f"{sign} {roof_goal:g} %"
    )


def _newest_e2e() -> tuple[Path, dict] | None:
    loaded = [(f, json.loads(f.read_text())) for f in sorted(HERE.glob("results/*.json"))]
    loaded = [(f, d) for f, d in loaded if any(str(r.get("scenario", "")).startswith("e2e_") for r in d["records"])]
    return max(loaded, key=lambda fd: fd[1]["meta"]["date"]) if loaded else None


def _e2e_section() -> list[str]:
    newest = _newest_e2e()
    if newest is None:
        return []
    path, data = newest
    m = data["meta"]
    lines = ["", f"## Inside a CUDA-graphed model step (`bench_e2e.py`): {m['gpu']}, commit {m['commit']}, {m['date']}"]
    lines += ["", E2E_INTRO, ""]
    lines.append(
        f"driver {m['driver']}, torch {m['torch']}, triton {m['triton']}, transformers {m.get('transformers', '?')}; "
        f"copy bandwidth {m['copy_bandwidth_tb_s']} TB/s, bf16 matmul {m['bf16_matmul_tflop_s']} TFLOP/s; weights "
        f"{m['weight_bytes'] / 1e9:.2f} GB, KV {m['kv_bytes_per_token']:,} B per token; median of {m['replays']} "
        f"interleaved replays. Source: `{path.relative_to(HERE)}`. Points whose KV cache would exceed 64 GiB are "
        "left out."
    )
    lines += [
        "",
        "| scenario | step ms | added us | canary us | host_step us | share % | roofline ms | roofline share % "
        "| goal |",
    ]
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in data["records"]:
        lines.append(
            f"| {r['scenario']} | {r['step_us'] / 1000:.2f} | {r['added_us']:.1f} | {r['canary_us']:.1f} "
            f"| {r['host_step_us']:.1f} | {r['share_pct']:.2f} | {r['roofline_us'] / 1000:.3f} "
            f"| {r['roofline_share_pct']:.2f} | {_e2e_goal(r)} |"
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
    return "\n".join([*lines, *_top_e2e(), TOP_END])


TOP_E2E = ("e2e_decode_b1_p512", "e2e_decode_b32_p4k", "e2e_decode_b128_p4k", "e2e_prefill_16k")


def _top_e2e() -> list[str]:
    """A few points of the newest bench_e2e run: the canary inside a graphed Qwen3-0.6B-shaped step."""
    newest = _newest_e2e()
    if newest is None:
        return []
    path, data = newest
    lines = [
        "",
        f"Inside a CUDA-graphed step of a Qwen3-0.6B-shaped model (transformers, commit {data['meta']['commit']}, "
        f"source `benchmarks/{path.relative_to(HERE)}`; the original canary: about 10 % of a decode step at batch 1, "
        "about 19 % of a 16k prefill):",
        "",
        "| point | model step ms | canary us | share of the step % | share of the step's memory roofline % |",
        "|---|---:|---:|---:|---:|",
    ]
    by_name = {r["scenario"]: r for r in data["records"]}
    for name in TOP_E2E:
        r = by_name.get(name)
        if r is not None:
            lines.append(
                f"| {name[4:]} | {r['step_us'] / 1000:.2f} | {r['canary_us']:.1f} | {r['share_pct']:.2f} "
                f"| {r['roofline_share_pct']:.2f} |"
            )
    return lines


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
