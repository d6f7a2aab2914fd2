"""Bad input is refused with a TypeError/ValueError that names the argument, before any state changes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from kvcanary import CanaryGroup, Capacities, GroupCanary, GroupKind, StepBatch, ViolationLog
from kvcanary.batch import validate_batch

I32, I64 = torch.int32, torch.int64


def _canary(**group_kw: object) -> GroupCanary:
    group = CanaryGroup(num_slots=64, reserved_slots=(0,), padding_row=0, **group_kw)  # type: ignore[arg-type]
    caps = Capacities(max_batch=4, max_tokens=16, verify_entries=64, max_context=16, log_rows=8)
    return GroupCanary(group, caps)


def _table() -> torch.Tensor:
    table = torch.zeros(4, 16, dtype=I32)
    table[1, :8] = torch.arange(1, 9)
    table[2, :8] = torch.arange(20, 28)
    return table


def _good_batch(lookup: torch.Tensor | None = None) -> StepBatch:
    """Row 1 decodes position 5 (prefix 5), row 2 prefills positions 0..2, and a padding row."""
    return StepBatch(
        rows=torch.tensor([1, 0, 2], dtype=I64),
        prefix_lens=torch.tensor([5, 0, 0], dtype=I64),
        extend_lens=torch.tensor([1, 0, 3], dtype=I64),
        table=_table(),
        input_ids=torch.tensor([105, 200, 201, 202], dtype=I64),
        positions=torch.tensor([5, 0, 1, 2], dtype=I64),
        out_cache_loc=torch.tensor([6, 20, 21, 22], dtype=I64),
        lookup=lookup,
    )


def _warm(canary: GroupCanary, lookup: torch.Tensor | None = None) -> ViolationLog:
    """Prefill row 1's first five positions so records, workspace and log hold real state."""
    log = canary.new_log()
    canary.step(
        StepBatch(
            rows=torch.tensor([1], dtype=I64),
            prefix_lens=torch.tensor([0], dtype=I64),
            extend_lens=torch.tensor([5], dtype=I64),
            table=_table(),
            input_ids=torch.tensor([100, 101, 102, 103, 104], dtype=I64),
            positions=torch.arange(5, dtype=I64),
            out_cache_loc=torch.arange(1, 6, dtype=I64),
            lookup=lookup,
        ),
        log,
    )
    assert log.total() == 0 and int(canary.records.links[1:6].ne(0).sum()) == 5
    return log


def _snapshot(canary: GroupCanary, log: ViolationLog) -> list[torch.Tensor]:
    ws = canary.workspace
    state = [canary.records.tokens, canary.records.positions, canary.records.links, log.first, log.last, log.counters]
    state += [getattr(ws, f.name) for f in dataclasses.fields(ws)]
    return [t.clone() for t in state]


def _replace(**kw: object) -> Callable[[StepBatch], StepBatch]:
    def edit(b: StepBatch) -> StepBatch:
        values = {k: (v(b) if callable(v) else v) for k, v in kw.items()}
        return dataclasses.replace(b, **values)  # type: ignore[arg-type]

    return edit


