"""The step's close as one launch (``ops/kernels/step_close.py``) against its spec, the four torch ops of
``StepWork.after`` on CPU: the snapshot, the running totals, the cleared live log and the phase mark, word for
word.  Under the interpreter on CPU, and compiled on CUDA, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kvcanary.canary import GroupCanary
from kvcanary.layout import CanaryGroup
from kvcanary.ops import Backend
from kvcanary.runtime.buffers import Layout, StepWork
from runtime_helpers import CAPS, NUM_SLOTS

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()


def _works(groups: int, log_rows: int, dev: torch.device) -> tuple[StepWork, StepWork]:
    """The same step state in two StepWorks: the close as torch ops, and as the kernel."""
    canaries = [
        GroupCanary(CanaryGroup(num_slots=NUM_SLOTS, group_id=g, name=f"g{g}"), CAPS, dev, Backend.REFERENCE)
        for g in range(groups)
    ]
    layout = Layout([log_rows] * groups)
    ops, kernel = (StepWork(canaries, layout, dev, close_kernel=k) for k in (False, True))
    gen = torch.Generator().manual_seed(groups * 100 + log_rows)
    for t in ("live", "outbox"):
        values = torch.randint(-(2**62), 2**62, getattr(ops, t).shape, generator=gen, dtype=torch.int64).to(dev)
        getattr(ops, t).copy_(values)
        getattr(kernel, t).copy_(values)
    return ops, kernel


def _assert_same(ops: StepWork, kernel: StepWork) -> None:
    assert torch.equal(ops.outbox.cpu(), kernel.outbox.cpu())
    assert torch.equal(ops.live.cpu(), kernel.live.cpu())
    assert not torch.count_nonzero(kernel.live)


# Live sizes below, at and past one program's block (StepWork.CLOSE_BLOCK words), with 1 to 3 groups.
SHAPES = [(1, 1), (1, 36), (2, 18), (3, 37), (2, 50)]


@pytest.mark.parametrize(("groups", "log_rows"), SHAPES)
def test_the_close_kernel_does_what_the_torch_ops_do(groups: int, log_rows: int) -> None:
    dev = torch.device("cuda") if CUDA else torch.device("cpu")
    ops, kernel = _works(groups, log_rows, dev)
    for _ in range(2):  # the totals accumulate and the phase mark counts
        ops.close()
        kernel.close()
        _assert_same(ops, kernel)
        ops.live.fill_(5)
        kernel.live.fill_(5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_close_kernel_replays_from_a_cuda_graph() -> None:
    ops, kernel = _works(2, 40, torch.device("cuda"))
    graph = torch.cuda.CUDAGraph()
    kernel.close()  # compiled before the capture
    ops.close()
    with torch.cuda.graph(graph):
        kernel.close()
    for fill in (7, -3):
        ops.live.fill_(fill)
        kernel.live.fill_(fill)
        ops.close()
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(ops, kernel)
