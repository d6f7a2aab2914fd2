"""Kernels vs reference on random cases from ``gen``: every output identical after every phase.

Compared after plan, verify and stamp: records (slots written twice in one step: each field from one of
the writes), the workspace prefixes, the whole log (first K, last K, counters) and the kernels' own
scratch (back to zero).  Grids and block sizes vary between chunks so that programs walk several items,
share rows, and several programs finish the log.  On a GPU the batches are int64 except in a few mixed
chunks, which bounds the number of kernel compilations.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import gen
from kernel_compare import DEVICE, compare_step
from kvcanary.ops import launchers

pytestmark = pytest.mark.gpu if DEVICE.type == "cuda" else pytest.mark.interpreter


CHUNK = 20
CORRUPT_CHUNKS = 11  # 220 corrupted batches
CLEAN_CHUNKS = 3  # 60 clean batches

# Under the interpreter: a few programs; on the GPU: the grid from the SM count.
_TUNINGS = (
    launchers.KernelTuning(interpreter_programs=3, fuse_max_batch=32),  # plan_verify: 1 launch (small batches)
    launchers.KernelTuning(interpreter_programs=1, programs_per_sm=1, fuse_max_batch=0),  # plan_verify: 2 launches
    launchers.KernelTuning(
        verify_block=128, stamp_block=128, carry_block=128, interpreter_programs=5, programs_per_sm=2
    ),
)


def _index_dtype(chunk: int, i: int) -> torch.dtype | None:
    """None keeps the generator's mix of int32 and int64 tensors; each mix is a new compile on a GPU."""
    if DEVICE.type == "cuda" and not (chunk == 1 and i < 5):
        return torch.int64
    return None


def _run_chunk(first_seed: int, chunk: int, corrupt: bool) -> None:
    """Even chunks run plan and verify as one launch (GroupCanary.step's path), odd ones as two."""
    tuning = _TUNINGS[chunk % len(_TUNINGS)]
    fused = chunk % 2 == 0
    failures = []
    for i, seed in enumerate(range(first_seed, first_seed + CHUNK)):
        case = gen.random_case(seed, corrupt=corrupt)
        problems = compare_step(case, tuning=tuning, index_dtype=_index_dtype(chunk, i), fused=fused)
        if problems:
            failures.append(f"{case.describe()}\n  " + "\n  ".join(problems))
    assert not failures, f"{len(failures)} of {CHUNK} cases differ ({tuning}, fused={fused}):\n" + "\n".join(
        failures[:3]
    )


@pytest.mark.parametrize("chunk", range(CORRUPT_CHUNKS))
def test_corrupted_batches_match_reference(chunk: int) -> None:
    _run_chunk(1_000 + chunk * CHUNK, chunk, corrupt=True)


@pytest.mark.parametrize("chunk", range(CLEAN_CHUNKS))
def test_clean_batches_match_reference(chunk: int) -> None:
    _run_chunk(50_000 + chunk * CHUNK, chunk, corrupt=False)
