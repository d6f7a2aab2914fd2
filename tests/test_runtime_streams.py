"""``runtime.streams``: the stream switch and the event record the per-step path uses instead of torch's
(which look the current device up in Python on every call).  CUDA only."""

from __future__ import annotations

import pytest
import torch

from kvcanary.runtime import streams


@pytest.mark.gpu
def test_using_makes_the_stream_current_and_restores_the_previous_one() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    before = torch.cuda.current_stream()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with streams.using(side):
        assert torch.cuda.current_stream() == side
        with streams.using(side):  # already current: nothing to switch
            assert torch.cuda.current_stream() == side
        with streams.using(None):
            assert torch.cuda.current_stream() == side
    assert torch.cuda.current_stream() == before
    with pytest.raises(ValueError), streams.using(side):
        raise ValueError("restored on the way out")
    assert torch.cuda.current_stream() == before


@pytest.mark.gpu
def test_record_marks_the_current_stream_of_the_device() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    with streams.using(side):
        torch.cuda._sleep(100_000_000)  # keeps the side stream busy
        streams.record(event, torch.cuda.current_device())
    assert not event.query()  # recorded behind the sleep on the side stream, not on the idle default one
    event.synchronize()
    assert event.query()
