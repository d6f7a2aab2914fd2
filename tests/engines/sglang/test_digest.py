"""The KV digest on sglang's real pools: stamped after each forward, verified before reads and after loads.

Clean workloads (token-major, paged, hybrid SWA, MLA) stay silent at budget 1.0 with every written slot
digested; byte faults that leave every record and table entry intact are caught at the next forward that
reads the slot, as ``digest_mismatch`` of the reading request, with the layer whose bytes differ named.
"""

from __future__ import annotations

import types

import pytest
import torch
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang_harness import Engine, Req
from sglang_model import DTYPE, TinyRunner, WriteOnlyModel, make_forward_batch, server_args

from kvcanary.adapters.sglang import options_from_args
from kvcanary.adapters.sglang.digest_layout import pool_layouts
from kvcanary.digest import DigestWorkspace
from kvcanary.runtime import CanaryViolation

DIGEST = {"kv_canary_digest_budget": 1.0}


def _workload(eng: Engine) -> None:
    eng.submit("a", [3 + j for j in range(20)], max_new=10)
    eng.submit("b", [3 + j for j in range(20)] + [60, 61], max_new=6)  # a radix hit on a's prompt
    eng.submit("c", [(5 * j + 1) % 97 for j in range(30)], max_new=8)


def _digests(eng: Engine, group: str = "full") -> torch.Tensor:
    assert eng.canary is not None
    digest = eng.canary.manager.digest_of(group)
    assert digest is not None
    return digest.digests


@pytest.mark.parametrize("kw", [{}, {"page_size": 4}, {"window": 8}])
def test_clean_workload_is_silent_and_every_write_is_digested(kw: dict) -> None:
    eng = Engine(server_kw=DIGEST, **kw)
    _workload(eng)
    eng.run()
    assert eng.canary is not None and eng.canary.stats()["violations"] == 0 and len(eng.finished) == 3
    for group in [g.name for g in eng.canary.attached.groups]:
        digest = eng.canary.manager.digest_of(group)
        assert digest is not None
        stats = digest.workspace.stats.tolist()
        assert stats[DigestWorkspace.STAT_STAMPED] > 0 and stats[DigestWorkspace.STAT_VERIFIED] > 0
    written = eng.canary.manager.canaries["full"].records.links != 0
    assert torch.equal(_digests(eng) != 0, written)


def _reading(eng: Engine) -> Req:
    for _ in range(40):
        ready = [r for r in eng.running if r.cached >= r.prompt_len + 1]
        if ready:
            return ready[0]
        assert eng.step()
    raise AssertionError("no request reached decode")


@pytest.mark.parametrize(("layer", "kv"), [(0, "k"), (1, "v")])
def test_a_flipped_bit_is_caught_at_the_next_read_and_its_layer_named(layer: int, kv: str) -> None:
    eng = Engine(server_kw=DIGEST)
    _workload(eng)
    req = _reading(eng)
    slot = int(eng.rtp.req_to_token[req.row, 5])
    buf = (eng.pool.k_buffer if kv == "k" else eng.pool.v_buffer)[layer]
    buf[slot, 1, 3:4].view(torch.int32).bitwise_xor_(1 << 20)  # float32 element 3 of head 1: byte 14, bit 4
    with pytest.raises(CanaryViolation) as excinfo:
        eng.step()
        eng.step()  # a step's report comes with the next host step
    bad = [v for v in excinfo.value.report.violations if "digest_mismatch" in v.reasons]
    assert bad and {v.slot for v in bad} == {slot} and req.rid in {v.request_id for v in bad}
    assert all(v.phase == "digest_verify" and v.expected_position == 5 for v in bad)
    assert bad[0].note == f"digest: one flipped bit explains the mismatch: layer{layer}.{kv} head 1 byte 14 bit 4"


def test_clean_reads_are_silent_without_the_digest_and_the_flip_is_then_invisible() -> None:
    """The other side: the same flip with the digest off is not seen by the records (why the digest exists)."""
    eng = Engine()
    _workload(eng)
    req = _reading(eng)
    eng.pool.k_buffer[0][int(eng.rtp.req_to_token[req.row, 5]), 1, 3:4].view(torch.int32).bitwise_xor_(1 << 20)
    eng.run()
    assert eng.canary is not None and eng.canary.stats()["violations"] == 0


