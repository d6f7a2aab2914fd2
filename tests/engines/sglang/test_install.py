"""Install flow on real sglang objects: refusals, re-entrancy, init switch, bounds, MLA, EAGLE target/draft."""

from __future__ import annotations

import types

import pytest
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.eagle_info import EagleVerifyInput
from sglang_harness import Engine
from sglang_model import DTYPE, HEAD_DIM, HEADS, TinyModel, TinyRunner, WriteOnlyModel, make_forward_batch, server_args

from kvcanary.adapters.sglang import SUPPORTED_POOLS, install_canary, options_from_args
from kvcanary.runtime import CanaryViolation


def _mha(size: int = 64, layers: int = 1) -> MHATokenToKVPool:
    return MHATokenToKVPool(size, 1, DTYPE, HEADS, HEAD_DIM, layer_num=layers, device="cpu", enable_memory_saver=False)


def _rtp(rows: int = 3, ctx: int = 64) -> ReqToTokenPool:
    return ReqToTokenPool(size=rows, max_context_len=ctx, device="cpu", enable_memory_saver=False)


# --------------------------------------------------------------------------- options and refusals


def test_options_map_to_config_and_refuse_unknown_values() -> None:
    opts = options_from_args(types.SimpleNamespace(kv_canary="fail-request", kv_canary_log_rows=8))
    assert opts.config.mode.value == "fail-request" and opts.config.log_rows == 8
    assert not options_from_args(types.SimpleNamespace()).enabled  # flags never registered: off
    with pytest.raises(ValueError, match="none, log, raise, fail-request"):
        options_from_args(types.SimpleNamespace(kv_canary="on"))
    with pytest.raises(TypeError, match="kv_canary_log_rows"):
        options_from_args(types.SimpleNamespace(kv_canary="log", kv_canary_log_rows="8"))


def test_mode_none_installs_nothing() -> None:
    runner = TinyRunner(_rtp(), _mha(), TinyModel(), server_args(kv_canary="none"))
    assert install_canary(runner) is None
    assert "forward" not in vars(runner.model) and "forward" not in vars(runner)
    assert install_canary(runner, server_args(kv_canary="log")) is not None  # the pool was left free


def test_unknown_pool_class_and_subclasses_are_refused_with_the_supported_list() -> None:
    class PatchedLayoutPool(MHATokenToKVPool):
        pass

    for pool in (_rtp(), PatchedLayoutPool(64, 1, DTYPE, HEADS, HEAD_DIM, 1, "cpu", False)):
        runner = TinyRunner(_rtp(), pool, TinyModel(), server_args())
        with pytest.raises(TypeError, match="supported: " + ", ".join(SUPPORTED_POOLS)):
            install_canary(runner)
        assert "forward" not in vars(runner.model)


def test_second_attach_is_refused_until_uninstall() -> None:
    pool, rtp = _mha(), _rtp()
    first = install_canary(TinyRunner(rtp, pool, TinyModel(), server_args()))
    assert first is not None
    other = TinyRunner(rtp, pool, TinyModel(), server_args())
    with pytest.raises(ValueError, match="already attached"):
        install_canary(other)
    model = first.runner.model
    first.uninstall()
    first.uninstall()  # idempotent
    assert "forward" not in vars(model) and "forward" not in vars(first.runner)
    assert install_canary(other) is not None


def test_window_pool_needs_the_sliding_window_size() -> None:
    eng = Engine(window=8, swa_size=40, pool_size=96, radix=False, mode="none")
    runner = TinyRunner(eng.rtp, eng.pool, TinyModel(), server_args(), sliding_window_size=None)
    with pytest.raises(ValueError, match="sliding_window_size"):
        install_canary(runner)


# --------------------------------------------------------------------------- bracket, init switch, bounds


class NestedModel(TinyModel):
    """A VLM-like model whose forward calls the (patched) forward again for its language model."""

    def forward(self, input_ids, positions, forward_batch, inner: bool = False):
        if not inner:
            return self.forward(input_ids, positions, forward_batch, inner=True)
        return super().forward(input_ids, positions, forward_batch)


def test_only_the_outermost_forward_brackets() -> None:
    eng = Engine(pool_size=96, rows=2, model=NestedModel())
    eng.submit("a", list(range(1, 20)), max_new=4)
    eng.run()
    f = eng.canary.features()
    assert f["nested_forwards"] == f["forwards"] == eng.runner.forward_calls > 0
    assert eng.canary.stats()["forwards"] == f["forwards"]  # one before/after pair per engine forward
    assert eng.canary.stats()["violations"] == 0


def test_forwards_before_init_finished_are_not_checked() -> None:
    eng = Engine(pool_size=96, rows=2, init_finished=False)
    eng.submit("warmup", [1, 2, 3, 4], max_new=1)  # a dummy warm-up request
    eng.run()
    assert eng.canary.features()["skipped_before_init"] == eng.runner.forward_calls == 1
    assert eng.canary.stats()["forwards"] == 0
    eng.canary.mark_init_finished()
    eng.submit("a", list(range(5, 30)), max_new=5)
    eng.run()
    assert eng.canary.stats()["forwards"] > 0 and eng.canary.stats()["violations"] == 0


