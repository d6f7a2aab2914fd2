"""The one-launch translation (``translate_kernel``) against the torch ops it replaces: the same batch
tensors and table, byte for byte, on steps of full and sliding groups, prefills longer than the window,
padded forwards, mis-delimited segments and out-of-range read indices.  Under the interpreter on CPU,
compiled on a GPU."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from kvcanary.adapters.transformers_cb.step_buffers import StableWrites
from kvcanary.adapters.transformers_cb.translate import StepTranslator
from kvcanary.adapters.transformers_cb.truth_store import TruthStore
from transformers_helpers import PAGE, FakeEngine, StaticInputs, geometry, growing, kwargs_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def translators(window: int) -> tuple[StepTranslator, StepTranslator]:
    g = geometry(window)
    # Exact shapes on CUDA too: padded batches are compared with exact ones in test_adapter_transformers_batch_shapes.
    make = lambda kernel: StepTranslator([g], max_batch=4, max_context=64, device=DEVICE, kernel=kernel, bucket=False)  # noqa: E731
    return make(False), make(True)


def engine(window: int, n: int) -> FakeEngine:
    g = geometry(window)
    rids = [f"r{i}" for i in range(n)]
    tables = {rid: [4 + 6 * i + k for k in range(6)] for i, rid in enumerate(rids)}
    tokens = {rid: [100 * i + p + 1 for p in range(6 * PAGE)] for i, rid in enumerate(rids)}
    return FakeEngine(g, tables, tokens)


def same_translation(torch_tr: StepTranslator, kernel_tr: StepTranslator, kwargs: dict[str, Any], host: Any) -> None:
    want = torch_tr.translate(kwargs_to(kwargs, DEVICE), host)
    got = kernel_tr.translate(kwargs_to(kwargs, DEVICE), host)
    for name, wb in want.batches.items():
        gb = got.batches[name]
        for field, w in wb.tensors().items():
            x = gb.tensors()[field]
            assert (w is None) == (x is None), field
            if w is not None and x is not None:
                x = x.cpu()[:, : w.shape[1]] if x.dim() == 2 else x.cpu()  # CUDA: the truth at full width
                if field in ("input_ids", "positions"):  # the kernel copies them into int64 buffers of its own
                    w = w.to(torch.int64)
                assert w.dtype == x.dtype and torch.equal(w.cpu(), x), field


@pytest.mark.parametrize("window", [0, 5])
def test_kernel_translation_equals_the_torch_ops_step_by_step(window: int) -> None:
    rng = random.Random(window + 14)
    eng, (plain, fused) = engine(window, 3), translators(window)
    for step in range(7):
        queries = {rid: (rng.choice([3, 7, 11]) if step == 0 else rng.choice([1, 1, 2, 4])) for rid in eng.tables}
        if step == 3:
            queries = dict(list(queries.items())[:2])  # a row leaves the batch
        kwargs, host = eng.step(queries)
        if step == 4:  # a padded forward: more tokens than the scheduler planned
            kwargs["input_ids"] = torch.cat([kwargs["input_ids"], torch.zeros((1, 3), dtype=torch.int32)], 1)
            kwargs["position_ids"] = torch.cat([kwargs["position_ids"], torch.zeros((1, 3), dtype=torch.int32)], 1)
        same_translation(plain, fused, kwargs, host)
        assert torch.equal(plain.tables[geometry(window).name].cpu(), fused.tables[geometry(window).name].cpu())


@pytest.mark.parametrize("window", [0, 5])
def test_kernel_translation_equals_the_torch_ops_on_corrupt_indices(window: int) -> None:
    g = geometry(window)
    eng, (plain, fused) = engine(window, 3), translators(window)
    kwargs, host = eng.step(dict.fromkeys(eng.tables, 6))
    same_translation(plain, fused, kwargs, host)
    rng = random.Random(7)
    for case in range(6):
        kwargs, host = eng.step(dict.fromkeys(eng.tables, 1))
        read, write = kwargs["read_index"][0], kwargs["write_index"][0]
        if case == 0:  # a mis-delimited segment: one row's read segment one entry short
            cu = kwargs["cu_seq_lens_k"][g.name]
            cu[2:] -= 1
        elif case == 1:  # indices outside the pool, negative, inside a page's padding, the sentinel
            read[rng.randrange(read.shape[0])] = g.num_blocks * g.stride + 3
            read[rng.randrange(read.shape[0])] = -5
            read[rng.randrange(read.shape[0])] = g.stride - 1
            write[0] = g.sentinel_index
        elif case == 2:  # the read index shorter than its segments say
            kwargs["read_index"][0] = read[: read.shape[0] - 2].clone()
        elif case == 3:
            write[-1] = g.write_trash_index
        same_translation(plain, fused, kwargs, host)
        assert torch.equal(plain.tables[g.name].cpu(), fused.tables[g.name].cpu())


def test_a_long_prefill_of_a_sliding_group_sends_its_oldest_writes_to_the_trash_in_both() -> None:
    eng, (plain, fused) = engine(5, 2), translators(5)
    kwargs, host = eng.step(dict.fromkeys(eng.tables, 4))
    same_translation(plain, fused, kwargs, host)
    kwargs, host = eng.step(dict.fromkeys(eng.tables, 13))  # longer than the window: trash writes by design
    same_translation(plain, fused, kwargs, host)


@pytest.mark.parametrize("window", [0, 5])
def test_a_launch_bound_at_one_step_translates_every_later_step_with_its_key(window: int) -> None:
    """What replaying the canary's step graph does: the launch bound (captured) at the first decode step runs
    again at later ones, whose lengths and index sizes differ, and must translate them as they are."""
    g = geometry(window)
    eng, (plain, fused) = engine(window, 3), translators(window)
    fused._stable = StableWrites(torch.device(DEVICE))  # what CUDA gives it: static writes and truth
    fused._truth = TruthStore(4, 64, torch.device(DEVICE), static_out=True)
    static = StaticInputs(DEVICE)
    kwargs, host = eng.step(dict.fromkeys(eng.tables, 6))
    same_translation(plain, fused, static.put(kwargs), growing(host))
    captured = None
    for _ in range(4):
        kwargs, host = eng.step(dict.fromkeys(eng.tables, 1))
        host = growing(host)  # each step's truth has one more token a request: the truth update writes them
        want = plain.translate(kwargs_to(kwargs, DEVICE), host)
        got = fused.translate(static.put(kwargs), host, defer=True)
        assert got.prelude is not None
        captured = captured or got.prelude
        assert got.prelude.key == captured.key  # the same addresses and sizes: the graph would replay
        captured.run()
        for field, w in want.batches[g.name].tensors().items():
            x = got.batches[g.name].tensors()[field]
            assert (w is None) == (x is None), field
            if w is not None and x is not None:
                x = x[:, : w.shape[1]] if field == "truth" else x  # the static truth is full width
                assert torch.equal(w.cpu(), x.cpu()), field
        assert torch.equal(plain.tables[g.name].cpu(), fused.tables[g.name].cpu())
    kwargs, host = eng.step(dict.fromkeys(list(eng.tables)[:2], 1))  # another batch shape: another key
    assert fused.translate(static.put(kwargs), host, defer=True).prelude.key != captured.key  # type: ignore[union-attr]


@pytest.mark.parametrize("forget", [True, False])
def test_a_step_whose_prelude_never_ran_is_resent_once_the_truth_is_forgotten(forget: bool) -> None:
    """The truth's write runs in the prelude: a step whose prelude did not run (the canary refused its batch) left
    the store without its tokens.  Forgetting the truth resends them; without it the next step's truth is wrong."""
    g = geometry(0)
    eng, (plain, fused) = engine(0, 2), translators(0)
    fused._stable = StableWrites(torch.device(DEVICE))
    fused._truth = TruthStore(4, 64, torch.device(DEVICE), static_out=True)
    static = StaticInputs(DEVICE)
    kwargs, host = eng.step(dict.fromkeys(eng.tables, 5))
    plain.translate(kwargs_to(kwargs, DEVICE), growing(host))
    fused.translate(static.put(kwargs), growing(host), defer=True)  # its prelude never runs
    if forget:
        fused.forget_truth()
    kwargs, host = eng.step(dict.fromkeys(eng.tables, 1))
    want = plain.translate(kwargs_to(kwargs, DEVICE), growing(host)).batches[g.name]
    got = fused.translate(static.put(kwargs), growing(host), defer=True)
    assert got.prelude is not None
    got.prelude.run()
    truth = got.batches[g.name].truth
    assert want.truth is not None and truth is not None
    same = torch.equal(want.truth.cpu(), truth.cpu()[:, : want.truth.shape[1]])
    assert same == forget
