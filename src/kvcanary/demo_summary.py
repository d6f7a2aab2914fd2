"""``kvcanary demo``'s text summary of a :class:`~kvcanary.demo.DemoResult`: the workload, the clean run with the
engine features it exercised and the canary's host time (and, with ``--baseline``, its share of step time), the
faulted run with its first report, and the verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcanary.adapters.transformers_cb.selftest.workload import DEMO_NUM_BLOCKS, PAGE_SIZE, SLIDING_WINDOW
from kvcanary.build_info import build_name, compiled_step_path
from kvcanary.demo_timing import host_time_lines, timing_lines

if TYPE_CHECKING:
    from kvcanary.demo import DemoResult, RunResult


def _features_line(kind: str, f: dict[str, int]) -> str:
    parts = []
    if kind == "dense":
        parts.append(f"prefix hits {f['prefix_hits']} ({f['prefix_tokens']:,} tokens)")
        parts.append(f"cached block reuse {f['cached_block_reuse']}")
        parts.append(f"in-place de-dup {f['dedup_swaps']}")
    else:
        parts.append("prefix sharing n/a (transformers disables it with a sliding group)")
    parts.append(f"forks {f['forks']} ({f['fork_block_copies']} block copies)")
    parts.append(f"offloads {f['offloads']} / restores {f['restores']}")
    if kind != "dense":
        parts.append(f"ring wrap-arounds {f['ring_wraps']:,}")
    return "; ".join(parts)


def summary(result: DemoResult) -> str:
    o, c, x = result.options, result.clean, result.faulted
    lines = [
        f"kvcanary demo: {o.model} model ({_model_desc(o.model)}, random weights), transformers {result.engine}, "
        f"device {o.device}, canary backend {o.backend.value}"
        + (f", {build_name()}" if compiled_step_path() else "")
        + (", asynchronous batching" if o.async_batching else "")
        + (", CUDA graphs" if o.cuda_graphs else ""),
        f"workload: {o.requests} prompts (mixed lengths, shared prefixes), then {o.follow_up} more on the same "
        "engine, x 2 sampled sequences, "
        f"{o.new_tokens} new tokens, page {PAGE_SIZE}, {DEMO_NUM_BLOCKS[o.model]} blocks, CPU offload on",
        "",
        f"clean run: {c.stats['steps']:,} steps, {c.stats['verified_slots']:,} slots verified, "
        f"{c.stats['stamped']:,} stamped, {c.stats['violations']} violations "
        f"({c.seconds:.1f} s{_steps_part(c)}, {c.outputs} sequences)",
        f"  engine features exercised: {_features_line(o.model, c.features)}",
    ]
    if c.stats["steps"]:
        lines.extend(host_time_lines(c.stats, c.features))
    lines.extend(timing_lines(result.timing, result.timed_stats))
    lines.append("")
    inj = x.injected
    if inj is None:
        lines.append(f"faulted run ({o.fault}): no step was eligible for the fault; nothing was injected")
    else:
        lines.append(f"faulted run ({o.fault}): at step {inj.step}, request {x.injected_request!r}: {inj.detail}")
        if x.detected:
            lines.append(
                f"  caught at step {x.first_detection_step} ({x.stats['violations']} violation rows over the run); "
                "the first report:"
            )
            first = x.first_report()
            assert first is not None  # detected
            lines.extend("  " + line for line in first.block().splitlines())
        else:
            lines.append(f"  NOT caught ({x.stats['violations']} violation rows)")
    lines.append("")
    if result.passed:
        lines.append("result: PASS (the clean run raised no violation and the injected fault was caught)")
    else:
        why = []
        if c.stats["violations"]:
            why.append(f"the clean run raised {c.stats['violations']} violations")
        if result.timed_violations:
            why.append(f"the timed clean runs raised {result.timed_violations} violations")
        if not x.detected:
            why.append("the injected fault was not caught")
        if not c.stats["steps"]:
            why.append("the canary verified no step")
        lines.append("result: FAIL (" + "; ".join(why) + ")")
    return "\n".join(lines)


def _steps_part(run: RunResult) -> str:
    return "" if run.step_seconds is None else f", of which the engine's steps {run.step_seconds:.1f} s"


def _model_desc(kind: str) -> str:
    return {
        "dense": "Llama, 2 full-attention layers",
        "hybrid": f"Qwen2, 1 sliding-window (W={SLIDING_WINDOW}) + 1 full-attention layer",
        "sliding": f"Mistral, 2 sliding-window layers (W={SLIDING_WINDOW})",
    }[kind]
