"""Unit tests on vLLM's real classes for what the CPU engine run does not exercise by itself: records follow
``copy_kv_cache_blocks_inplace`` byte for byte, same-step readers go to a later pass, the truth table follows
the runner's request state, and options parse from the environment."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from kvcanary.adapters.vllm import moves, translate
from kvcanary.adapters.vllm.groups import VllmGroup
from kvcanary.adapters.vllm.options import options_from_env
from kvcanary.adapters.vllm.truth import TruthTable
from kvcanary.config import Mode
from kvcanary.layout import CanaryGroup, RecordStore

BS = 32


def _group(num_blocks: int = 8, kernel_block: int = BS) -> VllmGroup:
    canary = CanaryGroup(num_slots=num_blocks * BS, page_size=kernel_block, reserved_slots=(0,), padding_row=None)
    return VllmGroup(canary, index=0, layer="model.layers.0.self_attn.attn", block_size=BS, zeroed_on_reuse=True)


@pytest.mark.parametrize("kernel_block", [BS, BS // 2])  # a kernel block smaller than the scheduler block
def test_record_copies_follow_vllms_own_block_copy(kernel_block: int) -> None:
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    num_blocks = 8
    group = _group(num_blocks, kernel_block)
    kernel_blocks = num_blocks * (BS // kernel_block)
    cache = torch.randn(kernel_blocks, 1, kernel_block, 8)  # [kernel blocks, heads, block, 2 * head]
    records = RecordStore.allocate(group.canary.num_slots)
    # Tag each slot's record with the slot itself, so the records say where each slot's bytes came from.
    flat = cache.reshape(num_blocks * BS, -1)
    records.positions.copy_(torch.arange(num_blocks * BS, dtype=torch.int32))
    records.links.copy_(torch.arange(1, num_blocks * BS + 1, dtype=torch.int64))
    before = flat.clone()
    pairs = [(2, 5), (3, 1), (5, 6)]  # 5 is a source and a destination: sources are read first
    copy_kv_cache_blocks_inplace([cache], num_blocks, pairs)
    assert moves.apply_copies(group, records, pairs) == 3
    after = cache.reshape(num_blocks * BS, -1)
    for slot in range(num_blocks * BS):
        src = int(records.positions[slot])
        assert torch.equal(after[slot], before[src]), slot  # the record names the slot the bytes came from


def test_zeroed_blocks_lose_their_records_and_out_of_pool_ids_are_ignored() -> None:
    group = _group()
    records = RecordStore.allocate(group.canary.num_slots)
    records.links.fill_(7)
    assert moves.apply_zeroing(group, records, [3, 99, -1]) == 1
    assert int(records.links[3 * BS : 4 * BS].abs().sum()) == 0
    assert int((records.links != 0).sum()) == (8 - 1) * BS
    assert moves.count_written(group, records, [3, 4]) == 1


def _view(prefix: list[int], extend: list[int], table: list[list[int]], page: int) -> translate.GroupView:
    slots = []
    for row, (p, e) in enumerate(zip(prefix, extend, strict=True)):
        slots += [table[row][pos // page] * page + pos % page for pos in range(p, p + e)]
    return translate.GroupView(
        torch.tensor(table, dtype=torch.int32),
        torch.tensor(prefix, dtype=torch.int32),
        torch.tensor(extend, dtype=torch.int32),
        torch.tensor(slots, dtype=torch.int64),
    )


def test_same_step_readers_are_verified_after_their_writers() -> None:
    # Row 0 writes blocks 1, 2 and part of 3; rows 1 and 2 hit blocks 1, 2 in the same step; row 3 reads only
    # block 7, written in an earlier step.
    table = [[1, 2, 3], [1, 2, 4], [1, 2, 5], [7, 6, 0]]
    view = _view([0, 64, 64, 32], [66, 2, 2, 1], table, BS)
    assert translate.passes([view], [1, 2, 3], [BS]) == [[0, 3], [1, 2]]
    assert translate.passes([view], [3], [BS]) is None  # no candidate reads this step's writes
    # A chain: row 2 reads block 4, which row 1 writes while reading row 0's blocks.
    chain = _view([0, 32, 64], [32, 32, 1], [[1, 0, 0], [1, 4, 0], [1, 4, 6]], BS)
    assert translate.passes([chain], [1, 2], [BS]) == [[0], [1], [2]]


def test_batch_for_a_pass_keeps_each_rows_tokens() -> None:
    view = _view([0, 64], [3, 2], [[1, 2, 3], [1, 2, 4]], BS)
    inputs = translate.StepInputs(
        2, 5, torch.arange(10, 15), torch.tensor([0, 1, 2, 64, 65]), torch.zeros(2, 70, dtype=torch.int32),
        torch.tensor([3, 66], dtype=torch.int32),
    )  # fmt: skip
    batch = translate.batch_for(view, inputs, [1])
    assert batch.rows.tolist() == [1] and batch.input_ids.tolist() == [13, 14]
    assert batch.positions.tolist() == [64, 65] and batch.out_cache_loc.tolist() == [4 * BS, 4 * BS + 1]
    assert batch.truth_lens is not None and batch.truth_lens.tolist() == [66]


def test_truth_table_follows_request_state() -> None:
    truth = TruthTable(max_rows=3, width=8, device=torch.device("cpu"))
    a = types.SimpleNamespace(prompt_token_ids=[5, 6, 7], output_token_ids=[8])
    b = types.SimpleNamespace(prompt_token_ids=[9] * 10, output_token_ids=[])
    t, lens = truth.fill(["a", "b"], {"a": a, "b": b})
    assert t[0, :4].tolist() == [5, 6, 7, 8] and lens[:2].tolist() == [4, 8]  # b capped at the width
    a.output_token_ids.append(11)
    t, lens = truth.fill(["b", "a"], {"a": a, "b": b})  # rows swapped: both refilled
    assert t[1, :5].tolist() == [5, 6, 7, 8, 11] and lens[:2].tolist() == [8, 5]
    embeds = types.SimpleNamespace(prompt_token_ids=None, output_token_ids=[1])
    _, lens = truth.fill(["e"], {"e": embeds})
    assert int(lens[0]) == 0  # prompt embeddings: nothing to compare
    assert np.array_equal(t.numpy()[1, :5], [5, 6, 7, 8, 11])


def test_options_from_env() -> None:
    assert options_from_env({}).config.mode is Mode.OFF
    opts = options_from_env({"KVCANARY_MODE": "Fail-Request", "KVCANARY_EVENTS": "/tmp/e.jsonl"})
    assert opts.config.mode is Mode.FAIL_REQUEST and opts.config.events_path == "/tmp/e.jsonl"
    with pytest.raises(ValueError, match="KVCANARY_LOG_ROWS='x' is not an integer"):
        options_from_env({"KVCANARY_MODE": "log", "KVCANARY_LOG_ROWS": "x"})
