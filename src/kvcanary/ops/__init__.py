"""Per-step operations on one group: plan, verify, stamp.

``reference`` is the PyTorch spec; kernels (when present) match it byte for byte.  :func:`backend_for`
picks the implementation; policy (when to call what, what to do with violations) lives elsewhere.
"""

from __future__ import annotations

import enum


class Backend(enum.Enum):
    AUTO = "auto"  # kernels for CUDA tensors, the reference otherwise
    REFERENCE = "reference"
    TRITON = "triton"  # forced kernels; on CPU they need TRITON_INTERPRET=1
