# mypy: disable-error-code="no-untyped-def"
"""The link hash of :mod:`kvcanary.hashing` on device, in uint64 (wrapping multiply, logical shifts)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary import hashing
from kvcanary.ops.kernels.const import const

LINK_MULT = const(hashing.LINK_MULT)
LINK_ANCHOR = const(hashing.to_signed64(hashing.LINK_ANCHOR))
MIX_SALT = const(hashing.MIX_SALT)
FMIX_C1 = const(hashing.FMIX_C1)
FMIX_C2 = const(hashing.FMIX_C2)
LOW32 = const(hashing.MASK32)
EVEN = const(hashing.MASK64 - 1)


@triton.jit
def fmix64(x):
    """:func:`kvcanary.hashing.fmix64` on uint64 (the link's mixer and the digest's term)."""
    x = x ^ (x >> 30)
    x = x * FMIX_C1
    x = x ^ (x >> 27)
    x = x * FMIX_C2
    return x ^ (x >> 31)


@triton.jit
def mix(token32, position32):
    """:func:`kvcanary.hashing.mix` on int32 tensors; returns the even int64 contribution."""
    word = (position32.to(tl.int64) << 32) | (token32.to(tl.int64) & LOW32)
    x = fmix64(word.to(tl.uint64, bitcast=True) ^ MIX_SALT)
    return (x & EVEN).to(tl.int64, bitcast=True)


@triton.jit
def link_step(prev_link, token32, position32):
    """:func:`kvcanary.hashing.link_step` on int64 links (two's-complement storage)."""
    m = mix(token32, position32).to(tl.uint64, bitcast=True)
    return (prev_link.to(tl.uint64, bitcast=True) * LINK_MULT + m).to(tl.int64, bitcast=True)
