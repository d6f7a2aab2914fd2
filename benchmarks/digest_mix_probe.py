"""What bounds a digest-shaped read on a CUDA GPU: the mixing or the memory?

A probe, not the digest: [16 slots, 8 heads, 32 words] tiles of 64-bit words, 16,384 scattered slots x 56
components x 256 words (1.88 GB, a Qwen3-0.6B-shaped KV of 16k tokens), each tile summed per slot.
MODE 0 sums the words (a read with a reduction), 1 sums ``fmix64(word ^ key)`` with keys from a table
(the digest's term), 2 a mix built from 32-bit multiplies.  Results: ``results/nvidia-h200-ceed092-digest-checks.txt``.

Usage: PYTHONPATH=src python benchmarks/digest_mix_probe.py   (CUDA only)
"""

from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl

from kvcanary.ops.kernels.hashing import fmix64  # the digest's own term


@triton.jit
def _mix32(w, k):
    x = w ^ k
    a = (x & 0xFFFFFFFF).to(tl.uint32) * 0x9E3779B1
    b = (x >> 32).to(tl.uint32) * 0x85EBCA77
    b = b ^ (a >> 15)
    a = a ^ (b >> 13)
    a = a * 0xC2B2AE3D
    b = b * 0x27D4EB2F
    return (b.to(tl.uint64) << 32) | a.to(tl.uint64)


@triton.jit
def probe(pool_ptr, keys_ptr, slots_ptr, out_ptr, n_tiles, n_comp, comp_stride, slot_words,
          MODE: tl.constexpr, G: tl.constexpr, HB: tl.constexpr, BJ: tl.constexpr):  # fmt: skip
    for u in range(tl.program_id(0), n_tiles * n_comp, tl.num_programs(0)):
        tile = u // n_comp
        c = u % n_comp
        g = tile * G + tl.arange(0, G)
        row_off = c * comp_stride + tl.load(slots_ptr + g) * slot_words
        woff = (tl.arange(0, HB) * BJ)[:, None] + tl.arange(0, BJ)[None, :]
        key = tl.load(keys_ptr + c * HB * BJ + woff).to(tl.uint64)
        word = tl.load(pool_ptr + row_off[:, None, None] + woff[None, :, :]).to(tl.uint64)
        if MODE == 0:
            term = word
        elif MODE == 1:
            term = fmix64(word ^ key[None])
        else:
            term = _mix32(word, key[None])
        t = tl.sum(tl.sum(term, axis=2), axis=1)
        tl.atomic_add(out_ptr + g, t.to(tl.int64, bitcast=True), sem="relaxed")


def main() -> None:
    dev = torch.device("cuda")
    slots, n_comp, words, n = 65536, 56, 256, 16384
    pool = torch.randint(-(2**62), 2**62, (n_comp, slots, words), dtype=torch.int64, device=dev)
    keys = torch.randint(-(2**62), 2**62, (n_comp * words,), dtype=torch.int64, device=dev)
    sl = torch.randperm(slots, device=dev)[:n]
    out = torch.zeros(n, dtype=torch.int64, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    nbytes = n * n_comp * words * 8
    for mode in (0, 1, 2):
        for warps, pps in ((4, 4), (8, 2), (8, 4), (4, 8), (16, 2)):

            def run(mode: int = mode, warps: int = warps, pps: int = pps) -> None:
                probe[(sms * pps,)](pool, keys, sl, out, n // 16, n_comp, slots * words, words,
                                    MODE=mode, G=16, HB=8, BJ=32, num_warps=warps)  # fmt: skip

            run()
            torch.cuda.synchronize()
            times = []
            for _ in range(10):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            us = statistics.median(times)
            print(f"mode {mode} warps {warps} pps {pps}: {us:.0f} us {nbytes / us / 1e3:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
