"""The KV digest's section of benchmarks/README.md (``make_readme.py`` calls :func:`digest_section`): the newest
``results/*-digest.json`` by its meta date, beside the one before it."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASELINE = "c5d5e79"  # the digest kernels before the [heads, slots, words] rewrite

INTRO = (
    "`bench_digest.py`: the KV digest (`docs/design.md` §12) on a Qwen3-0.6B-shaped pool (28 layers x 8 KV heads x "
    "128 bf16, 114,688 bytes a slot), CUDA-graph medians. Throughput rows: one list call over 16,384 slots "
    "(runs of consecutive slots or scattered); `GB/s` = bytes digested per second, `% copy` = against the run's "
    "device copy (bytes read + written per second; goal >= 60 %). Step rows: one engine step's digest work at the "
    "default budget (1/256) or 1.0: `us` is the one fused call after the forward (transformers, sglang); the verify "
    "and stamp are also timed alone and as two calls in a row (`split`, vLLM's schedule, where recorded); all against "
    "two references measured in the "
    "same run: the step's attention (PyTorch SDPA over all 28 layers, contiguous KV, graph-replayed: `% attn`, the "
    "goal is <= 2 % at the default budget) and its KV bytes read once at the copy's rate (`% KV read`). Results "
    "before commit 98b7195 took the KV read at half the copy's rate, which halved their shares; the `us before` "
    "column compares times only."
)


def _digest_files() -> list[tuple[Path, dict]]:
    loaded = [(f, json.loads(f.read_text())) for f in sorted(HERE.glob("results/*-digest.json"))]
    return sorted(loaded, key=lambda fd: fd[1]["meta"]["date"])


def _row(r: dict, before: dict | None) -> str:
    was = f"{before['us']:,.1f}" if before else ""
    split = f" (split {r['split_us']:,.1f})" if "split_us" in r else ""
    if "attention_us" not in r:
        return f"| {r['scenario']} | {r['us']:,.1f} | {r['gbps']:,.1f} | {r.get('pct_of_copy', '')} | | | | | {was} |"
    return (
        f"| {r['scenario']} | {r['us']:,.1f} | {r['gbps']:,.1f} | | {r['verify_us']:,.1f} / {r['stamp_us']:,.1f}"
        f"{split} | "
        f"{r['attention_us']:,.1f} | {r['pct_of_attention']} | {r['pct_of_kv_read']} | {was} |"
    )


def digest_section() -> list[str]:
    files = _digest_files()
    if not files:
        return []
    path, data = files[-1]
    m = data["meta"]
    base = next((d for _, d in files if d["meta"]["commit"] == BASELINE), files[0][1])
    before = {r["scenario"]: r for r in base["records"]}
    lines = ["", f"## KV digest (`bench_digest.py`): {m['gpu']}, commit {m['commit']}, {m['date']}", "", INTRO, ""]
    tuning = ", ".join(f"{k}={v}" for k, v in m.get("tuning", {}).items())
    lines.append(
        f"driver {m['driver']}, torch {m['torch']}, triton {m['triton']}; copy {m['copy_bandwidth_tb_s']} TB/s; "
        f"tuning {tuning}. Source: `{path.relative_to(HERE)}`; before: commit {base['meta']['commit']}."
    )
    head = "| scenario | us | GB/s | % copy | verify / stamp us | attention us | % attn | % KV read | us before |"
    lines += ["", head, "|---|" + "---:|" * 8]
    lines += [_row(r, before.get(r["scenario"])) for r in data["records"]]
    return lines
