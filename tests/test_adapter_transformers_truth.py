"""The transformers adapter's ground truth: histories read without copying, kept on the device between steps.

The step's truth gathered from the store must equal the table built from scratch (every request's whole
history) on any sequence of steps: requests growing, rewinding, rewriting their newest tokens, leaving,
coming back after their row was reused.  And a step must send only what changed.
"""

from __future__ import annotations

import array
import random

import numpy as np
import pytest
import torch

from kvcanary.adapters.transformers_cb.host_batch import REFRESH, History, HostBatch
from kvcanary.adapters.transformers_cb.staging import Staging
from kvcanary.adapters.transformers_cb.truth_store import TruthStore, TruthUpdate
from kvcanary.schema import UNKNOWN_TOKEN


def test_history_reads_prompt_then_generated_and_freezes_its_length_and_tail() -> None:
    prompt, gen = list(range(100, 100 + 2 * History.TAIL)), [7, 8, 9]
    h = History(prompt, gen)
    n = len(prompt) + 3
    assert prompt == list(range(100, 100 + 2 * History.TAIL)) and gen == [7, 8, 9]  # the tail joined a copy
    assert History(tuple(prompt), tuple(gen)).tail == h.tail == prompt[n - History.TAIL :] + gen
    assert len(h) == n and h[0] == 100 and h[n - 4] == 99 + len(prompt) and h[n - 3] == 7 and h[-1] == 9
    assert h.tokens(n - 5, n) == [98 + len(prompt), 99 + len(prompt), 7, 8, 9] and list(h[:3]) == [100, 101, 102]
    assert h.tokens(0, n) == prompt + gen and h.tokens(n + 7, n + 17) == []
    gen.append(10)  # grows after capture: not part of this step's claim
    gen[-2] = 99  # rewritten after capture inside the tail: the capture's value stands
    assert len(h) == n and h[-1] == 9
    del prompt[5:]  # the engine dropped old tokens (never done; read as unknown, not as garbage)
    assert h[10] == UNKNOWN_TOKEN  # older than the tail copied at capture
    long_gen = list(range(3 * History.TAIL))  # the whole tail among the generated tokens
    h = History([1, 2], long_gen)
    long_gen[-1] = -5  # rewritten after capture: the capture's value stands
    assert h[-1] == 3 * History.TAIL - 1 and h.tokens(0, 3) == [1, 2, 0]


def test_the_capture_keeps_the_refresh_window_and_the_query_and_a_step_reads_no_older_token() -> None:
    """The engine capture copies the newest REFRESH + query tokens: what the truth store compares and sends for a
    request sent up to this step's query.  A decode step and a prefill chunk after it read nothing older (once
    captured, the history's engine lists are swapped for ones that fail on any read: the tail has it all)."""
    from types import SimpleNamespace

    class Untouchable(list[int]):
        def __getitem__(self, index: object) -> object:
            raise AssertionError("read from the engine's list: the capture's tail was too short")

    prompt, generated = list(range(1000, 1100)), [7]
    store = TruthStore(1, 400, torch.device("cpu"))

    def step(query: int) -> TruthUpdate:
        state = SimpleNamespace(request_id="a", position_offset=len(prompt) + len(generated) - query,
                                initial_tokens=prompt, generated_tokens=generated)  # fmt: skip
        host = HostBatch.from_future_states([SimpleNamespace(state=state, query_length=query)])
        h = host.truth[0]
        assert isinstance(h, History) and len(h.tail) == min(REFRESH + query, len(h))
        h._initial, h._generated = Untouchable(), Untouchable()  # type: ignore[misc]
        return store.plan(host, [True])

    assert len(step(len(prompt) + 1).cells) == 101  # first sight: the whole history
    generated.append(8)
    up = step(1)
    assert up.tokens.tolist() == [8] and up.cells.tolist() == [store.width + 101]
    generated[-2] = 5  # a token rewritten inside the window compared, then one more
    generated.append(9)
    up = step(1)
    assert up.tokens.tolist() == [5, 8, 9] and up.cells.tolist() == [store.width + k for k in (100, 101, 102)]
    generated += [10, 11, 12]  # a chunk of three new tokens
    assert step(3).tokens.tolist() == [10, 11, 12]


