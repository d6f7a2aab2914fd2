"""The KV digest through the manager, driven by the scripted engine with real K/V bytes.

The engine's "forward" writes each stored token's K/V rows (full pool, and the window pool through its
lookup) between before_forward and after_forward, as a model would.  Clean runs stay silent at every
budget; byte faults that leave every record intact (a flipped bit, a padding token's K/V written into a
live slot, a block copy or restore with wrong bytes) are reported as ``digest_mismatch`` within the
budget's period (one step at budget 1.0), naming the slot and the request whose read hits it.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from kvcanary import CanaryConfig, Capacities, Mode
from kvcanary import digest as D
from kvcanary.config import DigestConfig
from kvcanary.runtime import CanaryManager, StepReport
from scripted_engine import EngineStep, ScriptedEngine, standard_workload

CAPS = Capacities(max_batch=8, max_tokens=32, verify_entries=128, max_context=24)
HEADS, DIM, LAYERS = 2, 6, 2
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def name(i: int) -> str:
    """Component i's name: each layer's K, then its V."""
    return f"layer{i // 2}.{'kv'[i % 2]}"


class KVPools:
    """K and V of LAYERS layers for both groups, written by the 'forward' from (token, position)."""

    def __init__(self, engine: ScriptedEngine, device: str = "cpu") -> None:
        full, window = engine.canary_groups()
        self.device = device

        def pool(slots: int) -> list[torch.Tensor]:
            return [torch.zeros(slots, HEADS, DIM, dtype=torch.bfloat16, device=device) for _ in range(2 * LAYERS)]

        self.full = pool(full.num_slots)
        self.window = pool(window.num_slots)

    def layouts(self) -> dict[str, D.DigestLayout]:
        return {
            "full": D.DigestLayout(tuple(D.token_major(t, name(i)) for i, t in enumerate(self.full))),
            "window": D.DigestLayout(tuple(D.token_major(t) for t in self.window)),
        }

    @staticmethod
    def rows_for(token: int, pos: int, i: int, device: str = "cpu") -> torch.Tensor:
        gen = torch.Generator().manual_seed(token * 7919 + pos * 31 + i)
        return torch.randn(HEADS, DIM, generator=gen).to(device, torch.bfloat16)

    def forward(self, step: EngineStep) -> None:
        for loc, tok, pos in zip(step.out_cache_loc, step.input_ids, step.positions, strict=True):
            if int(loc) < 0:
                continue
            wslot = int(step.lookup[int(loc)])
            for i in range(2 * LAYERS):
                row = self.rows_for(int(tok), int(pos), i, self.device)
                self.full[i][int(loc)] = row
                self.window[i][wslot] = row


def run(
    engine: ScriptedEngine, budget: float, fault=None, clock=time.monotonic, device: str = "cpu", tap: str = "bracket"
) -> tuple[list[StepReport], CanaryManager]:  # type: ignore[no-untyped-def]
    """The workload through the manager.  ``tap``: "bracket" (before_forward, forward, after_forward, as
    sglang does) or "after" (forward, then forward_step, as the transformers tap does: on CUDA its step
    graphs capture the digest's calls).  Either way the digest is verified and stamped after the forward."""
    config = CanaryConfig(mode=Mode.LOG, digest=DigestConfig(budget))
    mgr = CanaryManager(engine.canary_groups(), CAPS, config, clock=clock, device=device)
    pools = KVPools(engine, device)
    mgr.attach_digests(pools.layouts())
    reports = []
    while not engine.done:
        step = engine.begin_step()
        if fault is not None:
            fault(engine, step, pools, mgr)
        batches = {"full": step.full(True).to(device), "window": step.window(True).to(device)}
        if tap == "bracket":
            mgr.before_forward(batches)
            pools.forward(step)
            mgr.after_forward()
        else:
            pools.forward(step)
            mgr.forward_step(batches)
        reports.append(mgr.host_step(step.rids))
        engine.end_step()
    reports.append(mgr.flush())
    return reports, mgr


DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tap", ["bracket", "after"])
@pytest.mark.parametrize("budget", [1.0, 0.3, 0.01])
def test_clean_workload_is_silent_and_digests_every_write(budget: float, tap: str, device: str) -> None:
    """Hooks around the forward or a tap after it (on CUDA the canary's step graphs capture the digest's
    calls): a clean run stays silent and every write is digested."""
    reports, mgr = run(ScriptedEngine(standard_workload()), budget, device=device, tap=tap)
    assert all(r is None for r in reports)
    assert mgr.stats()["violations"] == 0
    digest = mgr.digest_of("full")
    assert digest is not None
    stats = digest.workspace.stats.tolist()
    assert stats[D.DigestWorkspace.STAT_STAMPED] > 0 and stats[D.DigestWorkspace.STAT_CALLS] > 0
    # At 1 % the 15 steps of this short workload may select no read run at all; above, some are verified.
    assert stats[D.DigestWorkspace.STAT_VERIFIED] > 0 or budget < 0.1
    written = mgr.canaries["full"].records.links != 0
    assert torch.equal(digest.digests != 0, written)  # every written slot carries a digest


def _first_digest_report(reports: list[StepReport | None]) -> tuple[int, StepReport]:
    for i, r in enumerate(reports):
        if r is not None and "digest_mismatch" in r.counts:
            return i, r
    raise AssertionError("no digest_mismatch reported")


def _flip_at(step_index: int, rid: int, pos: int, layer: int):  # type: ignore[no-untyped-def]
    def fault(engine: ScriptedEngine, step: EngineStep, pools: KVPools, mgr: CanaryManager) -> None:
        if step.index == step_index:
            slot = engine.slot_at(rid, pos)
            raw = pools.full[layer][slot].view(torch.int16)
            raw[1, 3] ^= 1 << 9

    return fault


@pytest.mark.parametrize("layer", [0, 2 * LAYERS - 1])
def test_bit_flip_is_caught_at_the_next_read(layer: int) -> None:
    reports, mgr = run(ScriptedEngine(standard_workload()), 1.0, _flip_at(6, 1, 2, layer))
    i, report = _first_digest_report(reports)
    assert report.step == 6 and i == 7  # read at step 6, reported by the next host step
    bad = [v for v in report.violations if "digest_mismatch" in v.reasons]
    assert {v.group for v in bad} == {"full"} and {v.request_id for v in bad} >= {1}
    assert mgr.stats()["violations"] > 0
    # The layer is named (the single-bit search): bf16 element [1, 3] is byte 6 of head 1's second word.
    assert bad[0].note == f"digest: one flipped bit explains the mismatch: {name(layer)} head 1 byte 7 bit 1"
    assert bad[0].note in report.summary()


@pytest.mark.parametrize("seconds_per_call", [0.0, 1.0])
def test_layer_naming_is_rate_limited(seconds_per_call: float) -> None:
    """A slot that stays corrupt is reported at every read; its layer is looked for at most
    log_rate_limit_per_s reports a second (a frozen clock: once; a slow one: every report)."""
    ticks = itertools.count()
    reports, _ = run(ScriptedEngine(standard_workload()), 1.0, _flip_at(6, 1, 2, 0),
                     clock=lambda: seconds_per_call * next(ticks))  # fmt: skip
    digest_reports = [r for r in reports if r is not None and "digest_mismatch" in r.counts]
    assert len(digest_reports) >= 2
    noted = [any(v.note.startswith("digest:") for v in r.violations) for r in digest_reports]
    assert noted == ([True] + [False] * (len(noted) - 1) if seconds_per_call == 0 else [True] * len(noted))


def test_bit_flip_is_caught_within_the_budget_period() -> None:
    budget = 0.3  # period 4
    reports, _ = run(ScriptedEngine(standard_workload()), budget, _flip_at(5, 1, 2, 1))
    _, report = _first_digest_report(reports)
    assert 5 <= report.step < 5 + DigestConfig(budget).period


def test_padding_write_into_a_live_slot_is_caught() -> None:
    def fault(engine: ScriptedEngine, step: EngineStep, pools: KVPools, mgr: CanaryManager) -> None:
        if step.index == 7:  # the padding token's K/V lands on request 1's slot 0; no record moves
            slot = engine.slot_at(1, 0)
            for t in pools.full:
                t[slot] = KVPools.rows_for(0, 0, 0)

    reports, _ = run(ScriptedEngine(standard_workload()), 1.0, fault)
    _, report = _first_digest_report(reports)
    assert report.step == 7
    bad = [v for v in report.violations if "digest_mismatch" in v.reasons]
    assert bad[0].note.startswith("digest: layer not found")  # a whole row replaced in place: no reference


@pytest.mark.parametrize("bytes_ok", [True, False])
def test_moved_slots_are_verified_after_the_move(bytes_ok: bool) -> None:
    """A copy whose records follow the bytes is silent; one whose bytes are stale is reported, naming the
    layers that differ from the copy's source."""
    moved: list[int] = []

    def fault(engine: ScriptedEngine, step: EngineStep, pools: KVPools, mgr: CanaryManager) -> None:
        if step.index != 6:
            return
        src = torch.tensor([engine.slot_at(1, p) for p in range(3)])
        moved.extend(src.tolist())
        dst = torch.tensor([60, 61, 62])  # free slots at the top of the pool, never handed out here
        mgr.canaries["full"].records.copy_blocks(src, dst, 1)  # blocks of one slot: these three slots
        for t in pools.full:
            t[dst] = t[src] if bytes_ok else t[src.flip(0)]
        if not bytes_ok:
            pools.full[3][61, 0, 0] += 1  # one layer of the middle slot differs too (its source row is itself)
        digest = mgr.digest_of("full")
        assert digest is not None
        digest.note_move(dst, src)
        mgr.verify_moved("full", dst)

    reports, _ = run(ScriptedEngine(standard_workload()), 0.01, fault)
    if bytes_ok:
        assert all(r is None for r in reports)
    else:
        _, report = _first_digest_report(reports)
        bad = [v for v in report.violations if "digest_mismatch" in v.reasons]
        assert report.step == 6 and {v.slot for v in bad} == {60, 61, 62}
        assert all(v.phase == "digest_verify" for v in bad)
        # The copy sources still hold the stamped bytes: the layers that differ are named exactly.
        notes = {v.slot: v.note for v in bad}
        every = ", ".join(name(i) for i in range(2 * LAYERS))
        s0, s1, s2 = moved
        assert notes[60] == f"digest: bytes differ from their copy source (index {s0}) in {every}"
        assert notes[62] == f"digest: bytes differ from their copy source (index {s2}) in {every}"
        assert notes[61] == f"digest: bytes differ from their copy source (index {s1}) in layer1.v"


def test_attach_refuses_misuse() -> None:
    engine = ScriptedEngine(standard_workload())
    pools = KVPools(engine)
    plain = CanaryManager(engine.canary_groups(), CAPS, CanaryConfig())
    with pytest.raises(ValueError, match="digest"):
        plain.attach_digests(pools.layouts())
    mgr = CanaryManager(engine.canary_groups(), CAPS, CanaryConfig(digest=DigestConfig()))
    with pytest.raises(ValueError, match="unknown groups"):
        mgr.attach_digests({"nope": pools.layouts()["full"]})
    with pytest.raises(ValueError, match="budget"):
        DigestConfig(0.0)
    with pytest.raises(TypeError, match="layers"):
        DigestConfig(layers=[1])  # type: ignore[arg-type]
    off = CanaryManager(engine.canary_groups(), CAPS, CanaryConfig(mode=Mode.OFF, digest=DigestConfig()))
    off.attach_digests(pools.layouts())  # off: nothing allocated, nothing to do
    assert off.digest_of("full") is None


@CUDA
@pytest.mark.parametrize("tap", ["bracket", "after"])
def test_cuda_bit_flip_is_caught_at_the_next_read(tap: str) -> None:
    reports, _ = run(ScriptedEngine(standard_workload()), 1.0, _flip_at(6, 1, 2, 1), device="cuda", tap=tap)
    i, report = _first_digest_report(reports)
    assert report.step == 6 and i == 7
    assert {v.slot for v in report.violations if "digest_mismatch" in v.reasons}


@pytest.mark.parametrize("device", DEVICES)
def test_write_during_the_forward_is_caught_by_that_step(device: str) -> None:
    """A stray write that lands while the forward runs is reported by that step's verify, which runs once
    the forward has written (budget 1.0)."""

    def fault(engine: ScriptedEngine, step: EngineStep, pools: KVPools, mgr: CanaryManager) -> None:
        forward = KVPools.forward

        def late_write(s: EngineStep) -> None:
            pools.full[2][engine.slot_at(1, 0)] = KVPools.rows_for(0, 0, 0, device)
            forward(pools, s)

        pools.forward = late_write if step.index == 7 else (lambda s: forward(pools, s))  # type: ignore[method-assign]

    reports, _ = run(ScriptedEngine(standard_workload()), 1.0, fault, device=device)
    _, report = _first_digest_report(reports)
    assert report.step == 7