def test_out_of_pool_table_entry_is_a_violation_not_a_canary_fault() -> None:
    eng = Engine(pool_size=96, rows=2)
    a = eng.submit("a", list(range(1, 20)), max_new=20)
    while a.cached <= a.prompt_len:
        eng.step()
    good = int(eng.rtp.req_to_token[a.row, 3])
    eng.rtp.req_to_token[a.row, 3] = 10**6
    with pytest.raises(IndexError):  # the engine's own attention read faults; the canary did not
        eng.step()
    eng.rtp.req_to_token[a.row, 3] = good
    with pytest.raises(CanaryViolation) as excinfo:
        eng.run()
    vs = excinfo.value.report.violations
    oob = [v for v in vs if "slot_out_of_range" in v.reasons]
    assert oob and oob[0].request_id == "a" and oob[0].bad_index == 10**6


def test_batch_over_capacity_is_refused_before_any_state_changes() -> None:
    eng = Engine(pool_size=96, rows=2, chunk=16)
    canary = eng.canary
    n = canary.translator.max_tokens + 1
    fb = make_forward_batch(
        ForwardMode.EXTEND, [1], [0], [n], [1] * n, range(n), torch.zeros(n, dtype=torch.int64), ["x"]
    )
    before = canary.manager.canaries["full"].records.links.clone()
    with pytest.raises(ValueError, match="max_tokens"):
        canary.before_forward(fb)
    assert torch.equal(before, canary.manager.canaries["full"].records.links)


# --------------------------------------------------------------------------- MLA pool


def test_mla_pool_clean_then_corrupted_table_entry() -> None:
    rtp = _rtp()
    pool = MLATokenToKVPool(
        64, 1, DTYPE, kv_lora_rank=16, qk_rope_head_dim=8, layer_num=1, device="cpu", enable_memory_saver=False
    )
    alloc = TokenToKVPoolAllocator(64, DTYPE, "cpu", pool, need_sort=False)
    runner = TinyRunner(rtp, pool, WriteOnlyModel(mla=True), server_args())
    canary = install_canary(runner)
    canary.mark_init_finished()
    rows = rtp.alloc_rows(2)
    lens = [7, 5]
    loc = alloc.alloc(sum(lens))
    rtp.write((rows[0], slice(0, 7)), loc[:7].to(torch.int32))
    rtp.write((rows[1], slice(0, 5)), loc[7:].to(torch.int32))
    ids = list(range(10, 17)) + list(range(40, 45))
    pos = list(range(7)) + list(range(5))
    runner.forward(make_forward_batch(ForwardMode.EXTEND, rows, [0, 0], lens, ids, pos, loc, ["p", "q"]))
    for step in range(3):
        prefix = [7 + step, 5 + step]
        loc = alloc.alloc(2)
        for r, p, s in zip(rows, prefix, loc.tolist(), strict=True):
            rtp.req_to_token[r, p] = s
        if step == 2:
            rtp.req_to_token[rows[1], 2] = rtp.req_to_token[rows[0], 2]
        runner.forward(make_forward_batch(ForwardMode.DECODE, rows, prefix, [1, 1], [3, 4], prefix, loc, ["p", "q"]))
        assert canary.last_report is None
    with pytest.raises(CanaryViolation) as excinfo:
        canary.flush()
    assert {v.request_id for v in excinfo.value.report.violations} == {"q"}


# --------------------------------------------------------------------------- EAGLE: target verify and draft


def _verify_input(k: int, seq: int) -> EagleVerifyInput:
    z = torch.zeros(k, dtype=torch.int64)
    return EagleVerifyInput(
        draft_token=z,
        custom_mask=torch.ones(k, dtype=torch.bool),
        positions=z,
        retrieve_index=z,
        retrieve_next_token=z,
        retrieve_next_sibling=z,
        retrieve_cum_len=z,
        spec_steps=k - 1,
        topk=1,
        draft_token_num=k,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=seq,
        seq_lens_cpu=torch.tensor([seq]),
    )


