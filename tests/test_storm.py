"""A violation storm through the real engine (transformers continuous batching on CPU, ``log`` mode).

From the second verified step on, every record of the pool is overwritten with random garbage just
before the engine runs the step, so every context slot any request reads is corrupt, every step,
for the whole run.  The engine must keep serving (every request returns all its tokens); each
step's report must hold the device log's exact count and its first K and last K rows; the host time
per step must not grow over the storm; log output must be rate-limited with a count of what was
suppressed; the event log must stay under its cap.  The independent count is the scheduler's own
view of each step (``HostBatch.past_lens``: the context tokens each request reads), taken before the
engine runs it.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")


from kvcanary import CanaryConfig, Mode
from kvcanary.adapters.transformers_cb import install
from kvcanary.adapters.transformers_cb.adapter import TransformersCBAdapter
from kvcanary.demo import build_model, build_prompts
from log_capture import Messages
from storm_probe import STORM_FROM, StormProbe

REQUESTS = 32
NEW_TOKENS = 24
LOG_ROWS = 4  # K: the device log keeps the first 4 and the last 4 rows of a step
RATE_PER_S = 2.0
EVENTS_CAP = 24 << 10
TIME_GROWTH = 3.0  # last quarter's median host_step time / first quarter's: bounded, whatever the rows seen


@pytest.fixture(scope="module")
def storm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    events = tmp_path_factory.mktemp("storm") / "events.jsonl"
    config = CanaryConfig(
        mode=Mode.LOG, log_rows=LOG_ROWS, log_rate_limit_per_s=RATE_PER_S, events_path=str(events),
        events_max_bytes=EVENTS_CAP,
    )  # fmt: skip
    model = build_model("dense")
    handler = Messages()
    kv_logger, tf_logger = logging.getLogger("kvcanary"), logging.getLogger("transformers")
    kv_logger.addHandler(handler)
    tf_level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    host_step_us: list[int] = []
    adapter: TransformersCBAdapter | None = None

    def on_step(step: int, _: object) -> None:
        assert adapter is not None
        host_step_us.append(adapter.stats()["tap_host_step_us"])

    try:
        adapter = install(model, config, max_kept_reports=10_000, on_step=on_step)
        probe = StormProbe(adapter)
        adapter.set_input_probe(probe)
        gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1)
        cb = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=64, max_requests_per_batch=8)
        outputs = model.generate_batch(build_prompts(REQUESTS), generation_config=gen, continuous_batching_config=cb)
        adapter.flush()
        manager = adapter.manager
        assert manager is not None
        held_back = manager._decoder._log_limiter.suppressed  # after flush: nothing held back is left unsaid
        adapter.uninstall()
    finally:
        kv_logger.removeHandler(handler)
        tf_logger.setLevel(tf_level)
    return {
        "outputs": outputs, "adapter": adapter, "probe": probe, "messages": handler.messages,
        "events": events, "host_step_us": host_step_us, "held_back": held_back,
    }  # fmt: skip


def test_the_engine_keeps_serving_every_request(storm: dict[str, Any]) -> None:
    outputs = storm["outputs"]
    assert len(outputs) == REQUESTS
    for rid, out in outputs.items():
        assert out.error is None and len(out.generated_tokens) == NEW_TOKENS, rid
    stats = storm["adapter"].stats()
    assert stats["adapter_errors"] == 0 and stats["hook_misses"] == 0 and stats["skipped_entries"] == 0


def test_every_corrupt_read_is_counted_exactly(storm: dict[str, Any]) -> None:
    probe, adapter = storm["probe"], storm["adapter"]
    by_step = {r.step: r for r in adapter.reports}
    storm_steps = sorted(probe.expected)
    assert len(storm_steps) > 20, "the storm is too short to show anything"
    reading = [s for s in storm_steps if probe.expected[s]]
    assert sorted(by_step) == reading, "a storm step with reads got no report, or a clean step got one"
    for step in reading:
        assert by_step[step].total == len(probe.expected[step]), step
        assert by_step[step].group_counts == {"full_attention": len(probe.expected[step])}
    total = sum(len(e) for e in probe.expected.values())
    assert total > 5_000
    assert adapter.stats()["violations"] == total


def test_each_report_keeps_the_first_and_the_last_rows_of_its_step(storm: dict[str, Any]) -> None:
    probe, adapter = storm["probe"], storm["adapter"]
    long_steps = 0
    for report in adapter.reports:
        expected = probe.expected[report.step]
        kept = expected if len(expected) <= 2 * LOG_ROWS else expected[:LOG_ROWS] + expected[-LOG_ROWS:]
        assert [(v.batch_row, v.expected_position) for v in report.violations] == kept, report.step
        assert report.rows_dropped == len(expected) - len(kept)
        ids = probe.request_ids[report.step]
        assert all(v.request_id == ids[v.batch_row] and v.phase == "verify" for v in report.violations)
        assert set(report.affected_request_ids) <= set(ids)
        long_steps += len(expected) > 2 * LOG_ROWS
    assert long_steps > 20


def test_host_time_per_step_does_not_grow_over_the_storm(storm: dict[str, Any]) -> None:
    cumulative = storm["host_step_us"]
    per_step = [b - a for a, b in itertools.pairwise(cumulative)][STORM_FROM + 1 :]
    quarter = len(per_step) // 4
    assert quarter >= 5
    first, last = statistics.median(per_step[:quarter]), statistics.median(per_step[-quarter:])
    assert last <= TIME_GROWTH * max(first, 1), (first, last)


def test_log_output_is_rate_limited_and_says_what_it_suppressed(storm: dict[str, Any]) -> None:
    reports = storm["adapter"].stats()["reports"]
    headers = [m for m in storm["messages"] if re.match(r"kvcanary: \d+ violation\(s\) at step", m)]
    lines = [m for m in storm["messages"] if m.startswith("kvcanary violation: ")]
    notes = r"\((\d+) earlier (?:violation )?report\(s\) suppressed by the rate limit\)"
    suppressed = [int(n) for m in storm["messages"] for n in re.findall(notes, m)]
    assert 1 <= len(headers) < reports / 2, (len(headers), reports)
    assert len(lines) <= len(headers) * 2 * LOG_ROWS  # rows are logged only with their logged report
    # Every report was either logged or counted in a later note (the last one at flush): none unaccounted.
    assert len(headers) + sum(suppressed) == reports and storm["held_back"] == 0


def test_the_event_log_stays_under_its_cap_and_holds_the_newest_steps(storm: dict[str, Any]) -> None:
    path: Path = storm["events"]
    old = Path(str(path) + ".1")
    assert path.stat().st_size <= EVENTS_CAP and old.stat().st_size <= EVENTS_CAP
    events = [json.loads(line) for p in (old, path) for line in p.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    last = storm["adapter"].reports[-1]
    assert steps[-1]["step"] == last.step and steps[-1]["total"] == last.total
    assert steps[-1]["rows_kept"] == len(last.violations) and steps[-1]["rows_dropped"] == last.rows_dropped
    assert [e["step"] for e in steps] == sorted(e["step"] for e in steps)