BAD_BATCHES: list[tuple[str, Callable[[StepBatch], StepBatch], type[Exception], str]] = [
    ("rows float", _replace(rows=lambda b: b.rows.float()), TypeError, r"rows must be int32 or int64"),
    ("rows a list", _replace(rows=[1, 0, 2]), TypeError, r"rows must be a torch\.Tensor"),
    ("table bool", _replace(table=lambda b: b.table.bool()), TypeError, r"table must be int32 or int64"),
    ("input_ids int16", _replace(input_ids=lambda b: b.input_ids.short()), TypeError, r"input_ids must be int32"),
    ("rows 2-D", _replace(rows=lambda b: b.rows[:, None]), ValueError, r"rows must be 1-D"),
    ("table 1-D", _replace(table=lambda b: b.table.flatten()), ValueError, r"table must be 2-D"),
    ("prefix_lens short", _replace(prefix_lens=lambda b: b.prefix_lens[:2]), ValueError, r"prefix_lens has 2 entries"),
    ("extend_lens long", _replace(extend_lens=torch.tensor([1, 0, 3, 0])), ValueError, r"extend_lens has 4 entries"),
    ("positions short", _replace(positions=lambda b: b.positions[:3]), ValueError, r"positions has 3 entries"),
    ("out_cache_loc long", _replace(out_cache_loc=torch.arange(5)), ValueError, r"out_cache_loc has 5 entries"),
    ("rows on meta", _replace(rows=lambda b: b.rows.to("meta")), ValueError, r"rows is on meta"),
    ("table on meta", _replace(table=lambda b: b.table.to("meta")), ValueError, r"table is on meta"),
    ("positions on meta", _replace(positions=lambda b: b.positions.to("meta")), ValueError, r"positions is on meta"),
    (
        "table not contiguous",
        _replace(table=lambda b: torch.zeros(4, 32, dtype=I32)[:, ::2]),
        ValueError,
        r"table must be contiguous",
    ),
    (
        "input_ids not contiguous",
        _replace(input_ids=lambda b: torch.zeros(8, dtype=I64)[::2]),
        ValueError,
        r"input_ids must be contiguous",
    ),
    ("negative prefix", _replace(prefix_lens=torch.tensor([-1, 0, 0])), ValueError, r"prefix_lens has negative"),
    ("negative extend", _replace(extend_lens=torch.tensor([1, 0, -3])), ValueError, r"extend_lens has negative"),
    ("row past the table", _replace(rows=torch.tensor([1, 0, 4])), ValueError, r"rows has entries outside the table"),
    ("negative row", _replace(rows=torch.tensor([-1, 0, 2])), ValueError, r"rows has entries outside the table"),
    (
        "longer than the table",
        _replace(prefix_lens=torch.tensor([16, 0, 0])),
        ValueError,
        r"prefix_lens \+ extend_lens exceeds the table width 16",
    ),
    (
        "more tokens declared than given",
        _replace(extend_lens=torch.tensor([2, 0, 3])),
        ValueError,
        r"extend_lens sums to 5 tokens, but input_ids holds 4",
    ),
    (
        "batch over max_batch",
        _replace(
            rows=torch.tensor([1, 0, 2, 0, 0]),
            prefix_lens=torch.zeros(5, dtype=I64),
            extend_lens=torch.tensor([1, 0, 3, 0, 0]),
        ),
        ValueError,
        r"max_batch=4",
    ),
    (
        "tokens over max_tokens",
        _replace(
            input_ids=torch.zeros(17, dtype=I64),
            positions=torch.zeros(17, dtype=I64),
            out_cache_loc=torch.zeros(17, dtype=I64),
        ),
        ValueError,
        r"max_tokens=16",
    ),
    ("truth without lens", _replace(truth=lambda b: b.table.clone()), ValueError, r"truth and truth_lens"),
    ("lens without truth", _replace(truth_lens=torch.tensor([6, 0, 3])), ValueError, r"truth and truth_lens"),
    (
        "truth_lens short",
        _replace(truth=lambda b: b.table.clone(), truth_lens=torch.tensor([6, 0])),
        ValueError,
        r"truth_lens has 2 entries",
    ),
    (
        "truth_lens negative",
        _replace(truth=lambda b: b.table.clone(), truth_lens=torch.tensor([6, 0, -1])),
        ValueError,
        r"truth_lens has negative",
    ),
    (
        "truth 1-D",
        _replace(truth=torch.zeros(4, dtype=I32), truth_lens=torch.tensor([6, 0, 3])),
        ValueError,
        r"truth must be 2-D",
    ),
    (
        "truth with fewer rows than the table",
        _replace(truth=lambda b: b.table[:2].clone(), truth_lens=torch.tensor([6, 0, 3])),
        ValueError,
        r"truth has 2 rows, but batch rows \[2\] use table rows \[2\]",
    ),
    (
        "truth_lens beyond the truth's width",
        _replace(truth=lambda b: b.table[:, :4].clone(), truth_lens=torch.tensor([6, 0, 3])),
        ValueError,
        r"truth_lens exceeds the truth's width 4 at batch rows \[0\]",
    ),
    ("lookup for a full group", _replace(lookup=torch.arange(64)), ValueError, r"takes no lookup table"),
]


