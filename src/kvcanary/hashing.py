"""Link hash: the chain that ties each KV slot's record to its predecessor.

A record at position p stores ``link_p = MULT * link_{p-1} + mix(token_p, position_p)`` (mod 2**64),
with ``link_{-1} = ANCHOR``.  Three properties follow from that shape:

* verifiable from the predecessor alone: ``link_p`` is recomputed from the stored ``link_{p-1}`` and
  the record's own stored token and position;
* associative: each step is the affine map ``x -> MULT * x + m``; affine maps compose associatively,
  so a long chunk can be stamped with a parallel scan;
* zero-safe: ``ANCHOR`` and ``MULT`` are odd and ``mix`` is always even, so every link is odd and can
  never equal 0, the value of an empty (never written) record.

``mix`` is injective in neither argument by accident: it packs (position, token) into one 64-bit word
and applies the SplitMix64 finaliser after a salt, then clears bit 0.

This module holds the scalar spec on Python ints (used by the oracle and the pinned vectors) and the
vectorised form on int64 tensors (used by the reference path).  All arithmetic is modulo 2**64; the
tensor form relies on int64 multiplication wrapping, which the pinned vectors check.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1

LINK_MULT = 0x9E3779B97F4A7C15  # odd: the affine step is a bijection of the predecessor link
LINK_MULT_INV = pow(LINK_MULT, -1, 1 << 64)
LINK_ANCHOR = 0x6B7663616E617279  # "kvcanary", odd
MIX_SALT = 0xD6E8FEB86659FD93
FMIX_C1 = 0xBF58476D1CE4E5B9
FMIX_C2 = 0x94D049BB133111EB

EMPTY_LINK = 0  # the link of a record that was never written


def to_signed64(value: int) -> int:
    """Two's-complement view of a 64-bit unsigned value, as stored in int64 tensors."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


def to_unsigned64(value: int) -> int:
    return value & MASK64


# --------------------------------------------------------------------------- scalar spec (Python int)


def fmix64(x: int) -> int:
    """SplitMix64 finaliser on an unsigned 64-bit value."""
    x &= MASK64
    x ^= x >> 30
    x = (x * FMIX_C1) & MASK64
    x ^= x >> 27
    x = (x * FMIX_C2) & MASK64
    x ^= x >> 31
    return x


def mix(token: int, position: int) -> int:
    """Even 64-bit contribution of one (token, position) pair; both are taken as 32-bit values."""
    word = ((position & MASK32) << 32) | (token & MASK32)
    return fmix64(word ^ MIX_SALT) & ~1 & MASK64


def link_step(prev_link: int, token: int, position: int) -> int:
    """Link of a record whose predecessor's link is ``prev_link`` (unsigned 64-bit result)."""
    return (LINK_MULT * (prev_link & MASK64) + mix(token, position)) & MASK64


# --------------------------------------------------------------------------- vectorised form (int64)

_S_MULT = to_signed64(LINK_MULT)
_S_SALT = to_signed64(MIX_SALT)
_S_C1 = to_signed64(FMIX_C1)
_S_C2 = to_signed64(FMIX_C2)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift on int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def fmix64_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 30)
    x = x * _S_C1
    x = x ^ _shr(x, 27)
    x = x * _S_C2
    return x ^ _shr(x, 31)


def mix_t(token32: torch.Tensor, position32: torch.Tensor) -> torch.Tensor:
    """Vectorised :func:`mix`; inputs are int32 tensors (their bit patterns are used)."""
    word = (position32.to(torch.int64) << 32) | (token32.to(torch.int64) & MASK32)
    return fmix64_t(word ^ _S_SALT) & ~1


def link_step_t(prev_link: torch.Tensor, token32: torch.Tensor, position32: torch.Tensor) -> torch.Tensor:
    """Vectorised :func:`link_step` on int64 links (two's-complement storage)."""
    return prev_link * _S_MULT + mix_t(token32, position32)


def power_table(base: int, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[base**0, base**1, ..., base**(length-1)]`` mod 2**64 as int64, built by doubling."""
    out = torch.ones(max(length, 1), dtype=torch.int64, device=device)
    filled, step = 1, to_signed64(base)
    while filled < length:
        n = min(filled, length - filled)
        out[filled : filled + n] = out[:n] * step
        filled += n
        step = to_signed64(to_unsigned64(step) * to_unsigned64(step))
    return out[:length]
