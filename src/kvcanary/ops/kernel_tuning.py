"""The kernels' tuning (block sizes, warps, grid shape) and the work shapes the launchers derive from it.

Everything here is static: it reads the capacities (workspace shapes) and the device's SM count, never a
batch's values, so a captured graph keeps its launches.
"""

from __future__ import annotations

import dataclasses

import torch

from kvcanary.layout import CanaryGroup
from kvcanary.workspace import PlanWorkspace


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Block sizes and grid shape.  Blocks are powers of two, at least PlanWorkspace.SCRATCH_BLOCK."""

    # Defaults: the best of benchmarks/results/nvidia-h200-9376e1c-sweep.txt (H200, triton 3.6), with the
    # verify's tile and grid from the full-grid sweep in nvidia-h200-98b7195-kernel-sweep.txt (27 tunings,
    # five scenarios: 512 entries on 4 warps took decode b256 x 16k from 101.8 to 95.4 us and the 4k
    # window from 83.6 to 68.7 us; the verify is register-bound, and smaller items keep more programs an SM).
    verify_block: int = 512  # entries per verify item (a sliding window group uses min(this, window))
    verify_warps: int = 4
    # Registers a verify thread may use (ptx .maxnreg; 0: the compiler's choice).  At large steps the verify is
    # latency-bound with its occupancy capped by registers (ncu: 128 a thread, 4 blocks an SM, 54 % of stalls on
    # memory), so fewer registers and more programs per SM (programs_per_sm) let more loads fly.
    verify_maxnreg: int = 0
    stamp_block: int = 512  # tokens per stamp item
    stamp_warps: int = 8
    carry_block: int = 512  # tokens per step when the finalize re-sums a row's earlier tokens
    stamp_polls: int = 32  # times a stamp item re-reads its row's earlier items' flags before recomputing
    row_block: int = 1024  # batch rows per step of the plan's row walk
    programs_per_sm: int = 4  # grid = min(work items the capacities allow, this * SM count)
    interpreter_programs: int = 3  # grid under the interpreter: few, so tests stay fast
    interpreter_polls: int = 2  # the interpreter runs programs one after another: polling cannot help there
    # plan_verify is one launch up to this many rows (see fuses_plan); 0 turns it off.  8: on the H200 the fused
    # launch took decode b1 from 12.4 to 10.9 us and a prefill step from 15.1 to 13.3 us; at 32 rows it won at
    # b32 x 512 (15.1 -> 13.5 us) but lost at b32 x 4k (16.2 -> 16.7 us), so batches past 8 keep two launches.
    fuse_max_batch: int = 8

    def __post_init__(self) -> None:
        for name in ("verify_block", "stamp_block", "carry_block", "row_block"):
            v = getattr(self, name)
            if v < PlanWorkspace.SCRATCH_BLOCK or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= {PlanWorkspace.SCRATCH_BLOCK}, got {v}")
        for name in ("verify_warps", "stamp_warps", "programs_per_sm", "interpreter_programs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.verify_maxnreg and not 32 <= self.verify_maxnreg <= 255:
            raise ValueError(f"verify_maxnreg must be 0 or in [32, 255], got {self.verify_maxnreg}")
        for name in ("stamp_polls", "interpreter_polls", "fuse_max_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


DEFAULT_TUNING = KernelTuning()


def verify_block(group: CanaryGroup, tuning: KernelTuning = DEFAULT_TUNING) -> int:
    """Entries per verify item: a window shorter than the block would leave most lanes idle."""
    if group.window > 0:
        fit = max(PlanWorkspace.SCRATCH_BLOCK, 1 << (group.window - 1).bit_length())
        return min(tuning.verify_block, fit)
    return tuning.verify_block


def grid(max_items: int, dev: torch.device, tuning: KernelTuning) -> tuple[int]:
    if dev.type == "cuda":
        cap = torch.cuda.get_device_properties(dev).multi_processor_count * tuning.programs_per_sm
    else:
        cap = tuning.interpreter_programs
    return (max(1, min(max_items, cap)),)


def row_block(ws: PlanWorkspace, tuning: KernelTuning) -> int:
    b = max(1, int(ws.row_state.shape[0]))
    return min(tuning.row_block, max(16, 1 << (b - 1).bit_length()))


def fuses_plan(group: CanaryGroup, ws: PlanWorkspace, capacity: int, tuning: KernelTuning = DEFAULT_TUNING) -> bool:
    """Whether :func:`~kvcanary.ops.launchers.plan_verify` is one launch: the workspace admits at most
    ``fuse_max_batch`` rows and the verify launch's grid fits one wave (one program per SM; always under
    the interpreter).

    Static (capacities only), so a captured graph keeps its launches.  Larger workspaces keep the plan
    launch: the fused kernel holds every row's spans in registers (198 per thread on Triton 3.6, one
    block per SM) and pays block-wide reductions per item, which measured slower beyond small steps
    (benchmarks/README.md, commit 49ac254: decode b32 x 16k 33.9 us fused against 26.4 us in three launches).
    """
    max_b = int(ws.row_state.shape[0])
    verify_items = -(-capacity // verify_block(group, tuning)) + max_b
    return small_step(ws, max(verify_items, write_items(ws, tuning)), tuning)


def write_items(ws: PlanWorkspace, tuning: KernelTuning) -> int:
    """Stamp items of the largest step the workspace admits."""
    return -(-(int(ws.mult_powers.shape[0]) - 1) // tuning.stamp_block) + int(ws.row_state.shape[0])


def small_step(ws: PlanWorkspace, items: int, tuning: KernelTuning) -> bool:
    """Few rows (one row block, at most fuse_max_batch) and a grid of one wave: kernels may derive the row
    spans from the lengths in registers instead of reading the plan's."""
    max_b = int(ws.row_state.shape[0])
    if max_b > tuning.fuse_max_batch or max_b > row_block(ws, tuning):
        return False
    dev = ws.sync.device
    return dev.type != "cuda" or items <= torch.cuda.get_device_properties(dev).multi_processor_count
