"""The slotted staging's upload (``ops/kernels/staged_upload.py``) against its torch spec (``upload_reference``),
word for word: sizes below, at and past one program's block, every slot in turn, the words past the header's count
left alone.  Under the interpreter on CPU; compiled on CUDA, reading pinned slots."""

from __future__ import annotations

import pytest
import torch

from kvcanary.adapters.transformers_cb.staging import (
    HEAD_WORDS,
    NUM_SLOTS,
    UPLOAD_BLOCK,
    UploadLaunch,
    upload_reference,
)

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("words", [1, 7, UPLOAD_BLOCK, UPLOAD_BLOCK + 3, 3 * UPLOAD_BLOCK - 1])
def test_the_upload_kernel_does_what_its_torch_spec_does(words: int) -> None:
    dev = torch.device("cuda") if CUDA else torch.device("cpu")
    capacity = 3 * UPLOAD_BLOCK  # the device buffer's words
    gen = torch.Generator().manual_seed(words)
    slots = torch.randint(-(2**62), 2**62, (NUM_SLOTS, HEAD_WORDS + capacity), generator=gen, dtype=torch.int64)
    slots = slots.pin_memory() if CUDA else slots
    device_words = torch.full((capacity,), -1, dtype=torch.int64, device=dev)
    want = device_words.cpu()
    seq = torch.zeros(2, dtype=torch.int64, device=dev)
    launch = UploadLaunch(slots, device_words, seq)
    for step in range(NUM_SLOTS + 2):  # every slot, then round again
        slots[step % NUM_SLOTS, 0] = max(1, words - step)  # each slot's own count
        seq[0] = step
        launch.run()
        upload_reference(slots, want, seq.cpu())
        assert torch.equal(device_words.cpu(), want), step
    assert (want[words:] == -1).all()  # never past the largest count
