"""Records travel with the bytes through sglang's real HiCache host pool (MHATokenToKVPoolHost), both ways.

A request's KV is backed up into the host pool, its device slots are freed and reused, and it is loaded
back into other device slots, as HiCache does.  Restored from the right host slots the request decodes on
silently; restored from the wrong host slots (another request's backup, or its own in the wrong order)
the next read of the restored slots is a violation of that request.

sglang's transfer kernels (``sgl_kernel.kvcacheio``) are CUDA/XPU only; on this CPU the host pool's
``direct`` path gets a stand-in that moves exactly the rows it is told (``dst[dst_idx] = src[src_idx]``).
Everything else (the host pool's allocator, layouts, the two transfer methods) is sglang's.
"""

from __future__ import annotations

import pytest
import sglang.srt.mem_cache.pool_host.mha as host_mha
import torch
from sglang_harness import Engine, Req

from kvcanary.adapters.sglang import attach_host_pool
from kvcanary.runtime import CanaryViolation


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.long()] = src[src_indices.long()]


def _engine_with_host_pool(monkeypatch, **server_kw):
    """Two requests submitted on an engine whose canary mirrors an ``MHATokenToKVPoolHost``."""
    monkeypatch.setattr(host_mha, "transfer_kv_direct", _transfer_kv_direct, raising=False)
    eng = Engine(pool_size=96, rows=3, chunk=32, radix=False, server_kw=server_kw or None)
    pool = eng.pool
    host = host_mha.MHATokenToKVPoolHost(
        pool.get_device_pool_infos()[0].buffer_info, 2.0, 0, 1, "layer_first", pin_memory=False,
        device_capacity_tokens=pool.size, start_layer=pool.start_layer, end_layer=pool.end_layer,
        write_back_staging=pool.hicache_write_back_staging,
    )  # fmt: skip
    assert eng.canary is not None
    mirror = attach_host_pool(eng.canary, host)
    eng.submit("a", [3 + j for j in range(20)], max_new=12)
    eng.submit("b", [50 + j for j in range(20)], max_new=12)
    return eng, host, mirror


@pytest.fixture
def host_engine(monkeypatch):
    eng, host, mirror = _engine_with_host_pool(monkeypatch)
    yield eng, host, mirror
    mirror.detach()


def _decoding(eng: Engine) -> tuple[Req, Req]:
    for _ in range(40):
        ready = [r for r in eng.running if r.cached >= r.prompt_len + 2]
        if len(ready) == 2:
            return ready[0], ready[1]
        assert eng.step()
    raise AssertionError("requests never reached decode")


def _offload(eng: Engine, host, req: Req) -> torch.Tensor:
    """Back the request's KV up into the host pool (real backup), then free its device slots."""
    slots = eng.rtp.req_to_token[req.row, : req.cached].to(torch.int64).clone()
    host_idx = host.alloc(int(slots.shape[0]))
    host.backup_from_device_all_layer(eng.pool, host_idx, slots, "direct")
    eng.alloc.free(slots)
    return host_idx


def _load_back(eng: Engine, host, req: Req, host_idx: torch.Tensor) -> None:
    """Load it into freshly allocated device slots, layer by layer (real load), and point its row there."""
    fresh = eng.alloc.alloc(req.cached)
    for layer in range(eng.pool.layer_num):
        host.load_to_device_per_layer(eng.pool, host_idx, fresh, layer, "direct")
    eng.rtp.req_to_token[req.row, : req.cached] = fresh.to(torch.int32)


def _churn(eng: Engine) -> None:
    """Another request takes the freed slots and overwrites them."""
    eng.submit("churn", [(7 * j + 11) % 97 for j in range(24)], max_new=1)
    for _ in range(3):
        eng.step()


def test_restore_from_the_right_host_slots_is_silent(host_engine) -> None:
    eng, host, mirror = host_engine
    a, _ = _decoding(eng)
    host_idx = _offload(eng, host, a)
    eng.running.remove(a)  # parked while its KV lives on the host
    _churn(eng)
    _load_back(eng, host, a, host_idx)
    eng.running.append(a)
    eng.run()
    assert mirror.saves == 1 and mirror.restores == 1
    assert eng.canary.stats()["violations"] == 0 and len(eng.finished) == 3


