"""What the transformers adapter's per-step translation costs: fixed device work, no host sync.

On a GPU each torch op is a kernel launch and each host read of a device value (or a blocking
host-to-device copy) waits for the model's forward; the translator must issue the same few ops whatever
the batch, read nothing back, and send its host-side arrays in one asynchronous copy.  Counted here on
CPU with a dispatch-mode op counter; the ``gpu`` test checks the no-sync claim on CUDA directly.
"""

from __future__ import annotations

import array
import collections
import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from kvcanary.adapters.transformers_cb import translate_kernel
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.staging import ALIGN, Staging
from kvcanary.adapters.transformers_cb.step_buffers import StableWrites
from kvcanary.adapters.transformers_cb.translate import StepTranslator
from kvcanary.adapters.transformers_cb.truth_store import TruthStore
from kvcanary.batch import StepBatch
from kvcanary.runtime.pump import CopyFence
from op_counting import NO_KERNEL, SYNCING, OpCounter
from transformers_helpers import PAGE, STRIDE, FakeEngine, growing, kwargs_to

TRANSLATION_OPS = 24  # one full group's step (read-index path, truth store write + gather): lower it, never raise it


def geometry(window: int) -> GroupGeometry:
    """The unit tests' layout with room for four requests of four pages."""
    name = "sliding_attention" if window else "full_attention"
    return GroupGeometry(name, 0, window, PAGE, STRIDE, 24, 0, 1, STRIDE * 2)


def decode_step(n_requests: int, window: int, device: str = "cpu") -> tuple[FakeEngine, StepTranslator]:
    """A translator that has seen one prefill step (7 tokens) of ``n_requests`` requests."""
    g = geometry(window)
    rids = [f"r{i}" for i in range(n_requests)]
    tables = {rid: [4 + 4 * i + k for k in range(4)] for i, rid in enumerate(rids)}  # clear of the trash blocks
    tokens = {rid: [100 * i + p for p in range(4 * PAGE)] for i, rid in enumerate(rids)}
    eng = FakeEngine(g, tables, tokens)
    tr = StepTranslator([g], max_batch=4, max_context=32, device=device)
    kwargs, host = eng.step(dict.fromkeys(rids, 7))
    tr.translate(kwargs_to(kwargs, device), host)
    return eng, tr


def device_ops(n_requests: int, window: int) -> collections.Counter[str]:
    eng, tr = decode_step(n_requests, window)
    kwargs, host = eng.step(dict.fromkeys(eng.tables, 1))
    with OpCounter() as counter:
        tr.translate(kwargs, host)
    return counter.ops


@pytest.mark.parametrize("window", [0, 3])
def test_translation_issues_the_same_few_ops_whatever_the_batch_and_reads_nothing_back(window: int) -> None:
    one, four = device_ops(1, window), device_ops(4, window)
    assert one == four  # no per-request op
    kernels = {op: n for op, n in four.items() if op not in NO_KERNEL}
    assert sum(kernels.values()) <= TRANSLATION_OPS + (window > 0), kernels  # a window's edge cells: one fill
    assert not SYNCING & set(four), four


FUSED_TRANSLATION_OPS = 2  # the truth store's write and gather; the group's own work is one kernel launch


