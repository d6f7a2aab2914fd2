"""The digest kernel against its reference and the scalar oracle: every output compared exactly.

Compared after every call: the stored digests, the workspace's stats and epoch, the whole log (first K,
last K, counters), and the kernel's scratch (back to zero).  Pools cover every layout and dtype of
``digest_cases`` (awkward sizes: 1, primes, unaligned and transposed head rows, fp8 with fp32 scales);
lists carry -1, reserved, out-of-range and repeated indices; budgeted verifies run over paged and
windowed plans with bit flips in every component.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytest.importorskip("triton")

import digest_cases as dc
import digest_oracle
from digest_cases import planned_step
from kernel_compare import DEVICE
from kvcanary import CanaryGroup
from kvcanary import digest as D
from kvcanary.batch import StepBatch
from kvcanary.ops import digest_launchers as dl
from kvcanary.ops import digest_reference as dref
from kvcanary.workspace import PlanWorkspace, ViolationLog

pytestmark = pytest.mark.gpu if DEVICE.type == "cuda" else pytest.mark.interpreter


class Twin:
    """The same calls on the reference and on the kernel, each with its own digests, workspace and log."""

    def __init__(
        self, group: CanaryGroup, layout: D.DigestLayout, entries: int = 512, log_rows: int = 4,
        tuning: dl.DigestTuning = dl.DEFAULT_TUNING,
    ) -> None:  # fmt: skip
        self.group, self.layout, self.tuning, self.entries = group, layout, tuning, entries
        self.device_layout = dl.DeviceLayout.build(layout)
        self.sides = [
            (dref, layout, torch.zeros(group.num_slots, dtype=torch.int64, device=DEVICE),
             D.DigestWorkspace.allocate(entries, DEVICE), ViolationLog.allocate(log_rows, DEVICE)),
            (dl, self.device_layout, torch.zeros(group.num_slots, dtype=torch.int64, device=DEVICE),
             D.DigestWorkspace.allocate(entries, DEVICE), ViolationLog.allocate(log_rows, DEVICE)),
        ]  # fmt: skip
        self.calls = 0

    def call(self, name: str, *args: object, **kw: object) -> None:
        for mod, layout, digests, ws, log in self.sides:
            extra = {"tuning": self.tuning} if mod is dl else {}
            getattr(mod, name)(self.group, layout, digests, ws, log, *args, **kw, **extra)
        self.calls += 1
        self.assert_equal()

    def stamp_all(self, num_slots: int) -> None:
        """Stamp slots 0..num_slots-1, a workspace's worth of entries a call."""
        for c0 in range(0, num_slots, self.entries):
            self.call("stamp_list", torch.arange(c0, min(c0 + self.entries, num_slots), device=DEVICE))

    def assert_equal(self) -> None:
        (_, _, d_ref, ws_ref, log_ref), (_, _, d_k, ws_k, log_k) = self.sides
        assert torch.equal(d_ref, d_k)
        assert torch.equal(ws_ref.stats, ws_k.stats) and torch.equal(ws_ref.epoch, ws_k.epoch)
        assert torch.equal(log_ref.counters, log_k.counters)
        assert torch.equal(log_ref.rows(), log_k.rows())
        assert torch.equal(log_ref.first, log_k.first) and torch.equal(log_ref.last, log_k.last)
        assert not ws_k.acc.any() and not ws_k.sync.any()  # scratch back to zero

    @property
    def digests(self) -> torch.Tensor:
        return self.sides[1][2]

    @property
    def log(self) -> ViolationLog:
        return self.sides[1][4]