@pytest.mark.parametrize(("what", "edit", "exc", "match"), BAD_BATCHES, ids=[b[0] for b in BAD_BATCHES])
@pytest.mark.parametrize("call", ["plan", "step"])
def test_bad_batch_is_refused_before_any_change(
    what: str, edit: Callable[[StepBatch], StepBatch], exc: type[Exception], match: str, call: str
) -> None:
    canary = _canary()
    log = _warm(canary)
    good = _good_batch()
    canary.plan(good, log)  # the workspace holds this step's plan: a refused call must leave it
    before = _snapshot(canary, log)
    with pytest.raises(exc, match=match) as info:
        getattr(canary, call)(edit(_good_batch()), log)
    after = _snapshot(canary, log)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True)), f"{what}: state changed"
    print(f"{what}: {type(info.value).__name__}: {info.value}")  # shown with -s: the messages users see


def test_the_good_batch_is_accepted() -> None:
    # The control for the table above: the unedited batch passes and runs silently.
    canary = _canary()
    log = _warm(canary)
    canary.step(_good_batch(), log)
    assert log.total() == 0
    assert int(log.counters[-2]) == 5 + 4  # STAMPED: the warm-up's five and this step's four


def test_value_checks_can_be_left_to_the_kernels() -> None:
    # check_values=False (the GPU default) skips host reads; the bad value becomes a violation instead.
    canary = _canary()
    log = _warm(canary)
    canary.plan(_replace(rows=torch.tensor([1, 0, 9]))(_good_batch()), log, check_values=False)
    assert log.total() == 1


def test_lookup_group_needs_its_lookup() -> None:
    lookup = torch.arange(64, dtype=I64)
    canary = _canary(kind=GroupKind.SLIDING_WINDOW, window=4, uses_lookup=True, name="swa")
    log = _warm(canary, lookup)
    before = _snapshot(canary, log)
    with pytest.raises(ValueError, match=r"group 'swa' uses a lookup table but the batch has none"):
        canary.plan(_good_batch(), log)
    with pytest.raises(TypeError, match=r"lookup must be int32 or int64"):
        canary.plan(_good_batch(lookup.float()), log)
    with pytest.raises(ValueError, match=r"lookup must be 1-D"):
        canary.plan(_good_batch(lookup[:, None]), log)
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(canary, log), strict=True))
    canary.step(_good_batch(lookup), log)  # control: with its lookup the batch is fine
    assert log.total() == 0


def test_validate_batch_direct() -> None:
    group = CanaryGroup(num_slots=64)
    batch = _good_batch()
    validate_batch(batch, group, device=torch.device("cpu"), max_batch=3, max_tokens=4, check_values=True)
    with pytest.raises(ValueError, match="max_batch=2"):
        validate_batch(batch, group, device=torch.device("cpu"), max_batch=2, max_tokens=4, check_values=True)
    with pytest.raises(ValueError, match=r"rows is on cpu, expected meta"):
        validate_batch(batch, group, device=torch.device("meta"), max_batch=3, max_tokens=4, check_values=False)


@pytest.mark.parametrize("page", [2**27, 2**27 - 1])
def test_a_table_wider_than_32_bit_positions_is_refused(page: int) -> None:
    """The kernels page positions in 32 bits: a row spanning 2**31 positions or more is refused, one short of it is
    not."""
    group = CanaryGroup(num_slots=64, page_size=page)
    batch = dataclasses.replace(_good_batch(), table=torch.zeros(4, 16, dtype=I32))
    cpu = torch.device("cpu")
    if page * 16 >= 2**31:
        with pytest.raises(ValueError, match=r"table rows span 16 x 134217728 positions .* at most 2\*\*31 - 1"):
            validate_batch(batch, group, device=cpu, max_batch=3, max_tokens=4, check_values=False)
    else:
        validate_batch(batch, group, device=cpu, max_batch=3, max_tokens=4, check_values=False)