@pytest.mark.parametrize("window", [0, 3])
def test_the_fused_translation_is_one_launch_a_group_and_two_torch_ops(
    window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    launches: list[bool] = []
    monkeypatch.setattr(translate_kernel.GroupLaunch, "run", lambda self: launches.append(self.constexprs["SLIDING"]))
    eng, tr = decode_step(4, window)
    tr.kernel = True
    kwargs, host = eng.step(dict.fromkeys(eng.tables, 1))
    with OpCounter() as counter:
        tr.translate(kwargs, host)
    kernels = {op: n for op, n in counter.ops.items() if op not in NO_KERNEL and op != "empty"}
    assert launches == [window > 0]
    assert sum(kernels.values()) <= FUSED_TRANSLATION_OPS, kernels
    assert not SYNCING & set(counter.ops), counter.ops


# What CUDA runs at each step outside the canary's step graph: nothing.  The truth's write (found through staged
# offsets), its gather and the group's launch wait in the prelude, replayed inside the graph.
GRAPHED_PATH_OPS: dict[str, int] = {}
# Every torch call of a steady step, views included (each costs host time): none.  The slices of recurring shapes are
# handed out again, the staging's host bytes are its own, and the forward's tokens reach the translator's own buffers
# through the group's launch (no view of the engine's tensors).
GRAPHED_PATH_CALLS: dict[str, int] = {}


@pytest.mark.parametrize("window", [0, 3])
def test_the_graphed_path_issues_one_op_a_step_and_defers_the_rest(
    window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    launches: list[bool] = []
    monkeypatch.setattr(translate_kernel.GroupLaunch, "run", lambda self: launches.append(True))
    eng, tr = decode_step(3, window)
    cpu = torch.device("cpu")
    tr.kernel = tr.bucket = True  # what CUDA gives it: one launch a group, shape classes, static writes and truth
    tr._stable, tr._truth = StableWrites(cpu), TruthStore(4, 32, cpu, static_out=True)
    for step in range(3):  # the first step sends each request's whole history: the same ops, more tokens
        kwargs, host = eng.step(dict.fromkeys(eng.tables, 1))
        with OpCounter() as counter:
            t = tr.translate(kwargs, growing(host), defer=True)  # each step's truth one token longer
        kernels = {op: n for op, n in counter.ops.items() if op not in NO_KERNEL | {"as_strided", "empty"}}
        assert kernels == GRAPHED_PATH_OPS, kernels
        if step == 2:  # every shape recurs now (the second step sent fewer truth tokens than the first)
            assert counter.ops == GRAPHED_PATH_CALLS, counter.ops
        assert not SYNCING & set(counter.ops), counter.ops
        assert not launches and t.prelude is not None and len(t.prelude.launches) == 3  # truth scatter, gather, group
        assert next(iter(t.batches.values())).batch_size == 4  # 3 rows padded to the class (capped by max_batch)


# The distinct torch callables a steady graphed step touches (getters included): the canary's tap runs with every CPU
# cache cold, where each distinct call costs tens of microseconds on first touch (bench_translate.py --cold).  Lower
# it, never raise it.
GRAPHED_PATH_TORCH_CALLABLES = 5  # two getters, the tokens' contiguity, data_ptr (a view key) and the write


def c_calls_by_module(work: Callable[[], object]) -> dict[str, set[str]]:
    """The C functions ``work`` calls, by top-level module (a profiler hook: it sees every call, hot or cold)."""
    seen: dict[str, set[str]] = collections.defaultdict(set)

    def hook(frame: object, event: str, arg: object) -> None:
        if event == "c_call":
            owner = getattr(arg, "__self__", None)
            module = getattr(arg, "__module__", None) or type(owner).__module__
            seen[str(module).split(".")[0]].add(getattr(arg, "__qualname__", repr(arg)))

    sys.setprofile(hook)
    try:
        work()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("window", [0, 3])
def test_a_steady_graphed_step_calls_no_numpy_and_few_distinct_torch_functions(
    window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(translate_kernel.GroupLaunch, "run", lambda self: None)
    eng, tr = decode_step(3, window)
    cpu = torch.device("cpu")
    tr.kernel = tr.bucket = True  # the CUDA configuration, as above
    tr._stable, tr._truth = StableWrites(cpu), TruthStore(4, 32, cpu, static_out=True)
    for _ in range(2):
        kwargs, host = eng.step(dict.fromkeys(eng.tables, 1))
        tr.translate(kwargs, growing(host), defer=True)
    kwargs, host = eng.step(dict.fromkeys(eng.tables, 1))
    host = growing(host)
    calls = c_calls_by_module(lambda: tr.translate(kwargs, host, defer=True))
    assert "numpy" not in calls, calls["numpy"]  # per-row values in plain Python (batch_shapes.pad_rows)
    assert len(calls["torch"]) <= GRAPHED_PATH_TORCH_CALLABLES, sorted(calls["torch"])


def test_geometry_to_slots_matches_its_definition_on_every_index() -> None:
    def slot(g: GroupGeometry, i: int) -> int:
        if i == g.sentinel_index:
            return g.sentinel_slot
        block, offset = divmod(i, g.stride)
        if i < 0 or offset >= g.page_size or block >= g.num_blocks:
            return g.invalid_slot
        return block * g.page_size + offset

    for page, stride in ((PAGE, STRIDE), (1, 3), (4, 4)):
        g = GroupGeometry("full_attention", 0, 0, page, stride, 6, 0, 1, stride * 2)
        idx = torch.arange(-2 * stride, (g.num_blocks + 2) * stride)
        for dtype in (torch.int64, torch.int32):
            assert g.to_slots(idx.to(dtype)).tolist() == [slot(g, i) for i in idx.tolist()]


def test_staging_sends_typed_aligned_views_and_grows() -> None:
    st = Staging(torch.device("cpu"))
    arrays = [
        np.arange(3, dtype=np.int64),
        np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32),
        np.array([True, False, True]),
        np.zeros(0, dtype=np.int64),
        np.array([-7], dtype=np.int64),
        array.array("q", [5, -6]),  # plain arrays: how the one-launch path builds its per-row values
        array.array("i", [2**31 - 1]),
        np.arange(8, dtype=np.int64)[::2],  # not contiguous: copied in order
    ]
    views = st.send(arrays)
    for a, v in zip(arrays, views, strict=True):
        assert v.tolist() == a.tolist() and tuple(v.shape) == np.asarray(a).shape and v.is_contiguous()
        assert v.data_ptr() % ALIGN == 0 or v.numel() == 0
    i64, i32 = torch.int64, torch.int32
    assert [v.dtype for v in views] == [i64, i32, torch.bool, i64, i64, i64, i32, i64]
    big = np.arange(100_000, dtype=np.int64)
    (v,) = st.send([big])
    assert st.capacity >= big.nbytes and torch.equal(v, torch.from_numpy(big))
    for bad in (np.zeros(2, dtype=np.float32), array.array("d", [1.0])):
        with pytest.raises(TypeError, match="int64, int32 or bool"):
            st.send([bad])


@contextlib.contextmanager
def sync_debug(mode: str) -> Iterator[None]:
    """torch's CUDA sync-debug mode for a block, whatever it was before (it is process-wide)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # torch warns, once per process, that the mode is a prototype
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype", category=UserWarning)
        torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 3])
def test_translation_on_cuda_never_waits_and_matches_the_cpu(window: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with sync_debug("default"):  # the set-up copies to the device synchronously
        eng, cpu = decode_step(4, window)
        _, gpu = decode_step(4, window, device="cuda")
        steps = [eng.step(dict.fromkeys(eng.tables, 1)) for _ in range(6)]
        cuda_steps = [(kwargs_to(kw, "cuda"), host) for kw, host in steps]
        torch.cuda.synchronize()
    outs = []
    with sync_debug("error"):
        torch.cuda._sleep(50_000_000)  # keep the stream busy: the step copies queue behind it
        for kw, host in cuda_steps:  # back to back: each step's staging must survive the next one's
            b = next(iter(gpu.translate(kw, host).batches.values()))
            outs.append([x.clone() for x in _fields(b)])
    for (kw, host), got in zip(steps, outs, strict=True):
        want = _fields(next(iter(cpu.translate(kw, host).batches.values())))
        # The truth on CUDA is gathered at full width (a fixed shape); its valid columns are the CPU's.
        assert all(
            torch.equal(w, x.cpu()[:, : w.shape[1]] if x.dim() == 2 else x.cpu())
            for w, x in zip(want, got, strict=True)
        )


@pytest.mark.gpu
def test_a_slotted_staging_on_cuda_keeps_no_copy_ring_even_after_it_grows() -> None:
    """Slotted, the sends go to pinned slots that the step's upload launch copies: the copy ring's pinned buffers
    (each the staging's capacity) are dropped when it turns slotted and not built again when it grows."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    st = Staging(torch.device("cuda"))
    assert st.host_buffers > 0  # copied: the ring
    fence = CopyFence()
    fence.seq = torch.zeros(2, dtype=torch.int64, device="cuda")
    st.follow(fence, slotted=True)
    assert st.host_buffers == 0 and st.upload() is not None
    (view,) = st.send([array.array("q", range(st.capacity // 4))])  # twice the capacity: it grows
    upload = st.upload()
    assert upload is not None and st.host_buffers == 0
    upload.run()
    torch.cuda.synchronize()
    assert view.tolist() == list(range(len(view)))


@pytest.mark.gpu
def test_staging_on_cuda_never_overwrites_a_copy_in_flight() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    st = Staging(torch.device("cuda"))
    first = st.host_buffers
    got = []
    with sync_debug("error"):
        torch.cuda._sleep(100_000_000)  # every copy below waits behind this: none of their buffers is free again
        for k in range(first + 2):
            (view,) = st.send([array.array("q", [k] * 5)])
            got.append(view.clone())  # enqueued behind the step's copy
    torch.cuda.synchronize()
    assert [g.tolist() for g in got] == [[k] * 5 for k in range(first + 2)]
    assert st.host_buffers == first + 2  # two more joined the ring instead of waiting or overwriting
    (view,) = st.send([array.array("q", [9])])  # all landed: the ring is reused as it is
    assert view.tolist() == [9] and st.host_buffers == first + 2


@pytest.mark.gpu
def test_the_steady_send_on_cuda_never_overwrites_a_copy_in_flight() -> None:
    """``send_at`` (a steady step's send, its take of a pinned buffer inline) keeps the ring's rule too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    st = Staging(torch.device("cuda"))
    (view,) = st.send([array.array("q", [0] * 5)])  # the layout the steady sends rewrite
    torch.cuda.synchronize()
    first = st.host_buffers
    got = []
    with sync_debug("error"):
        torch.cuda._sleep(100_000_000)  # every copy below waits behind this
        for k in range(1, first + 3):
            st.send_at(memoryview(array.array("q", [k] * 5)).cast("B"), (), 40)
            got.append(view.clone())  # enqueued behind the step's copy: sees this step's bytes, not a later one's
    torch.cuda.synchronize()
    assert [g.tolist() for g in got] == [[k] * 5 for k in range(1, first + 3)]
    assert st.host_buffers > first  # buffers joined the ring instead of waiting or overwriting


@pytest.mark.gpu
def test_a_fenced_staging_copies_without_events_and_reuses_a_buffer_once_the_fence_passes_its_step() -> None:
    """With the manager's fence, a buffer's copy is known to have run from the fence alone (no event, no query)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    st = Staging(torch.device("cuda"))
    fence = st.fence = CopyFence()
    first = st.host_buffers
    got = []
    with sync_debug("error"):
        torch.cuda._sleep(100_000_000)  # every copy below waits behind this
        for k in range(first + 2):
            fence.next_step = k  # the host step each copy is queued before
            (view,) = st.send([array.array("q", [k] * 5)])
            got.append(view.clone())
    torch.cuda.synchronize()
    assert [g.tolist() for g in got] == [[k] * 5 for k in range(first + 2)]
    assert st.host_buffers == first + 2  # the fence vouched for none of them: two buffers joined the ring
    with pytest.raises(RuntimeError, match="records no event"):
        st._ring[0].transfer.landed()  # no event was recorded: only the fence can tell
    fence.landed = first + 1  # the pump's copies of those steps landed, so every copy before them did
    (view,) = st.send([array.array("q", [9] * 5)])
    st.send_at(memoryview(array.array("q", [7] * 5)).cast("B"), (), 40)
    torch.cuda.synchronize()
    assert view.tolist() == [7] * 5 and st.host_buffers == first + 2  # the ring reused as it is


def _fields(b: StepBatch) -> list[torch.Tensor]:
    fields = (b.rows, b.prefix_lens, b.extend_lens, b.out_cache_loc, b.table, b.truth, b.truth_lens)
    return [t for t in fields if t is not None]


def test_staging_hands_out_the_same_view_for_an_array_that_recurs_and_fresh_contents() -> None:
    st = Staging(torch.device("cpu"))
    first = st.send([np.arange(4, dtype=np.int64), np.arange(3, dtype=np.int32)])
    second = st.send([np.arange(10, 14, dtype=np.int64), np.arange(5, dtype=np.int32)])
    assert second[0] is first[0] and second[0].tolist() == [10, 11, 12, 13]  # same place, this step's values
    assert second[1] is not first[1] and second[1].tolist() == [0, 1, 2, 3, 4]  # another shape: another view
    grown = st.send([np.arange(4, dtype=np.int64), np.zeros(1 << 15, dtype=np.int64)])
    assert grown[0] is not first[0] and grown[0].tolist() == [0, 1, 2, 3]  # a new buffer: new views