def naive(histories: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    lens = np.array([min(len(h), width) for h in histories], dtype=np.int64)
    out = np.full((len(histories) + 1, max(1, int(lens.max(initial=0)))), UNKNOWN_TOKEN, dtype=np.int32)
    for r, (h, n) in enumerate(zip(histories, lens, strict=True)):
        out[r + 1, :n] = h[:n]
    return out, lens


def on_device(up: TruthUpdate) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The update's cells, tokens and gather as tensors (what the staging copy hands the store)."""
    return tuple(torch.from_numpy(np.asarray(a)) for a in (up.cells, up.tokens, up.gather))  # type: ignore[return-value]


# What a history keeps: by hand (the default), and as the engine capture builds it for a step of one query token.
KEEPS = [History.TAIL, REFRESH + 1]


@pytest.mark.parametrize("keep", KEEPS)
def test_the_gathered_truth_equals_a_table_built_from_scratch_and_only_changes_are_sent(keep: int) -> None:
    rng = random.Random(1)
    width, rows = 200, 4
    store = TruthStore(rows, width, torch.device("cpu"))
    reqs: dict[str, tuple[list[int], list[int]]] = {}
    sent_total = 0
    for step in range(120):
        if len(reqs) < 7 and rng.random() < 0.3:
            rid = f"r{step}"
            reqs[rid] = ([rng.randrange(1000) for _ in range(rng.randrange(1, 150))], [])
        ids = rng.sample(sorted(reqs), min(rows, len(reqs)))  # any 4 of up to 7 live requests: rows get reused
        for rid in ids:
            gen = reqs[rid][1]
            if gen and rng.random() < 0.1:
                gen[-1 - rng.randrange(min(len(gen), 3))] = rng.randrange(1000)  # rewrite a recent token
            if gen and rng.random() < 0.05:
                gen.pop()  # rewind
            gen.append(rng.randrange(1000))
        host = HostBatch(
            request_ids=tuple(ids),
            past_lens=(0,) * len(ids),
            query_lens=(1,) * len(ids),
            truth=tuple(History(*reqs[rid], keep) for rid in ids),
        )
        live = [True] * len(ids)
        up = store.plan(host, live)
        sent_total += len(up.cells)
        got = store.apply(up, *on_device(up))
        want, lens = naive([reqs[rid][0] + reqs[rid][1] for rid in ids], width)
        assert np.array_equal(np.asarray(up.lens), lens)
        for r in range(len(ids)):
            n = int(lens[r])
            assert got[r + 1, :n].tolist() == want[r + 1, :n].tolist(), (step, ids[r])
    full = 120 * rows * 150  # what resending every history every step would have cost, roughly
    assert sent_total < full / 3, sent_total


def test_rows_left_out_get_row_zero_and_no_truth() -> None:
    store = TruthStore(2, 8, torch.device("cpu"))
    host = HostBatch(("a", "b"), (0, 0), (1, 1), (History([1, 2, 3], []), History(list(range(20)), [])))
    up = store.plan(host, [True, False])
    assert up.gather.tolist()[2] == 0 and up.lens.tolist() == [3, 0] and up.width == 3


@pytest.mark.parametrize("keep", KEEPS)
def test_a_decode_step_sends_its_new_tokens_and_any_rewritten_ones_only(keep: int) -> None:
    width = 400
    store = TruthStore(2, width, torch.device("cpu"))
    reqs = {"a": (list(range(1, 300)), [5]), "b": (list(range(200, 260)), [6])}

    def step() -> tuple[int, torch.Tensor]:
        host = HostBatch(("a", "b"), (0, 0), (1, 1), tuple(History(*reqs[r], keep) for r in ("a", "b")))
        up = store.plan(host, [True, True])
        got = store.apply(up, *on_device(up))
        want, lens = naive([reqs[r][0] + reqs[r][1] for r in ("a", "b")], width)
        for r, n in enumerate(lens.tolist()):
            assert got[r + 1, :n].tolist() == want[r + 1, :n].tolist()
        return len(up.cells), got

    assert step()[0] == 300 + 61  # first sight: whole histories ('a' longer than the window the store keeps)
    reqs["a"][1][-1] = 998  # right after a long first send: its newest token rewritten, then one more
    reqs["a"][1].append(9)
    reqs["b"][1].append(9)
    assert step()[0] == 2 + 1
    for k in range(5):
        for rid in reqs:
            reqs[rid][1].append(10 + k)
        assert step()[0] == 2  # one new token each
    reqs["a"][1][-3] = 999  # the third newest rewritten (a rolled-back draft), then one more token
    reqs["a"][1].append(11)
    assert step()[0] == 3 + 0 + 1  # 'a': the rewritten token and the two after it plus the new one; 'b': none
    del reqs["b"][1][:]  # a rewind past the 32 tokens kept on the host: 'b' is sent from 32 before its end
    reqs["b"][1].append(77)
    assert step()[0] == 32


def test_a_rewind_past_the_window_compared_last_resends_the_window_even_where_the_tail_agrees() -> None:
    """A token rewritten outside the compared window (not sent, by design), then a rewind that brings it back into
    the window: the history's tail as last read agrees with it, the store's row does not, so the window is sent."""
    store = TruthStore(1, 200, torch.device("cpu"))
    prompt, generated = list(range(100, 140)), [1]

    def step(check: bool) -> int:
        up = store.plan(HostBatch(("a",), (0,), (1,), (History(prompt, generated),)), [True])
        got = store.apply(up, *on_device(up))
        n = len(prompt) + len(generated)
        if check:
            assert got[1, :n].tolist() == prompt + generated
        return len(up.cells)

    for k in range(40):  # one token a step up to 80: the window compared is the last 32 before the newest
        assert step(check=True) == (41 if k == 0 else 1)
        generated.append(k)
    generated[0] = 999  # position 40, outside the window: the next step does not send it (not checked there)
    assert step(check=False) == 1
    del generated[20:]  # a rewind to 60 tokens: position 40 is inside the window [28, 60) again
    assert step(check=True) == 32


def test_the_truth_scatter_bound_once_writes_every_later_step_like_the_store_write() -> None:
    """What replaying the step graph does with the truth's write: one launch, bound at the first step, writes each
    later step's tokens, however many, found through the offsets staged with them."""
    pytest.importorskip("triton")
    rng = random.Random(3)
    staging = Staging(torch.device("cpu"))
    scatter_store, write_store = (TruthStore(3, 16, torch.device("cpu"), static_out=True) for _ in range(2))
    bound = None
    for step in range(5):
        n = [0, 7, 1, 30, 2][step]
        cells = array.array("q", rng.sample(range(4 * 16), n))
        tokens = array.array("i", [rng.randrange(1 << 31) for _ in range(n)])
        head = array.array("q", rng.sample(range(100), step + 1))  # arrays before the truth's: offsets move
        meta = array.array("q", [n, 0, 0])
        arrays = [head, meta, cells, tokens]
        offsets, _ = staging.layout(arrays)
        meta[1], meta[2] = offsets[2] // 8, offsets[3] // 4
        dev = staging.send(arrays)
        bound = bound or scatter_store.scatter(staging.whole(torch.int64), staging.whole(torch.int32), dev[1])
        bound.run()
        update = TruthUpdate(array.array("q"), array.array("q"), 1, cells, tokens)
        write_store.write(update, torch.tensor(cells, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int32))
        assert torch.equal(scatter_store.table, write_store.table), step


def test_a_forgetful_store_sends_every_request_whole_again() -> None:
    store = TruthStore(2, 8, torch.device("cpu"))
    host = HostBatch(("a",), (0,), (1,), (History([1, 2, 3], []),))
    assert len(store.plan(host, [True]).cells) == 3
    assert len(store.plan(host, [True]).cells) == 0  # sent already
    store.forget()  # a step whose write may not have run
    assert len(store.plan(host, [True]).cells) == 3


@pytest.mark.parametrize(
    ("meta", "written"),
    [
        ([3, 8, 32], {0: 7, 5: 8}),  # as staged: the cells at word 8, the tokens at half 32; cell 99 is masked off
        ([2, 8, 32], {0: 7, 5: 8}),
        ([-1, 8, 32], {}),
        ([3, -5, 32], {}),
        ([3, 8, -(2**40)], {}),
        ([3, 2**40, 32], {}),
        ([2**62, 2**62, 2**62], {}),
        ([2**40, 8, 32], None),  # a huge count: the buffer's other words are read as entries, none past its end
    ],
)
def test_the_truth_scatter_stays_inside_the_store_and_the_buffer_whatever_its_meta(
    meta: list[int], written: dict[int, int] | None
) -> None:
    """The canary never reads or writes out of bounds: a corrupt count or offset masks entries off."""
    pytest.importorskip("triton")
    staging = Staging(torch.device("cpu"))
    store = TruthStore(2, 4, torch.device("cpu"), static_out=True)
    cells, tokens = array.array("q", [0, 5, 99]), array.array("i", [7, 8, 9])  # 99: outside the 3 x 4 store
    arrays = [array.array("q", meta), cells, tokens]
    assert staging.layout(arrays)[0] == [0, 64, 128]  # word 8, half 32
    dev = staging.send(arrays)
    store.scatter(staging.whole(torch.int64), staging.whole(torch.int32), dev[0]).run()
    flat = store.table.view(-1).tolist()
    if written is not None:  # (in bounds either way; compute-sanitizer is what proves that on a GPU)
        assert {c: v for c, v in enumerate(flat) if v != UNKNOWN_TOKEN} == written


def test_a_new_request_takes_the_row_of_the_least_recently_used_one() -> None:
    store = TruthStore(2, 8, torch.device("cpu"))

    def sent(rid: str) -> int:
        host = HostBatch((rid,), (0,), (1,), (History([ord(rid)] * 3, []),))
        return len(store.plan(host, [True]).cells)

    assert (sent("a"), sent("b"), sent("a")) == (3, 3, 0)  # 'b' is now the least recently used
    assert sent("c") == 3  # takes b's row
    assert (sent("a"), sent("b")) == (0, 3)  # 'a' kept its row; 'b' is sent whole again


def test_with_no_row_free_the_least_recently_used_half_of_the_idle_rows_is_freed_in_one_scan() -> None:
    store = TruthStore(6, 8, torch.device("cpu"))

    def sent(*rids: str) -> int:
        host = HostBatch(rids, (0,) * len(rids), (1,) * len(rids), tuple(History([ord(r)] * 3, []) for r in rids))
        return len(store.plan(host, [True] * len(rids)).cells)

    for rid in "abcdef":  # every row taken, 'a' the least recently used
        sent(rid)
    assert sent("f", "g") == 3  # 'g' joins: of the five idle rows, the two least recently used are freed ('a', 'b')
    assert sent("c", "d", "e") == 0  # kept their rows
    assert sent("b") == 3  # lost its row in that one scan: sent whole again, into the other freed row
    assert sent("a") == 3  # no row free: the next scan frees the least recently used idle half ('f', 'g', 'c')
    assert sent("d", "e", "b") == 0 and sent("c") == 3
    with pytest.raises(RuntimeError, match="fewer rows"):
        sent(*"abcdefg")
