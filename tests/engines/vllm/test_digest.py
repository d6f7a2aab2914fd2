"""The KV digest inside the real vLLM V1 engine (CPU model runner, CPU_ATTN cache with K transposed per block).

Both sides on the shared engine: the clean workload (prefix hits, preemptions, copy-on-write relocations) is
silent with the digest at budget 1.0 and every written slot digested; each byte fault of the vLLM library (a
flipped bit, a stray write into a live slot, a copy-on-write copy that lands damaged bytes) is caught as
``digest_mismatch`` naming the affected request, with the layer whose bytes differ in the row's note.
"""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
import torch

from kvcanary.adapters.vllm import install
from kvcanary.adapters.vllm.digest_layout import layer_components
from kvcanary.adapters.vllm.options import digest_from_env
from kvcanary.adapters.vllm.selftest.bytes import CowCopyCorruptsBytes, KVBitFlip, PaddingWriteLiveSlot
from kvcanary.adapters.vllm.selftest.context import VllmInjector
from kvcanary.adapters.vllm.selftest.cow import install_relocations
from kvcanary.adapters.vllm.selftest.engine import run_engine
from kvcanary.adapters.vllm.workload import generate, make_workload
from kvcanary.config import CanaryConfig, DigestConfig, Mode
from kvcanary.digest import DigestWorkspace
from kvcanary.ops import digest_reference as dref
from kvcanary.selftest.protocol import InjectMode, RunSpec

SEED = 5
NUM_REQUESTS = 10


def test_options_from_the_environment() -> None:
    assert digest_from_env({}) is None and digest_from_env({"KVCANARY_DIGEST_BUDGET": "0"}) is None
    cfg = digest_from_env({"KVCANARY_DIGEST_BUDGET": "0.25", "KVCANARY_DIGEST_LAYERS": "0, 1"})
    assert cfg == DigestConfig(budget=0.25, layers=(0, 1))
    with pytest.raises(ValueError, match="KVCANARY_DIGEST_BUDGET"):
        digest_from_env({"KVCANARY_DIGEST_BUDGET": "lots"})
    with pytest.raises(ValueError, match="budget"):
        digest_from_env({"KVCANARY_DIGEST_BUDGET": "1.5"})
    with pytest.raises(ValueError, match="KVCANARY_DIGEST_LAYERS"):
        digest_from_env({"KVCANARY_DIGEST_BUDGET": "1", "KVCANARY_DIGEST_LAYERS": "x"})