class Eagle:
    """Target and draft runners sharing the request table and allocator, each with its own KV pool."""

    def __init__(self, k: int = 3, draft_mode: str = "raise") -> None:
        self.k = k
        self.rtp = _rtp(2, 96)
        self.target_pool, self.draft_pool = _mha(128), _mha(128)
        self.alloc = TokenToKVPoolAllocator(128, DTYPE, "cpu", self.target_pool, need_sort=False)
        sa = server_args(speculative_num_draft_tokens=k)
        self.target = TinyRunner(self.rtp, self.target_pool, WriteOnlyModel(), sa)
        self.draft = TinyRunner(
            self.rtp, self.draft_pool, WriteOnlyModel(), server_args(kv_canary=draft_mode), is_draft_worker=True
        )
        self.tc, self.dc = install_canary(self.target), install_canary(self.draft)
        self.tc.mark_init_finished()
        self.dc.mark_init_finished()
        self.row = self.rtp.alloc_rows(1)[0]
        self.tokens = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
        self.cached = 0

    def _slots(self, start: int, stop: int) -> torch.Tensor:
        return self.rtp.req_to_token[self.row, start:stop].to(torch.int64).clone()

    def run(self, runner, fb) -> None:
        runner.forward(fb)  # the patched ModelRunner.forward runs the canary's host step after the forward

    def prefill(self) -> None:
        n = len(self.tokens)
        loc = self.alloc.alloc(n)
        self.rtp.write((self.row, slice(0, n)), loc.to(torch.int32))
        self.tokens.append(21)  # the bonus token sampled by the target's prefill
        fb = make_forward_batch(ForwardMode.EXTEND, [self.row], [0], [n], self.tokens[:n], range(n), loc, ["e"])
        self.run(self.target, fb)
        # The draft's KV at position p holds the token of position p + 1.
        fb = make_forward_batch(ForwardMode.EXTEND, [self.row], [0], [n], self.tokens[1 : n + 1], range(n), loc, ["e"])
        self.run(self.draft, fb)
        self.cached = n

    def round(self, accept: int, draft_position_bug: bool = False) -> None:
        k, seq = self.k, self.cached
        loc = self.alloc.alloc(k)
        self.rtp.write((self.row, slice(seq, seq + k)), loc.to(torch.int32))
        drafts = [(self.tokens[-1] * 3 + j) % 97 for j in range(1, k)]
        for j in range(k - 1):  # draft decode steps: seq_lens stays un-bumped, positions advance
            fb = make_forward_batch(
                ForwardMode.DECODE, [self.row], [seq], [0], [drafts[j]], [seq + j], loc[j : j + 1], ["e"]
            )
            fb.seq_lens = torch.tensor([seq])
            self.run(self.draft, fb)
        ids = [self.tokens[seq], *drafts]
        fb = make_forward_batch(
            ForwardMode.TARGET_VERIFY,
            [self.row],
            [seq],
            [0],
            ids,
            range(seq, seq + k),
            loc,
            ["e"],
            spec_info=_verify_input(k, seq),
        )
        fb.seq_lens = torch.tensor([seq])  # committed length; the k draft tokens come on top
        self.run(self.target, fb)
        self.tokens[seq + 1 :] = drafts[:accept]
        self.tokens.append((self.tokens[-1] * 7 + 5) % 97)  # the new bonus token
        self.alloc.free(loc[accept + 1 :])
        new = seq + accept + 1
        positions = list(range(seq, new))
        if draft_position_bug:
            positions = [p + 1 for p in positions]
        fb = make_forward_batch(
            ForwardMode.DRAFT_EXTEND_V2,
            [self.row],
            [seq],
            [accept + 1],
            self.tokens[seq + 1 : new + 1],
            positions,
            self._slots(seq, new),
            ["e"],
        )
        self.run(self.draft, fb)
        self.cached = new


def test_eagle_target_verify_and_draft_extend_are_clean_and_separately_counted() -> None:
    e = Eagle()
    e.prefill()
    for i in range(5):
        e.round(accept=i % 3)
    e.tc.flush()
    e.dc.flush()
    assert e.tc.last_report is None and e.dc.last_report is None
    tf, df = e.tc.features(), e.dc.features()
    assert tf["target_verify_forwards"] == 5 and tf["extend_forwards"] == 1 and tf["decode_forwards"] == 0
    assert df["draft_extend_forwards"] == 5 and df["decode_forwards"] == 10 and df["target_verify_forwards"] == 0
    assert e.tc.stats()["forwards"] == 6 and e.dc.stats()["forwards"] == 16
    assert e.tc.stats()["verified_slots"] > 0 and e.dc.stats()["verified_slots"] > 0
    assert [g.token_offset for g in e.dc.attached.groups] == [1] and e.dc.attached.groups[0].name == "draft-full"
    assert [g.token_offset for g in e.tc.attached.groups] == [0]


def test_a_draft_worker_fault_is_reported_by_the_draft_canary_only() -> None:
    e = Eagle(draft_mode="log")
    e.prefill()
    e.round(accept=1)
    e.round(accept=2, draft_position_bug=True)  # the draft extend writes its tokens one position late
    e.round(accept=0)
    e.tc.flush()
    e.dc.flush()
    assert e.tc.last_report is None and e.tc.stats()["violations"] == 0
    reports = list(e.dc.recent_reports)
    assert reports and all(r.affected_request_ids == ("e",) for r in reports)
    vs = [v for r in reports for v in r.violations]
    assert all(v.group == "draft-full" for v in vs)
    assert any("write_position_mismatch" in v.reasons and v.phase == "stamp" for v in vs)


def test_registry_loads_the_installer_and_the_handle_is_an_engine_adapter() -> None:
    from kvcanary.adapters import EngineAdapter, load_adapter

    assert load_adapter("sglang") is install_canary
    canary = install_canary(TinyRunner(_rtp(), _mha(), TinyModel(), server_args(kv_canary="log")))
    assert isinstance(canary, EngineAdapter) and canary.name == "sglang"
