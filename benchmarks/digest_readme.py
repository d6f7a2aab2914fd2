"""The KV digest's section of benchmarks/README.md (``make_readme.py`` calls :func:`digest_section`): the newest
``results/*-digest.json`` by its meta date, beside the one before it."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASELINE = "c5d5e79"  # the digest kernels before the [heads, slots, words] rewrite

INTRO = (
    "`bench_digest.py`: the KV digest (`docs/design.md` §12) on a Qwen3-0.6B-shaped pool (28 layers x 8 KV heads x "
    "128 bf16, 114,688 bytes a slot), CUDA-graph medians. `stamp`/`verify` rows: one list call over 16,384 slots "
    "(runs of consecutive slots or scattered); `GB/s` = bytes digested per second, `% copy` = against the run's "
    "device copy (bytes read + written per second; goal >= 60 %). `step` rows: one engine step's digest work at the "
    "default budget (1/256) or 1.0; `% KV read` = its time against the step's attention reading its KV once at "
    "half the copy rate (goal <= 2 % at the default budget)."
)


def _digest_files() -> list[tuple[Path, dict]]:
    loaded = [(f, json.loads(f.read_text())) for f in sorted(HERE.glob("results/*-digest.json"))]
    return sorted(loaded, key=lambda fd: fd[1]["meta"]["date"])


def _cells(rec: dict | None) -> str:
    if rec is None:
        return " | | |"
    share = rec.get("pct_of_copy", rec.get("pct_of_kv_read"))
    return f" {rec['us']:,.1f} | {rec['gbps']:,.1f} | {share} |"


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
    lines += ["", "| scenario | us | GB/s | % copy or % KV read | us before | GB/s | % |", "|---|" + "---:|" * 6]
    for r in data["records"]:
        lines.append(f"| {r['scenario']} |{_cells(r)}{_cells(before.get(r['scenario']))}")
    return lines