def test_layout_rows_are_exactly_each_slots_bytes(llm: Any) -> None:
    """A slot's K row of the component is the K vLLM's attention reads (transposed per block), V likewise."""
    runner = install(llm, CanaryConfig(mode=Mode.LOG, digest=DigestConfig(1.0)))
    assert runner is not None
    try:
        layout = runner.manager.digest_of("full").layout  # type: ignore[union-attr]
        assert [c.name for c in layout.components] == ["layer0.k", "layer0.v", "layer1.k", "layer1.v"]
        kv = runner.runner.kv_caches[1]
        nb, heads, bs, two_hd = kv.shape
        paged = kv.view(nb, heads, 2 * bs, two_hd // 2)
        k_cache = paged[:, :, :bs].reshape(nb, heads, two_hd // 2, bs)
        v_cache = paged[:, :, bs:]
        k, v = layer_components(kv, "transposed", 1)
        for slot in (0, 1, bs - 1, bs + 5, nb * bs - 1):
            b, o = divmod(slot, bs)
            assert k.view[b, o].data_ptr() != 0 and torch.equal(k.view[b, o], k_cache[b, :, :, o])
            assert torch.equal(v.view[b, o], v_cache[b, :, o])
        assert k.view.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()  # views, no copy
    finally:
        runner.uninstall()


def test_clean_workload_is_silent_with_copies_verified_and_every_write_digested(llm: Any) -> None:
    workload = make_workload(seed=SEED, num_requests=NUM_REQUESTS)
    llm.reset_prefix_cache()
    clean = generate(llm, workload)
    llm.reset_prefix_cache()
    canary = install(llm, CanaryConfig(mode=Mode.RAISE, digest=DigestConfig(1.0)))
    assert canary is not None
    ctx = VllmInjector(InjectMode.PROBE, rng=random.Random(0), target=None, llm=llm, canary=canary)
    install_relocations(ctx)  # copy-on-write relocations through kv_cache_block_copies, copied by vLLM
    try:
        outs = llm.generate(workload.requests(), workload.sampling(), use_tqdm=False)
        canary.flush()
        digest = canary.manager.digest_of("full")
        assert digest is not None
        stats = digest.workspace.stats.tolist()
        records = canary.manager.canaries["full"].records
        assert torch.equal(digest.digests != 0, records.links != 0)  # every written slot carries its digest
    finally:
        ctx.patches.restore()
        canary.uninstall()
    assert [list(o.outputs[0].token_ids) for o in outs] == clean  # the digest changes nothing
    assert canary.stats()["violations"] == 0 and canary.features()["canary_errors"] == 0
    assert ctx.relocations > 0 and canary.features()["block_copies"] > 0
    assert stats[DigestWorkspace.STAT_STAMPED] > 0 and stats[DigestWorkspace.STAT_VERIFIED] > 0
    # Copied slots are verified on top of the budgeted reads: at least one block per copy.
    assert stats[DigestWorkspace.STAT_CALLS] > canary.features()["steps"]


@pytest.mark.parametrize("fault", [KVBitFlip, PaddingWriteLiveSlot, CowCopyCorruptsBytes])
def test_byte_faults_are_caught_with_the_layer_named(llm: Any, fault: Any) -> None:
    probe = run_engine(llm, RunSpec("dense", SEED, [fault()]), num_requests=NUM_REQUESTS)
    assert probe.violations == 0 and not probe.errors and not probe.reports  # the clean side
    steps = probe.opportunities[fault.spec.name]
    assert steps, "the workload offers this fault no step"
    target = (fault.spec.name, steps[len(steps) // 2])
    spec = RunSpec("dense", SEED, [fault()], InjectMode.INJECT, target, probe.store)
    out = run_engine(llm, spec, num_requests=NUM_REQUESTS)
    assert out.injection is not None and not out.errors
    first = out.reports[0]
    assert first.step >= out.injection.step and "digest_mismatch" in first.counts
    bad = [v for v in first.violations if "digest_mismatch" in v.reasons]
    assert all(v.phase == "digest_verify" for v in bad)
    if out.injection.requests:
        assert set(out.injection.requests) & {str(v.request_id) for v in first.violations}
    assert out.affected is None or first.step - out.affected.step <= 1  # within one step of the first bad read
    note = next(v.note for v in bad if v.note)
    if fault is PaddingWriteLiveSlot:  # a whole row of another token, in place: no reference to compare with
        assert note.startswith("digest: layer not found")
    elif fault is CowCopyCorruptsBytes:  # the copy's source still holds the stamped bytes
        assert re.fullmatch(r"digest: bytes differ from their copy source \(index \d+\) in layer0\.k", note), note
    else:
        assert re.fullmatch(r"digest: one flipped bit explains the mismatch: layer[01]\.k head 0 byte \d+ bit 7", note)


def test_reference_digest_of_a_slot_matches_the_stamp(llm: Any) -> None:
    """What the canary stamped equals the reference digest of the slot's bytes read through the layout."""
    workload = make_workload(seed=SEED, num_requests=4)
    llm.reset_prefix_cache()
    canary = install(llm, CanaryConfig(mode=Mode.RAISE, digest=DigestConfig(1.0)))
    assert canary is not None
    try:
        generate(llm, workload)
        digest = canary.manager.digest_of("full")
        assert digest is not None
        slots = (digest.digests != 0).nonzero().flatten()[:64]
        assert slots.numel() > 0
        assert torch.equal(dref.slot_digests(digest.layout, slots), digest.digests[slots])
    finally:
        canary.uninstall()
