"""Session set-up shared by all test modules: keep it minimal."""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before anything imports
# kvcanary.ops.kernels.  Without a GPU the kernels can only run under the interpreter; with one, the
# kernel tests use CUDA tensors and compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
