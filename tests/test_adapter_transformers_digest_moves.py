"""The transformers adapter notes where moved KV bytes came from, so a digest mismatch names its layer.

A fork copy (device blocks -> device blocks) and a CPU-offload restore (host blocks -> device blocks) are
remembered with their sources (``GroupDigest.note_move``; the host pool read through its own layout,
:func:`~kvcanary.adapters.transformers_cb.digest_layout.host_layout`).  Damage several bytes of one layer
of a copied or restored block -- more than one bit, so only the intact source can explain it -- and the
``digest_mismatch`` must name exactly that layer through the source; the clean control of the same
workload (forks, offloads and restores included) reports nothing.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch

from kvcanary.adapters.transformers_cb.byte_moves import block_view
from kvcanary.adapters.transformers_cb.digest_layout import digest_layouts, host_layout
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.selftest.context import (
    FULL,
    FaultContext,
    wrap_restore,
)
from kvcanary.adapters.transformers_cb.selftest.data import ForkCopyCorruptsBytes, OffloadRestoreStaleBytes
from kvcanary.adapters.transformers_cb.selftest.driver import run_engine
from kvcanary.adapters.transformers_cb.selftest.workload import PAGE_SIZE, build_model
from kvcanary.digest import DigestLayout
from kvcanary.digest_locate import component_terms
from kvcanary.selftest.protocol import Fault, InjectMode, RunOutcome, RunSpec
from kvcanary.selftest.runner import judge

LAYER = 1  # the damaged layer (the workload's models have layers 0 and 1): its V row of the block's first token


def damage_one_layer(alloc: Any, block: int) -> None:
    """Invert every byte of layer ``LAYER``'s V row of the block's first token (many bits: no single flip)."""
    row = alloc._kv_token_views[LAYER][1][block * int(alloc.block_physical_stride)]
    row.view(torch.uint8).bitwise_not_()


class ForkCopyDamagesOneLayer(ForkCopyCorruptsBytes):
    """A fork copy lands where it should, then one layer's row of the first copied block is rewritten."""

    def __init__(self) -> None:
        self.sources: list[int] = []  # source block of the damaged destination block

    def damage(self, alloc: Any, dst: int, src: int) -> str:
        damage_one_layer(alloc, dst)
        self.sources.append(src)
        return f"layer {LAYER} V"


class RestoreDamagesOneLayer(OffloadRestoreStaleBytes):
    """A restore reads the right host block into the right device block, then one layer's row is rewritten."""

    def __init__(self) -> None:
        self.sources: list[int] = []  # host block the damaged device block was restored from

    def install(self, ctx: FaultContext) -> None:
        def restore(alloc: Any, om: Any, inner: Callable[[list[Any]], Any], requests_in_batch: list[Any]) -> Any:
            held = om._request_id_to_cpu_blocks
            options = [
                (fs.state.request_id, int(held[fs.state.request_id][FULL][0]))
                for fs in requests_in_batch
                if fs.state.is_cpu_offloaded and held.get(fs.state.request_id, {}).get(FULL)
            ]
            out = inner(requests_in_batch)
            if options and ctx.take(self.name):
                rid, host_block = ctx.rng.choice(options)
                damage_one_layer(alloc, int(alloc.block_table[rid][0]))
                self.sources.append(host_block)
                ctx.injected(f"block restored from host block {host_block} of {rid!r}: layer {LAYER} V damaged", [rid])
            return out

        wrap_restore(ctx, restore)


@pytest.fixture(scope="module")
def dense_model() -> torch.nn.Module:
    model: torch.nn.Module = build_model("dense", seed=0)
    return model