@pytest.mark.parametrize("wrong", ["another request's host slots", "its own host slots, rotated"])
def test_restore_from_the_wrong_host_slots_is_caught_for_that_request(host_engine, wrong: str) -> None:
    eng, host, mirror = host_engine
    a, b = _decoding(eng)
    host_a = _offload(eng, host, a)
    eng.running.remove(a)
    host_b = host.alloc(b.cached)
    host.backup_from_device_all_layer(eng.pool, host_b, eng.rtp.req_to_token[b.row, : b.cached].long(), "direct")
    _churn(eng)
    n = a.cached
    source = host_b[:n] if wrong.startswith("another") else torch.roll(host_a, 1)
    _load_back(eng, host, a, source)
    eng.running.append(a)
    with pytest.raises(CanaryViolation) as excinfo:
        eng.step()
        eng.step()  # a step's report comes with the next host step
    violations = excinfo.value.report.violations
    assert {v.request_id for v in violations} == {"a"}
    assert all(v.phase == "verify" for v in violations)
    assert mirror.restores == 1


def test_out_of_range_host_indices_never_index_out_of_bounds(host_engine) -> None:
    _, _, mirror = host_engine
    slots = torch.tensor([1, 2, 3])
    mirror.save(torch.tensor([-1, 10**6, 0]), slots)  # only the in-range pair is saved
    mirror.restore(torch.tensor([10**6, -5, 0]), torch.tensor([4, 5, 6]))
    assert mirror.device_records.links[4] == 0 and mirror.device_records.links[5] == 0  # no record: unknown source
    with pytest.raises(TypeError, match="1-D integer tensor"):
        mirror.save(torch.tensor([0.5]), slots)


# --------------------------------------------------------------------------- with the KV digest


@pytest.fixture
def digest_host_engine(monkeypatch):
    eng, host, mirror = _engine_with_host_pool(monkeypatch, kv_canary_digest_budget=1.0)
    yield eng, host, mirror
    mirror.detach()


@pytest.mark.parametrize("stale", [False, True])
def test_a_load_with_stale_bytes_is_caught_and_the_layer_named(digest_host_engine, stale: bool) -> None:
    """Loaded from the right host slots, one of whose bytes changed on the host (stale or damaged host bytes):
    the records agree, the digest does not; verified once every layer landed.  The host copy is what changed,
    so it is not used as the reference: the single-bit search names the layer.  Clean bytes: silent."""
    eng, host, mirror = digest_host_engine
    a, _ = _decoding(eng)
    host_idx = _offload(eng, host, a)
    eng.running.remove(a)
    _churn(eng)
    if stale:
        host.kv_buffer[1, 1, int(host_idx[4]), 0, 2:3].view(torch.int32).bitwise_xor_(1 << 7)  # V, layer 1
    _load_back(eng, host, a, host_idx)
    eng.running.append(a)
    if not stale:
        eng.run()
        assert eng.canary.stats()["violations"] == 0 and mirror.restores == 1 and len(eng.finished) == 3
        return
    with pytest.raises(CanaryViolation) as excinfo:
        for _ in range(3):
            eng.step()
    bad = [v for v in excinfo.value.report.violations if "digest_mismatch" in v.reasons]
    slot = int(eng.rtp.req_to_token[a.row, 4])
    assert {v.slot for v in bad} == {slot}
    assert bad[0].note == "digest: one flipped bit explains the mismatch: layer1.v head 0 byte 8 bit 7"


def test_device_bytes_damaged_after_the_load_are_named_against_the_host_copy(digest_host_engine) -> None:
    eng, host, _ = digest_host_engine
    a, _ = _decoding(eng)
    host_idx = _offload(eng, host, a)
    eng.running.remove(a)
    _churn(eng)
    _load_back(eng, host, a, host_idx)
    eng.running.append(a)
    eng.step()  # the load is verified at this step's host step: clean
    slot = int(eng.rtp.req_to_token[a.row, 3])
    eng.pool.k_buffer[0][slot, 1] = 0.0  # a whole head row of layer 0's K zeroed on the device
    with pytest.raises(CanaryViolation) as excinfo:
        for _ in range(3):
            eng.step()
    bad = [v for v in excinfo.value.report.violations if "digest_mismatch" in v.reasons]
    assert {v.slot for v in bad} == {slot}
    assert bad[0].note == f"digest: bytes differ from their host copy (index {int(host_idx[3])}) in layer0.k"
