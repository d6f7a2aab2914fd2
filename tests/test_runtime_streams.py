"""``runtime.streams`` and ``runtime.cuda_calls``: the stream switch, the event and the device-to-host copy the
per-step path uses instead of torch's (which cost microseconds of Python a call).  CUDA only."""

from __future__ import annotations

import pytest
import torch

from kvcanary.runtime import streams
from kvcanary.runtime.cuda_calls import CudaCalls


def needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


PATHS = ["cudart", "bindings", "torch"]  # the runtime torch loaded through ctypes, cuda-python's bindings, torch


def cuda_calls(path: str) -> CudaCalls:
    """The calls of the current device by ``path`` (skipped where that path is missing)."""
    needs_cuda()
    direct = path != "torch"
    calls = CudaCalls(torch.cuda.current_device(), bindings=direct, runtime=path if direct else None)
    if direct and not calls.through_bindings:
        pytest.skip(f"no {path} calls here")
    assert calls.path.startswith({"cudart": "cudart", "bindings": "cuda.bindings", "torch": "torch"}[path])
    return calls


def test_the_calls_take_the_runtime_torch_loaded_when_it_is_there() -> None:
    """On a CPU build no runtime is loaded: no direct calls, and asking for them is not an error."""
    from kvcanary.runtime import cuda_calls as module

    found = module.cudart_calls()
    if not torch.cuda.is_available():
        assert found is None
    elif found is not None:  # a build that loads libcudart dynamically
        assert found.name == "cudart through ctypes" and CudaCalls(torch.cuda.current_device()).path == found.name


@pytest.mark.gpu
def test_using_makes_the_stream_current_and_restores_the_previous_one() -> None:
    needs_cuda()
    before = torch.cuda.current_stream()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with streams.StreamSwitch(side):
        assert torch.cuda.current_stream() == side
        with streams.StreamSwitch(side):  # already current: nothing to switch
            assert torch.cuda.current_stream() == side
        with streams.StreamSwitch(None):
            assert torch.cuda.current_stream() == side
    assert torch.cuda.current_stream() == before
    with pytest.raises(ValueError), streams.StreamSwitch(side):
        raise ValueError("restored on the way out")
    assert torch.cuda.current_stream() == before


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_the_event_marks_the_current_stream_and_the_copy_runs_on_it(path: str) -> None:
    calls = cuda_calls(path)
    src = torch.arange(1000, dtype=torch.int64, device="cuda")
    dst = torch.zeros(1000, dtype=torch.int64, pin_memory=True)
    transfer = calls.download(dst, src)
    assert transfer.landed() and not transfer.sent  # nothing sent: nothing to wait for
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with streams.StreamSwitch(side):
        torch.cuda._sleep(100_000_000)  # keeps the side stream busy
        src.add_(1)  # behind the sleep: the copy must see it
        transfer.send(src.nbytes)
    assert not transfer.landed()  # recorded behind the sleep on the side stream, not on the idle default one
    transfer.wait()
    assert transfer.landed()
    assert torch.equal(dst, torch.arange(1, 1001, dtype=torch.int64))


@pytest.mark.gpu
def test_the_download_refuses_what_it_cannot_copy() -> None:
    needs_cuda()
    calls = CudaCalls(torch.cuda.current_device())
    src = torch.zeros(8, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="pinned host memory"):
        calls.download(torch.zeros(8, dtype=torch.int64), src)  # not pinned
    with pytest.raises(ValueError, match="pinned host memory"):
        calls.download(torch.zeros(4, dtype=torch.int64, pin_memory=True), src)  # too small


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_the_upload_copies_the_first_bytes_on_the_current_stream(path: str) -> None:
    calls = cuda_calls(path)
    dst = torch.zeros(64, dtype=torch.uint8, device="cuda")
    src = torch.arange(64, dtype=torch.uint8).pin_memory()
    upload = calls.upload(dst, src)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with streams.StreamSwitch(side):
        torch.cuda._sleep(100_000_000)
        dst.fill_(255)  # behind the sleep: the upload must land after it
        upload.send(10)
        got = dst.clone()
    assert not upload.landed()  # its event is behind the sleep too
    side.synchronize()  # type: ignore[no-untyped-call]
    assert upload.landed()
    assert got[:10].tolist() == list(range(10)) and got[10:].tolist() == [255] * 54
    with pytest.raises(ValueError, match="pinned host bytes"):
        calls.upload(dst, torch.zeros(64, dtype=torch.uint8))  # not pinned
    with pytest.raises(ValueError, match="pinned host bytes"):
        calls.upload(dst.view(torch.int64), src.view(torch.int64))  # not bytes


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_the_graph_launch_replays_on_the_current_stream(path: str) -> None:
    calls = cuda_calls(path)
    x = torch.zeros(16, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        x.add_(1)
        graph.capture_end()
    torch.cuda.synchronize()
    launch = calls.graph_launch(graph)
    other = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with streams.StreamSwitch(other):
        torch.cuda._sleep(100_000_000)
        x.mul_(10)  # behind the sleep: each launch must land after it, on this stream
        launch()
        launch()
        got = x.clone()
    other.synchronize()  # type: ignore[no-untyped-call]
    assert got.tolist() == [2] * 16  # captured, not run: 0 * 10 + 1 + 1