def _trial(model: torch.nn.Module, make: Callable[[], Fault[Any]], seed: int) -> tuple[RunOutcome, Fault[Any]]:
    """The clean control (silent, with forks, offloads and restores) and one injected run at a middle chance."""
    control = run_engine(model, RunSpec("dense", seed, [make()]))
    assert control.violations == 0 and control.errors == [], control.reports
    assert min(control.features[k] for k in ("fork_block_copies", "offloads", "restores")) > 0, control.features
    name = make().name
    chances = control.opportunities[name]
    assert chances, f"the workload gave {name} no chance"
    target = chances[len(chances) // 2]
    fault = make()
    spec = RunSpec("dense", seed, [fault], InjectMode.INJECT, target=(name, target), store=control.store)
    out = run_engine(model, spec)
    trial = judge(fault.spec, seed, target, out)
    assert trial.outcome == "caught" and trial.expected_check and trial.attributed, trial
    return out, fault


def _mismatch_notes(out: RunOutcome) -> set[str]:
    return {v.note for r in out.reports for v in r.violations if "digest_mismatch" in v.reasons}


# Seed 3: the parent's copied block still holds its bytes when the child reads the damaged copy, so the
# source names the layer.  Seed 11: this memory-tight workload has freed the parent's block and given it to
# a new request by then (source slot 32 holds another request's position 0): the source no longer sums to
# the stored digest, so it is not used -- no layer is named rather than a wrong one (many bits changed: the
# single-bit search finds nothing either).
@pytest.mark.parametrize(("seed", "source_intact"), [(3, True), (11, False)])
def test_a_fork_copy_damaged_in_one_layer_names_that_layer_via_its_source(
    dense_model: torch.nn.Module, seed: int, source_intact: bool
) -> None:
    out, fault = _trial(dense_model, ForkCopyDamagesOneLayer, seed)
    assert isinstance(fault, ForkCopyDamagesOneLayer) and len(fault.sources) == 1
    src_slot = fault.sources[0] * PAGE_SIZE
    named = f"digest: bytes differ from their copy source (index {src_slot}) in layer{LAYER}.v"
    not_found = "digest: layer not found (the bytes differ beyond one bit and no intact copy is known)"
    assert _mismatch_notes(out) == {named if source_intact else not_found}


@pytest.mark.parametrize("seed", [3, 11])
def test_a_restore_damaged_in_one_layer_names_that_layer_via_the_host_copy(
    dense_model: torch.nn.Module, seed: int
) -> None:
    out, fault = _trial(dense_model, RestoreDamagesOneLayer, seed)
    assert isinstance(fault, RestoreDamagesOneLayer) and len(fault.sources) == 1
    src_slot = fault.sources[0] * PAGE_SIZE
    expected = f"digest: bytes differ from their host copy (index {src_slot}) in layer{LAYER}.v"
    assert _mismatch_notes(out) == {expected}


def _stand_in(layers: list[int], page: int, blocks: int, heads: int, dim: int, dtype: torch.dtype) -> Any:
    """A full-attention allocator over one flat byte tensor, laid out as transformers lays it out."""
    stride = 2 * page * len(layers)
    raw = torch.randint(0, 256, (blocks * stride * heads * dim * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8)  # fmt: skip
    flat = raw.view(dtype).view(blocks * stride, heads, dim)
    views = {layer: (flat[(2 * i) * page :], flat[(2 * i + 1) * page :]) for i, layer in enumerate(layers)}
    return types.SimpleNamespace(
        layer_type="full_attention", layer_indices=layers, _kv_token_views=views, cache_tensor=flat,
        bytes_per_block=raw.numel() // blocks, block_physical_stride=stride,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_host_layout_reads_a_host_block_as_the_device_layout_reads_its_block(dtype: torch.dtype) -> None:
    page, blocks, heads, dim = 3, 5, 2, 7
    alloc = _stand_in([0, 2, 5], page, blocks, heads, dim, dtype)
    geometry = GroupGeometry("full_attention", 0, 0, page, alloc.block_physical_stride, blocks, 0, 1, 0)
    device = digest_layouts(types.SimpleNamespace(cache_allocators={"f": alloc}), {geometry.name: geometry}, None)
    layout: DigestLayout = device["full_attention"]
    rows = block_view(alloc)
    host = torch.zeros(4, rows.shape[1], dtype=torch.uint8)
    host[2] = rows[3]  # an offload of device block 3 into host block 2, as the engine copies it: raw bytes
    on_host = host_layout(layout, rows, host)
    assert on_host is not None and [c.name for c in on_host.components] == [c.name for c in layout.components]
    assert on_host.num_slots == 4 * page
    for offset in range(page):
        assert torch.equal(component_terms(on_host, 2 * page + offset), component_terms(layout, 3 * page + offset))
        assert not torch.equal(component_terms(on_host, 1 * page + offset), component_terms(layout, 3 * page + offset))
    # A pool whose rows are not the device's blocks (another block size) is not read at all.
    assert host_layout(layout, rows, host.view(-1)[: 4 * (rows.shape[1] - 2)].view(4, -1)) is None


def test_noted_sources_hold_the_moved_bytes_in_every_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the real engine (hybrid: a sliding and a full group over one tensor), every noted source -- device
    blocks of a fork copy, host blocks of a restore read through the swap pool's layout -- holds, right after
    the move, exactly the bytes its destination received, component by component (a clean run)."""
    from kvcanary.digest_canary import GroupDigest

    seen: dict[tuple[str, str], int] = {}
    original = GroupDigest.note_move

    def note_move(
        self: GroupDigest, dest: torch.Tensor, src: torch.Tensor, layout: Any = None, what: str = "copy source"
    ) -> None:
        source_layout = self.layout if layout is None else layout
        for d, s in zip(dest.tolist(), src.tolist(), strict=True):
            assert torch.equal(component_terms(self.layout, d), component_terms(source_layout, s)), (what, d, s)
        seen[(self.canary.group.name, what)] = seen.get((self.canary.group.name, what), 0) + int(dest.numel())
        original(self, dest, src, layout, what)

    monkeypatch.setattr(GroupDigest, "note_move", note_move)
    model = build_model("hybrid", seed=0)
    out = run_engine(model, RunSpec("hybrid", 11, [RestoreDamagesOneLayer()]))
    assert out.violations == 0 and out.errors == [] and out.features["restores"] > 0, out.features
    groups = ("full_attention", "sliding_attention")
    assert {(g, w) for g in groups for w in ("copy source", "host copy")} <= set(seen), seen