def test_a_padding_write_into_a_live_slot_is_caught() -> None:
    """A forward's K/V written to one extra, live slot (a stray index in ``set_kv_buffer``)."""
    eng = Engine(server_kw=DIGEST)
    _workload(eng)
    req = _reading(eng)
    victim = int(eng.rtp.req_to_token[req.row, 2])
    pool = eng.pool
    original = pool.set_kv_buffer

    def stray(layer, loc, cache_k, cache_v, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(layer, loc, cache_k, cache_v, *args, **kwargs)
        pool.k_buffer[layer.layer_id][victim] = cache_k[-1]
        pool.v_buffer[layer.layer_id][victim] = cache_v[-1]
        return out

    pool.set_kv_buffer = stray
    with pytest.raises(CanaryViolation) as excinfo:
        eng.step()  # the stray write lands after this forward's reads
        del pool.set_kv_buffer
        eng.step()  # the next forward reads the slot: caught
        eng.step()
    bad = [v for v in excinfo.value.report.violations if "digest_mismatch" in v.reasons]
    assert {v.slot for v in bad} == {victim} and req.rid in {v.request_id for v in bad}


def test_the_budget_rotates_and_verifies_a_share() -> None:
    eng = Engine(server_kw={"kv_canary_digest_budget": 0.25})
    _workload(eng)
    eng.run()
    digest = eng.canary.manager.digest_of("full") if eng.canary else None
    assert digest is not None and digest.period == 4 and eng.canary is not None
    assert eng.canary.stats()["violations"] == 0
    full = Engine(server_kw=DIGEST)
    _workload(full)
    full.run()
    every = full.canary.manager.digest_of("full") if full.canary else None
    assert every is not None
    share = int(digest.workspace.stats[DigestWorkspace.STAT_VERIFIED])
    assert 0 < share < int(every.workspace.stats[DigestWorkspace.STAT_VERIFIED])


def test_options_and_layouts() -> None:
    opts = options_from_args(types.SimpleNamespace(kv_canary="log", kv_canary_digest_budget=0.5,
                                                   kv_canary_digest_layers="1"))  # fmt: skip
    assert opts.config.digest is not None and opts.config.digest.layers == (1,) and opts.config.digest.budget == 0.5
    assert options_from_args(types.SimpleNamespace(kv_canary="log")).config.digest is None  # off by default
    with pytest.raises(ValueError, match="budget"):
        options_from_args(types.SimpleNamespace(kv_canary="log", kv_canary_digest_budget=2.0))
    with pytest.raises(ValueError, match="kv_canary_digest_layers"):
        options_from_args(types.SimpleNamespace(kv_canary="log", kv_canary_digest_budget=1.0,
                                                kv_canary_digest_layers="a,b"))  # fmt: skip
    eng = Engine(server_kw={**DIGEST, "kv_canary_digest_layers": "1"})
    assert eng.canary is not None
    layout = eng.canary.manager.digest_of("full").layout  # type: ignore[union-attr]
    assert [c.name for c in layout.components] == ["layer1.k", "layer1.v"]
    swa = Engine(server_kw=DIGEST, window=8)
    assert swa.canary is not None
    names = {g: [c.name for c in lay.components] for g, lay in pool_layouts(swa.canary.attached, None).items()}
    assert names == {"full": ["layer0.k", "layer0.v"], "swa": ["layer1.k", "layer1.v"]}


def test_mla_pool_digest_clean_then_a_flipped_bit() -> None:
    rtp = ReqToTokenPool(size=3, max_context_len=64, device="cpu", enable_memory_saver=False)
    pool = MLATokenToKVPool(
        64, 1, DTYPE, kv_lora_rank=16, qk_rope_head_dim=8, layer_num=1, device="cpu", enable_memory_saver=False
    )
    alloc = TokenToKVPoolAllocator(64, DTYPE, "cpu", pool, need_sort=False)
    runner = TinyRunner(rtp, pool, WriteOnlyModel(mla=True), server_args(**DIGEST))
    from kvcanary.adapters.sglang import install_canary

    canary = install_canary(runner)
    assert canary is not None
    canary.mark_init_finished()
    rows = rtp.alloc_rows(1)
    loc = alloc.alloc(7)
    rtp.write((rows[0], slice(0, 7)), loc.to(torch.int32))
    runner.forward(make_forward_batch(ForwardMode.EXTEND, rows, [0], [7], list(range(10, 17)), list(range(7)), loc,
                                      ["p"]))  # fmt: skip
    for step in range(3):
        loc = alloc.alloc(1)
        rtp.req_to_token[rows[0], 7 + step] = int(loc[0])
        if step == 2:
            pool.kv_buffer[0][int(rtp.req_to_token[rows[0], 3]), 0, 2:3].view(torch.int32).bitwise_xor_(1 << 3)
        runner.forward(make_forward_batch(ForwardMode.DECODE, rows, [7 + step], [1], [3], [7 + step], loc, ["p"]))
        assert canary.last_report is None
    with pytest.raises(CanaryViolation) as excinfo:
        canary.flush()
    bad = excinfo.value.report.violations
    assert {v.request_id for v in bad} == {"p"} and {r for v in bad for r in v.reasons} == {"digest_mismatch"}
    assert bad[0].note == "digest: one flipped bit explains the mismatch: layer0.kv head 0 byte 8 bit 3"