# --------------------------------------------------------------------------- capacities, groups, logs


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"max_batch": 0}, r"capacity max_batch must be positive, got 0"),
        ({"max_tokens": -1}, r"capacity max_tokens must be positive, got -1"),
        ({"verify_entries": 0}, r"capacity verify_entries must be positive"),
        ({"log_rows": 0}, r"capacity log_rows must be positive"),
        ({"max_context": -5}, r"max_context must be >= 0, got -5"),
    ],
)
def test_bad_capacities(kw: dict[str, int], match: str) -> None:
    args = {"max_batch": 4, "max_tokens": 16, "verify_entries": 64} | kw
    with pytest.raises(ValueError, match=match):
        Capacities(**args)


def test_capacities_too_small_for_the_declared_context() -> None:
    caps = Capacities(max_batch=4, max_tokens=16, verify_entries=100, max_context=4096)
    with pytest.raises(ValueError, match=r"verify_entries=100 is smaller than one request's verify span 4096"):
        caps.check_covers(0)
    caps.check_covers(64)  # a window of 64 fits
    with pytest.raises(ValueError, match=r"verify_entries=100 .* span 128"):
        caps.check_covers(128)
    with pytest.raises(ValueError, match=r"verify_entries"):
        GroupCanary(CanaryGroup(num_slots=8), caps)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_slots": 0}, r"num_slots must be positive, got 0"),
        ({"group_id": -1}, r"group_id must be in \[0, 2\*\*31\), got -1"),
        ({"page_size": 0}, r"page_size must be positive, got 0"),
        ({"kind": GroupKind.FULL, "window": 4}, r"a FULL group takes no window"),
        ({"uses_lookup": True}, r"a FULL group takes no window and no lookup"),
        ({"kind": GroupKind.SLIDING_WINDOW}, r"SLIDING_WINDOW group needs window > 0, got 0"),
        ({"token_offset": 2}, r"token_offset must be 0 \(target\) or 1 \(draft\), got 2"),
        ({"reserved_slots": tuple(range(9))}, r"at most 8 reserved_slots, got 9"),
        ({"reserved_slots": (0, 16)}, r"reserved slot 16 is outside the pool \[0, 16\)"),
        ({"reserved_slots": (-1,)}, r"reserved slot -1 is outside the pool"),
        ({"padding_row": -1}, r"padding_row must be >= 0 or None, got -1"),
    ],
)
def test_bad_group(kw: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"num_slots": 16} | kw
    with pytest.raises(ValueError, match=match):
        CanaryGroup(**args)  # type: ignore[arg-type]


def test_the_group_kind_follows_from_the_window_unless_given() -> None:
    assert CanaryGroup(num_slots=16).kind is GroupKind.FULL
    ring = CanaryGroup(num_slots=16, window=4, uses_lookup=True)
    assert ring.kind is GroupKind.SLIDING_WINDOW
    assert ring == CanaryGroup(num_slots=16, kind=GroupKind.SLIDING_WINDOW, window=4, uses_lookup=True)


def test_bad_log_capacity() -> None:
    with pytest.raises(ValueError, match=r"log capacity must be positive, got 0"):
        ViolationLog.allocate(0)


def test_verify_and_stamp_need_the_planned_batch() -> None:
    """verify/stamp before any plan, or with a batch shaped unlike the planned one, raise and change nothing."""
    fresh = _canary()
    with pytest.raises(ValueError, match="verify called before plan"):
        fresh.verify(_good_batch(), fresh.new_log())
    canary = _canary()
    log = _warm(canary)
    canary.plan(_good_batch(), log)
    before = _snapshot(canary, log)
    shorter = dataclasses.replace(_good_batch(), input_ids=torch.tensor([105, 200, 201], dtype=I64))
    for call, name in ((canary.verify, "verify"), (canary.stamp, "stamp")):
        with pytest.raises(ValueError, match=f"{name} got a batch shaped unlike"):
            call(shorter, log)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(canary, log), strict=True))
    canary.verify(_good_batch(), log)  # an equal batch rebuilt by the caller is fine
    canary.stamp(_good_batch(), log)
    assert log.total() == 0