def _on_device(pool: dc.Pool) -> dc.Pool:
    if DEVICE.type == "cpu":
        return pool
    comps = []
    for c in pool.layout.components:  # keep the strides: move the base storage, rebuild the view
        base = c.view.as_strided((c.view.untyped_storage().nbytes() // c.shape.element_size,), (1,), 0).to(DEVICE)
        comps.append(D.KVComponent(base.as_strided(c.view.shape, c.view.stride(), c.view.storage_offset())))
    return dc.Pool(D.DigestLayout(tuple(comps)), pool.num_slots)


def _random_locs(rng: random.Random, n: int, num_slots: int) -> torch.Tensor:
    pick = [rng.randrange(num_slots) for _ in range(n)]
    for i in rng.sample(range(n), k=min(n, 4)):
        pick[i] = rng.choice([-1, num_slots, num_slots + 7, -3, 0])  # not stored, out of range, reserved
    return torch.tensor(pick, dtype=rng.choice([torch.int32, torch.int64]), device=DEVICE)


CASES = [(kind, dtype) for kind in dc.LAYOUTS for dtype in dc.DTYPES]


@pytest.mark.parametrize(("kind", "dtype"), CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_list_calls_match_reference_and_oracle(kind: str, dtype: torch.dtype) -> None:
    rng = random.Random(CASES.index((kind, dtype)))
    pool = _on_device(dc.random_pool(rng, kind=kind, dtype=dtype))
    group = CanaryGroup(num_slots=pool.num_slots, reserved_slots=(0,))
    twin = Twin(group, pool.layout)
    for report in (False, True):
        twin.call("stamp_list", _random_locs(rng, rng.randint(1, 40), pool.num_slots), report_range=report)
    stamped = twin.digests.nonzero().flatten().tolist()
    assert stamped
    for s in stamped:
        assert int(twin.digests[s]) == digest_oracle.slot_digest(pool.layout, s)
    comp = rng.choice(pool.layout.components)
    victim = rng.choice(stamped)
    dc.flip_random_bit(comp, victim, rng)
    twin.call("verify_list", torch.arange(-2, pool.num_slots + 2, device=DEVICE), report_range=True)
    mismatched = twin.log.rows()
    assert mismatched[:, 0].tolist().count(int(D_MISMATCH)) == 1


D_MISMATCH = 1 << 16


def test_every_component_and_bit_position_is_caught_like_the_reference() -> None:
    rng = random.Random(2)
    pool = _on_device(dc.random_pool(rng, kind="vllm_cpu", dtype=torch.float8_e4m3fn, layers=2, with_scales=True))
    group = CanaryGroup(num_slots=pool.num_slots, reserved_slots=())
    twin = Twin(group, pool.layout, log_rows=64, tuning=TUNINGS["narrow"])
    everything = torch.arange(pool.num_slots, device=DEVICE)
    twin.call("stamp_list", everything)
    caught = 0
    for comp in pool.layout.components:
        for bit in range(0, 8 * comp.shape.element_size, 5):
            slot = rng.randrange(pool.num_slots)
            dc.flip_bit(comp, slot, rng.randrange(comp.shape.heads), rng.randrange(comp.shape.dim), bit)
            before = int(twin.log.counters[16])
            twin.call("verify_list", everything)
            assert int(twin.log.counters[16]) == before + 1
            caught += 1
            twin.call("stamp_list", torch.tensor([slot], device=DEVICE))  # re-stamp: clean again
    assert caught >= 12


def _planned_pool(
    prefix: list[int], page: int, window: int = 0
) -> tuple[CanaryGroup, StepBatch, PlanWorkspace, dc.Pool]:
    """A planned decode step whose rows have ``prefix`` cached tokens, over a bf16 pool of pages of ``page``
    slots (token-major when 1) sized to hold them."""
    num_slots = page * (sum(-(-(n + 1) // page) for n in prefix) + 2)
    group, batch, plan_ws = planned_step(num_slots, prefix, window=window, page=page, device=DEVICE)
    pool = _on_device(dc.Pool(D.DigestLayout(tuple(
        dc.layer_components("paged" if page > 1 else "token_major", num_slots // page, page, 2, 5, torch.bfloat16,
                            torch.Generator().manual_seed(page))
    )), num_slots))  # fmt: skip
    return group, batch, plan_ws, pool


def _long_rows_step() -> tuple[CanaryGroup, StepBatch, PlanWorkspace, dc.Pool]:
    """Three rows reading 150, 90 and 60 positions of a 400-slot fp32 pool: more tiles than small workspaces."""
    group, batch, plan_ws = planned_step(400, [150, 90, 60], device=DEVICE)
    pool = _on_device(dc.Pool(D.DigestLayout(tuple(
        dc.layer_components("token_major", 400, 1, 1, 4, torch.float32, torch.Generator().manual_seed(0))
    )), 400))  # fmt: skip
    return group, batch, plan_ws, pool


TUNINGS = {"default": dl.DEFAULT_TUNING, "narrow": dl.DigestTuning(block_words=4, warps=2)}


@pytest.mark.parametrize("tuning", list(TUNINGS))
@pytest.mark.parametrize("page", [1, 3, 16])
@pytest.mark.parametrize("window", [0, 21])
def test_budgeted_verify_matches_reference(page: int, window: int, tuning: str) -> None:
    rng = random.Random(page * 100 + window)
    prefix = [0, 1, 16, 17, 45, rng.randint(2, 60)]
    group, batch, plan_ws, pool = _planned_pool(prefix, page, window)
    num_slots = group.num_slots
    twin = Twin(group, pool.layout, entries=256, log_rows=3, tuning=TUNINGS[tuning])
    twin.call("stamp_list", torch.arange(num_slots, device=DEVICE))
    mark = 1 + int(plan_ws.epoch[0]) % PlanWorkspace.MARK_PERIOD
    for step in range(6):
        period = [1, 2, 3, 5][step % 4]
        plan_ws.write_marks.zero_()  # some slots written this step (a ring reused in the step): left to the stamp
        written = torch.randperm(num_slots, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        plan_ws.write_marks[written[: num_slots // 3].to(DEVICE)] = 2 * mark + step % 2
        comp = pool.layout.components[step % 2]
        for _ in range(rng.randint(0, 4)):
            dc.flip_bit(comp, rng.randrange(1, num_slots), rng.randrange(2), rng.randrange(5), rng.randrange(16))
        twin.call("verify_planned", batch, plan_ws, period=period)
    assert int(twin.log.counters[16]) > 0  # some flips were read and caught


@pytest.mark.parametrize("tuning", list(TUNINGS))
@pytest.mark.parametrize("page", [1, 3, 16])
@pytest.mark.parametrize("writes", [1, 7, 40, 100])  # 100: the stamp gets a launch of its own (interpreter)
def test_fused_verify_and_stamp_matches_reference(page: int, writes: int, tuning: str) -> None:
    """One launch verifying the plan's share and stamping the step's writes: the reference's two calls.
    Writes carry -1, the reserved slot, out-of-range and repeated indices; some slots are both written
    and in a read span; flips land in read and in written slots."""
    rng = random.Random(page * 1000 + writes)
    prefix = [0, 1, 17, 45, rng.randint(2, 60)]
    group, batch, plan_ws, pool = _planned_pool(prefix, page)
    num_slots = group.num_slots
    entries = 64 + 16 * -(-writes // 16)  # the verify's share: 4 tiles, not every one a step needs
    twin = Twin(group, pool.layout, entries=entries, log_rows=3, tuning=TUNINGS[tuning])
    twin.stamp_all(num_slots)
    calls = twin.calls
    mark = 1 + int(plan_ws.epoch[0]) % PlanWorkspace.MARK_PERIOD
    table = batch.table.cpu()
    for step in range(5):
        locs = _random_locs(rng, writes, num_slots)
        plan_ws.write_marks.zero_()
        marked = locs[(locs >= 0) & (locs < num_slots)].long()
        plan_ws.write_marks[marked] = 2 * mark + step % 2  # what the plan marks for these writes
        for _ in range(rng.randint(1, 4)):
            r = rng.choice([i for i, n in enumerate(prefix) if n])  # a slot some row reads, or one written
            pos = rng.randrange(prefix[r])
            read = int(table[r + 1, pos // page]) * page + pos % page
            victim = rng.choice([read, read, *marked.tolist()[:1]])
            dc.flip_bit(pool.layout.components[step % 2], victim, rng.randrange(2), rng.randrange(5), rng.randrange(16))
        step_batch = dataclasses.replace(batch, out_cache_loc=locs)
        twin.call("verify_and_stamp", step_batch, plan_ws, period=[1, 2, 3][step % 3])
    assert int(twin.log.counters[16]) > 0  # some flips were read and caught
    stats = twin.sides[1][3].stats
    assert int(stats[D.DigestWorkspace.STAT_STAMPED]) > 0 and int(stats[D.DigestWorkspace.STAT_CALLS]) == calls + 2 * 5


def test_fused_call_takes_the_stamp_off_the_verify_share_and_refuses_too_many_writes() -> None:
    group, batch, plan_ws, pool = _long_rows_step()
    twin = Twin(group, pool.layout, entries=64)  # 4 tiles: 1 for the 3 writes, 3 for the verify
    twin.stamp_all(400)
    twin.call("verify_and_stamp", batch, plan_ws, period=1)
    stats = twin.sides[1][3].stats
    assert int(stats[D.DigestWorkspace.STAT_VERIFIED]) <= 48 and int(stats[D.DigestWorkspace.STAT_SKIPPED_TILES]) > 0
    too_many = dataclasses.replace(batch, out_cache_loc=torch.arange(65, device=DEVICE))
    for mod, layout, digests, ws, log in twin.sides:
        with pytest.raises(ValueError, match="exceed the digest workspace"):
            mod.verify_and_stamp(group, layout, digests, ws, log, too_many, plan_ws, period=1)
    twin.assert_equal()


def test_budgeted_verify_over_capacity_counts_skipped_tiles() -> None:
    group, batch, plan_ws, pool = _long_rows_step()
    twin = Twin(group, pool.layout, entries=64)  # 4 tiles of 16 positions a call
    twin.stamp_all(400)  # a list call takes at most the workspace's entries
    twin.call("verify_planned", batch, plan_ws, period=1)
    assert int(twin.sides[1][3].stats[D.DigestWorkspace.STAT_SKIPPED_TILES]) > 0


def test_log_overflow_keeps_first_and_last_rows_like_the_reference() -> None:
    gen = torch.Generator().manual_seed(9)
    comps = dc.layer_components("paged", 12, 4, 2, 3, torch.float16, gen)
    pool = _on_device(dc.Pool(D.DigestLayout(tuple(comps)), 48))
    group = CanaryGroup(num_slots=48, reserved_slots=(0, 5))
    twin = Twin(group, pool.layout, entries=64, log_rows=3)
    twin.call("stamp_list", torch.arange(48, device=DEVICE))
    for s in range(1, 48, 2):
        dc.flip_bit(pool.layout.components[1], s, 1, 2, 5)
    twin.call("verify_list", torch.arange(47, -1, -1, device=DEVICE))
    assert int(twin.log.counters[16]) == 23  # the odd slots but reserved slot 5


def test_launcher_refuses_misuse_before_running() -> None:
    pool = _on_device(dc.random_pool(random.Random(1), kind="paged", dtype=torch.float16))
    group = CanaryGroup(num_slots=pool.num_slots)
    layout = dl.DeviceLayout.build(pool.layout)
    ws, log = D.DigestWorkspace.allocate(16, DEVICE), ViolationLog.allocate(2, DEVICE)
    digests = torch.zeros(pool.num_slots, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="exceed"):
        dl.stamp_list(group, layout, digests, ws, log, torch.zeros(17, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="DeviceLayout"):
        dl.stamp_list(group, pool.layout, digests, ws, log, torch.zeros(1, dtype=torch.int64, device=DEVICE))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="digests"):
        dl.stamp_list(group, layout, digests[:-1], ws, log, torch.zeros(1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="locs"):
        dl.stamp_list(group, layout, digests, ws, log, torch.zeros(1, device=DEVICE))
    assert not digests.any() and not log.counters.any()


def _fast_case(case: str, g: torch.Generator) -> list[D.KVComponent]:
    """Engine-shaped pools (two layers where it matters) for the kernel's fast paths."""
    bf16, lc = torch.bfloat16, dc.layer_components
    if case == "bf16-paged16-h8-d128":
        return lc("paged_token_major", 3, 16, 8, 128, bf16, g) + lc("paged_token_major", 3, 16, 8, 128, bf16, g)
    if case == "fp16-token-h2-d64":
        return lc("token_major", 37, 1, 2, 64, torch.float16, g)
    if case == "fp32-headmajor-h4-d32":
        return lc("paged", 5, 4, 4, 32, torch.float32, g)
    if case == "bf16-odd-word-offset":  # storage one word into its allocation
        return [D.token_major(dc.random_storage((4 + 29 * 4 * 64,), bf16, g)[4:].reshape(29, 4, 64)) for _ in "kv"]
    if case == "bf16-block3":
        return lc("paged_token_major", 7, 3, 2, 16, bf16, g)
    assert case == "fp8-d128-scales"
    scales = D.scales(dc.random_storage((48, 2), torch.float32, g), 16)
    return [*lc("paged_token_major", 3, 16, 2, 128, torch.float8_e4m3fn, g), scales]


# The kernel path each launch takes at the default tuning: (exact tiles, two-word loads, log2 block size).
FAST_CASES = {
    "bf16-paged16-h8-d128": [(True, True, 4)],
    "fp16-token-h2-d64": [(True, True, 0)],
    "fp32-headmajor-h4-d32": [(True, True, 2)],
    "bf16-odd-word-offset": [(True, False, 0)],
    "bf16-block3": [(True, True, -1)],
    "fp8-d128-scales": [(False, False, 4), (True, True, 4)],  # scales: 4-byte elements, then fp8 as words
}


@pytest.mark.parametrize("tuning", list(TUNINGS))
@pytest.mark.parametrize("case", list(FAST_CASES))
def test_engine_shaped_pools_take_the_fast_paths_and_match(case: str, tuning: str) -> None:
    comps = _fast_case(case, torch.Generator().manual_seed(len(case)))
    slots = min(c.shape.num_slots for c in comps)
    pool = _on_device(dc.Pool(D.DigestLayout(tuple(comps)), slots))
    t = TUNINGS[tuning]
    taken = [(*lc.path(t)[2:], lc.block_log) for lc in dl.DeviceLayout.build(pool.layout).classes]
    if tuning == "default":
        assert taken == FAST_CASES[case]
    group = CanaryGroup(num_slots=slots, reserved_slots=(1,))
    twin = Twin(group, pool.layout, entries=128, log_rows=8, tuning=t)
    everything = torch.arange(slots, device=DEVICE)
    twin.call("stamp_list", everything)
    rng = random.Random(len(case))
    flipped = set()
    for comp in pool.layout.components:
        s = rng.choice([0, 2, slots - 1, rng.randrange(slots)])
        dc.flip_random_bit(comp, s, rng)
        flipped.add(s)
    twin.call("verify_list", everything)
    assert int(twin.log.counters[16]) == len(flipped - {1})


def test_small_launches_read_whole_head_rows_and_large_ones_keep_the_tuning() -> None:
    t = dl.DigestTuning(block_words=64, warps=4, small_block_words=256, small_warps=8)
    small = t.for_units(units=56, programs=1056)  # a decode step's stamp: one unit a program at most
    assert (small.block_words, small.warps) == (256, 8)
    assert small.tile(heads=8, words_per_head=32) == (8, 32)  # all 8 heads of 32 words in one step
    assert t.tile(heads=8, words_per_head=32) == (2, 32)  # the streaming tile: four steps
    assert t.for_units(units=7168, programs=1056) == t  # more units than programs: unchanged
    assert dl.DigestTuning(block_words=512, small_block_words=256).for_units(1, 3).block_words == 512  # never narrower
    for bad, named in (({"small_block_words": 96}, "small_block_words"), ({"small_warps": 0}, "small_warps")):
        with pytest.raises(ValueError, match=named):
            dl.DigestTuning(**bad)
