"""A few eager steps of bench_digest's decode b1 x 4k digest work (verify, then stamp): the program to put
under Nsight Compute (what a small step's two digest launches spend their time on).

Usage: PYTHONPATH=src:benchmarks ncu --kernel-name digest_kernel ... python scripts/gpu/digest_step_eager.py
"""

from __future__ import annotations

import torch

import bench_digest as b
from kvcanary.config import DigestConfig
from kvcanary.digest_canary import GroupDigest

dev = torch.device("cuda")
pool = b.Pool(1 << 16, dev)
canary, batch = b.decode_step(pool, 1, 4096, 1, dev)
digest = GroupDigest(canary, pool.layout, DigestConfig())
log = canary.new_log()
canary.plan(batch, log)
for _ in range(3):
    digest.verify(batch, log)
    digest.stamp(batch, log)
torch.cuda.synchronize()
print("violations", log.total())
