"""plan -> verify -> stamp captured once in a CUDA graph and replayed step after step with the inputs
refilled in place: every step must equal the same step run eagerly by the kernels and by the reference.

Steps include faults (bad table entries, indices out of range, a reserved write slot, a bad row) so
the log paths replay too.  Needs CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_twins import State, World
from kvcanary import CanaryGroup, Capacities, GroupKind, StepBatch
from kvcanary.ops import launchers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 24
ROWS = 6
PER_STEP = 2  # tokens each request writes per step: the step's shapes never change


def _faulty(world: World, batch: StepBatch, step: int) -> None:
    """Faults on some steps, none on others (then the step must stay silent)."""
    if step == 5:
        batch.table[1, 3] = batch.table[2, 3]
    elif step == 8:
        batch.table[3, 1] = -7
    elif step == 11:
        batch.out_cache_loc[2] = 0  # reserved
    elif step == 14:
        batch.table[2, 2] = 2**31 - 1
    elif step == 17:
        batch.rows[0] = 99
    elif step == 20:
        batch.positions[4] += 3


def _static_like(batch: StepBatch) -> StepBatch:
    return StepBatch(**{k: None if v is None else v.to("cuda").clone() for k, v in batch.tensors().items()})


def _refill(static: StepBatch, batch: StepBatch) -> None:
    for name, t in static.tensors().items():
        if t is not None:
            t.copy_(getattr(batch, name))  # same shapes, same dtypes: in place


def _run(group: CanaryGroup, batch: StepBatch, st: State, caps: Capacities) -> None:
    launchers.plan(st.of(group), batch)
    launchers.verify(st.of(group), batch, caps.verify_entries)
    launchers.stamp(st.of(group), batch)


@pytest.mark.parametrize("shape", [{}, {"window": 9, "lookup": True}], ids=["full", "window-lookup"])
def test_graph_replay_matches_eager_and_reference(shape: dict[str, int]) -> None:
    from kvcanary.ops import reference as ref

    world = World.make(rows=ROWS, context=STEPS * PER_STEP + 8, **shape)
    group = world.group
    assert group.kind is (GroupKind.SLIDING_WINDOW if shape else GroupKind.FULL)
    caps = Capacities(max_batch=ROWS, max_tokens=ROWS * PER_STEP, verify_entries=4096, max_context=64, log_rows=4)
    dev = torch.device("cuda")
    batches = []
    for step in range(STEPS):
        b = world.batch([(r, step * PER_STEP, PER_STEP) for r in range(1, ROWS + 1)], truth=True)
        _faulty(world, b, step)
        batches.append(b)

    graph_st, eager_st = State.make(group, caps, dev), State.make(group, caps, dev)
    ref_st = State.make(group, caps, torch.device("cpu"))
    static = _static_like(batches[0])
    scratch = State.make(group, caps, dev)
    _run(group, static, scratch, caps)  # compile outside the capture
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(group, static, graph_st, caps)

    for step, batch in enumerate(batches):
        _refill(static, batch)
        graph.replay()
        _run(group, _static_like(batch), eager_st, caps)
        ref.plan(ref_st.of(group), batch)
        ref.verify(ref_st.of(group), batch, caps.verify_entries)
        ref.stamp(ref_st.of(group), batch)
        torch.cuda.synchronize()
        eager_st.assert_equal(graph_st, batch.batch_size, f"graph step {step} vs eager")
        ref_st.assert_equal(graph_st, batch.batch_size, f"graph step {step} vs reference")
    assert ref_st.log.total() > 6  # the faulty steps were seen
