"""Public constructors refuse wrong types and unaffordable sizes with a message naming the argument."""

from __future__ import annotations

import pytest
import torch

import kvcanary as kc
from kvcanary.runtime import CanaryManager


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_batch": 2.5}, "capacity max_batch must be an int, got float 2.5"),
        ({"max_tokens": "64"}, "capacity max_tokens must be an int"),
        ({"verify_entries": True}, "capacity verify_entries must be an int, got bool"),
        ({"max_context": 1.0}, "capacity max_context must be an int"),
    ],
)
def test_capacities_refuse_non_ints(kwargs: dict[str, object], words: str) -> None:
    base: dict[str, object] = {"max_batch": 4, "max_tokens": 64, "verify_entries": 256}
    with pytest.raises(TypeError, match=words):
        kc.Capacities(**(base | kwargs))  # type: ignore[arg-type]
    kc.Capacities(**base)  # type: ignore[arg-type]  # the same call with good values passes


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"num_slots": 10.5}, "num_slots must be an int, got float"),
        ({"kind": "sliding_window", "window": 4}, "kind must be a kvcanary.layout.GroupKind"),
        ({"reserved_slots": 0}, r"reserved_slots must be a tuple of ints \(e.g. \(0,\) or \(\)\), got 0"),
        ({"page_size": 16.0}, "page_size must be an int"),
        ({"padding_row": "0"}, "padding_row must be an int"),
    ],
)
def test_groups_refuse_wrong_types(kwargs: dict[str, object], words: str) -> None:
    base: dict[str, object] = {"num_slots": 64}
    with pytest.raises(TypeError, match=words):
        kc.CanaryGroup(**(base | kwargs))  # type: ignore[arg-type]
    kc.CanaryGroup(**base)  # type: ignore[arg-type]


def test_an_absurd_pool_is_refused_before_allocating() -> None:
    group = kc.CanaryGroup(num_slots=2**40)  # tens of TiB of records and marks: more than any host has
    caps = kc.Capacities(max_batch=4, max_tokens=64, verify_entries=256)
    per_slot = kc.RecordStore.BYTES_PER_SLOT + kc.PlanWorkspace.MARK_BYTES_PER_SLOT
    gib = f"{2**40 * per_slot / 2**30:.2f}".replace(".", r"\.")
    with pytest.raises(MemoryError, match=rf"group 'full' would need {gib} GiB on cpu .*num_slots=1099511627776"):
        kc.GroupCanary(group, caps)
    with pytest.raises(MemoryError, match="would need"):
        CanaryManager([group], caps, kc.CanaryConfig())


def test_cuda_without_a_device_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    group = kc.CanaryGroup(num_slots=64)
    caps = kc.Capacities(max_batch=4, max_tokens=64, verify_entries=256)
    with pytest.raises(RuntimeError, match="torch sees no CUDA device here"):
        CanaryManager([group], caps, kc.CanaryConfig(), device="cuda")
    with pytest.raises(RuntimeError, match="torch sees no CUDA device here"):
        kc.GroupCanary(group, caps, device="cuda:0")
