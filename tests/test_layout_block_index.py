"""layout.block_index: the host block numbers that the record moves take, queued without waiting on CUDA."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from kvcanary.adapters.vllm import moves
from kvcanary.adapters.vllm.groups import VllmGroup
from kvcanary.layout import CanaryGroup, RecordStore, block_index
from test_adapter_transformers_cost import sync_debug

BS = 4


def _group(num_blocks: int) -> VllmGroup:
    canary = CanaryGroup(num_slots=num_blocks * BS, page_size=BS, reserved_slots=(0,), padding_row=None)
    return VllmGroup(canary, index=0, layer="model.layers.0.self_attn.attn", block_size=BS, zeroed_on_reuse=True)


@pytest.mark.parametrize("blocks", [[7], (3, 0, 11), range(5, 2, -1)])
def test_block_numbers_become_an_int64_index_in_their_order(blocks: Sequence[int]) -> None:
    index = block_index(blocks, torch.device("cpu"))
    assert index.dtype == torch.int64 and index.tolist() == list(blocks)


@pytest.mark.gpu
def test_vllm_block_zeroing_and_copies_on_cuda_never_wait_for_the_device() -> None:
    """vLLM's per-step block moves (zeroed fresh blocks, copy-on-write pairs) reach the device without a
    synchronous copy: the engine's forward queued before them keeps running while the host goes on."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    group = _group(8)
    records = RecordStore.allocate(group.canary.num_slots, torch.device("cuda"))
    records.links.copy_(torch.arange(1, 8 * BS + 1, dtype=torch.int64))
    with sync_debug("error"):
        torch.cuda._sleep(50_000_000)  # the forward still running
        assert moves.apply_zeroing(group, records, [3, 99]) == 1
        assert moves.apply_copies(group, records, [(2, 5), (5, 6)]) == 2
    links = records.links.view(8, BS).cpu()
    assert links[3].tolist() == [0] * BS
    assert links[5].tolist() == [2 * BS + 1 + i for i in range(BS)]  # block 2's records
    assert links[6].tolist() == [5 * BS + 1 + i for i in range(BS)]  # block 5's, read before it was written
