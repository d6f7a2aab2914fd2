"""The paged link kernels compile (sm_90 PTX, on the CPU) without a 64-bit division on their per-entry paths."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_paged_kernels_page_positions_without_64_bit_divisions() -> None:
    """scripts/gpu/kernel_divisions.py compiles every paged verify and stamp variant of eight random cases and
    fails when one carries more 64-bit divisions than the log's paths (each one a call of about 80 instructions
    a lane: the int64 paging of a position cost the fused verify 20 of them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(str(ROOT / d) for d in ("src", "tests", "scripts/gpu"))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/gpu/kernel_divisions.py"), "8"],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "paged variants, at most" in proc.stdout
