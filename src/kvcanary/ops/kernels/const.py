"""Module-level kernel constants: ``tl.constexpr`` values that Triton's per-launch check compares cheaply.

Triton accepts a global in ``@triton.jit`` code only as a ``tl.constexpr`` instance, and before every
launch it compares each global a kernel uses with the copy it kept at compile time (``!=``).
``tl.constexpr`` implements ``!=`` as a constexpr operation (several Python calls and a new object), and
with the ~30 constants a kernel uses that check cost tens of microseconds of host time per launch (H200
demo profile, issue 14).  :class:`const` answers the comparison of two equal constants at once and is a
``tl.constexpr`` everywhere else, so kernels compile exactly as before.
"""

from __future__ import annotations

import triton.language as tl


class const(tl.constexpr):  # type: ignore[misc]  # lower case: it reads as the constexpr it stands for
    def __ne__(self, other: object) -> bool | tl.constexpr:
        if type(other) is const and other.value == self.value:
            return False
        return super().__ne__(other)
