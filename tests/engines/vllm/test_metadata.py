"""The adapter reads every GPU backend's attention metadata into the rows FLASH_ATTN's metadata gives.

One batch, one ``CommonAttentionMetadata``; FLASH_ATTN, TRITON_ATTN and FLEX_ATTENTION metadata built by their
own builders, FLASHINFER's TRTLLM-path metadata from its own classes (``metadata_cases``).  The view must equal
FLASH_ATTN's, which must equal the batch itself (tables, lengths, slots), on one request, prime lengths, partial
last pages, mixed decodes and prefills and speculative decodes (uniform and ragged).  Both sides: a changed field
changes the view, FlashInfer's native paths are refused naming the part and its missing fields, at install and
per step, and in the real engine a corrupt FlashInfer metadata is reported in ``log`` mode, never raised.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import pathlib
import types
from typing import Any

import pytest
import torch
from metadata_cases import (
    DENSE_BACKENDS,
    Batch,
    common_metadata,
    dense_metadata,
    flashinfer_metadata,
    flashinfer_source,
    needed_pages,
    vllm_config,
)

from kvcanary.adapters.vllm import install, metadata, tiny, translate
from kvcanary.adapters.vllm.groups import vllm_groups
from kvcanary.adapters.vllm.workload import generate, make_workload

BATCHES = {
    "one-prefill": (Batch((0,), (37,), 16), 1),  # (batch, FlashInfer's decode threshold)
    "one-decode": (Batch((52,), (1,), 16), 1),
    "mixed": (Batch((30, 6, 100, 0, 17), (1, 1, 13, 41, 5), 16), 1),
    "spec-uniform": (Batch((40, 11, 7), (3, 3, 19), 32), 3),
    "spec-ragged": (Batch((40, 11, 29, 3), (3, 2, 1, 23), 32), 3),
    "page-edges": (Batch((31, 32, 0), (1, 1, 64), 32), 1),  # last page exactly full, one token in a new page
}
GROUP_VIEW = translate.group_view  # the adapter's own, before a test wraps it
ENGINE_PAGE = tiny.engine_kwargs()["block_size"]
FLASHINFER_VARIANTS = (("XQA", False), ("XQA", True), ("TRTLLM_GEN", False))  # decode kernel, fp8 prefill table


@pytest.fixture(scope="module")
def config(model_dir: str) -> Any:
    return vllm_config(model_dir)


def _view(meta: Any, common: Any) -> translate.GroupView:
    return translate.group_view(meta, None, common.num_reqs, common.num_actual_tokens)


def _assert_same(view: translate.GroupView, ref: translate.GroupView, page: int, whole_table: bool = True) -> None:
    assert view.prefix_lens.tolist() == ref.prefix_lens.tolist()
    assert view.extend_lens.tolist() == ref.extend_lens.tolist()
    assert view.out_cache_loc.tolist() == ref.out_cache_loc.tolist()
    seq = (ref.prefix_lens + ref.extend_lens).tolist()
    assert needed_pages(view.table, seq, page) == needed_pages(ref.table, seq, page)
    if whole_table:
        assert torch.equal(view.table, ref.table)


@pytest.mark.parametrize("case", BATCHES)
def test_every_backend_gives_flash_attns_rows(config: Any, case: str) -> None:
    batch, threshold = BATCHES[case]
    common = common_metadata(batch)
    ref = _view(dense_metadata("FLASH_ATTN", config, common, batch.page), common)
    assert ref.prefix_lens.tolist() == list(batch.prefix) and ref.extend_lens.tolist() == list(batch.extend)
    assert torch.equal(ref.table, common.block_table_tensor) and torch.equal(ref.out_cache_loc, common.slot_mapping)
    for name in DENSE_BACKENDS[1:]:
        _assert_same(_view(dense_metadata(name, config, common, batch.page), common), ref, batch.page)
    for kernel, fp8 in FLASHINFER_VARIANTS:
        fi = flashinfer_metadata(common, batch.page, threshold=threshold, decode_kernel=kernel, fp8=fp8)
        _assert_same(_view(fi, common), ref, batch.page, whole_table=not fp8)


def test_flex_attentions_buffers_are_read_only_for_the_steps_rows(config: Any) -> None:
    """FlexAttention hands over persistent buffers of the scheduler's capacity: past the step's rows they hold
    whatever the last larger batch left, so a translation that read them whole would see foreign rows."""
    batch, _ = BATCHES["mixed"]
    common = common_metadata(batch)
    flex = dense_metadata("FLEX_ATTENTION", config, common, batch.page)
    assert flex.seq_lens.shape[0] > common.num_reqs  # the case is real
    flex.seq_lens[common.num_reqs :] = 10_000
    view = _view(flex, common)
    assert view.prefix_lens.shape[0] == common.num_reqs and int(view.prefix_lens.max()) < 10_000


def _perturbed(fi: Any, part: str | None, field: str) -> Any:
    owner = fi if part is None else getattr(fi, part)
    value = getattr(owner, field)
    changed = value + 1 if isinstance(value, int) else value.clone()
    if not isinstance(value, int):
        changed.view(-1)[1 if changed.dim() == 1 and changed.shape[0] > 1 else 0] += 1
    owner = dataclasses.replace(owner, **{field: changed})
    return owner if part is None else dataclasses.replace(fi, **{part: owner})


@pytest.mark.parametrize(
    ("case", "part", "field"),
    [
        ("spec-ragged", "decode", "block_tables"),
        ("spec-ragged", "decode", "seq_lens"),
        ("spec-ragged", "decode", "q_cu_seq_lens"),
        ("spec-uniform", "decode", "q_len_per_req"),
        ("mixed", "prefill", "block_tables"),
        ("mixed", "prefill", "seq_lens"),
        ("mixed", "prefill", "cum_seq_lens_q"),
        ("mixed", None, "slot_mapping"),
    ],
)
def test_each_flashinfer_field_is_read(case: str, part: str | None, field: str) -> None:
    batch, threshold = BATCHES[case]
    common = common_metadata(batch)
    fi = flashinfer_metadata(common, batch.page, threshold=threshold)
    assert getattr(fi if part is None else getattr(fi, part), field) is not None
    clean, changed = _view(fi, common), _view(_perturbed(fi, part, field), common)
    fields = ("table", "prefix_lens", "extend_lens", "out_cache_loc")
    assert any(not torch.equal(getattr(clean, f), getattr(changed, f)) for f in fields), (part, field)


@pytest.mark.parametrize(("part", "native"), [("decode", "FIDecode"), ("prefill", "FIPrefill")])
def test_flashinfers_native_paths_are_refused_by_name(part: str, native: str) -> None:
    batch, _ = BATCHES["mixed"]
    common = common_metadata(batch)
    fi = flashinfer_metadata(common, batch.page)
    wrapped = dataclasses.replace(fi, **{part: getattr(flashinfer_source(), native)(wrapper=object())})
    fields = metadata.FLASHINFER_DECODE_FIELDS if part == "decode" else metadata.FLASHINFER_PREFILL_FIELDS
    with pytest.raises(TypeError, match=rf"FLASHINFER's {part} metadata is a {native} .*lacks \[.*{fields[0]}"):
        _view(wrapped, common)


def test_metadata_of_fewer_rows_than_the_step_or_of_no_known_layout_is_refused() -> None:
    batch, _ = BATCHES["mixed"]
    common = common_metadata(batch)
    short = dataclasses.replace(flashinfer_metadata(common, batch.page), num_prefills=1)
    with pytest.raises(ValueError, match="FLASHINFER metadata has 2 decode \\+ 1 prefill rows; the step has 5"):
        _view(short, common)
    with pytest.raises(TypeError, match="SimpleNamespace has neither"):
        _view(types.SimpleNamespace(slot_mapping=common.slot_mapping), common)


# ---------------------------------------------------------------- install


def _runner(backend: str, builder: Any = None) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    cls = types.SimpleNamespace(get_name=lambda: backend)
    attn_group = types.SimpleNamespace(backend=cls, metadata_builders=[] if builder is None else [builder])
    group = types.SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.self_attn.attn"])
    return types.SimpleNamespace(
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[group], num_blocks=8),
        input_batch=types.SimpleNamespace(block_table=types.SimpleNamespace(block_tables=[types.SimpleNamespace(block_size=16)])),
        attn_groups=[[attn_group]],
    )  # fmt: skip


def _flashinfer_builder(decode: bool, page: int = 16, forced: bool | None = None, dcp: bool = False) -> Any:
    attention_config = types.SimpleNamespace(use_trtllm_attention=forced)
    return types.SimpleNamespace(
        use_dcp=dcp, use_trtllm_decode_attention=decode, page_size=page, attention_config=attention_config
    )


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "CPU_ATTN"])
def test_dense_backends_are_accepted(backend: str) -> None:
    assert [g.canary.page_size for g in vllm_groups(_runner(backend))] == [16]


def test_flashinfer_is_accepted_only_where_every_step_takes_trtllm_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    refusals = {
        "FIDecode": _flashinfer_builder(decode=False, forced=True),
        "FIPrefill": _flashinfer_builder(decode=True, forced=None),
        "rank-local": _flashinfer_builder(decode=True, forced=True, dcp=True),
    }
    for why, builder in refusals.items():
        with pytest.raises(ValueError, match=f"group 0 uses attention backend FLASHINFER, .*{why}"):
            vllm_groups(_runner("FLASHINFER", builder))
    with pytest.raises(ValueError, match="lacks \\['page_size', 'attention_config'\\]"):
        vllm_groups(_runner("FLASHINFER", types.SimpleNamespace(use_dcp=False, use_trtllm_decode_attention=True)))
    # A forced (or >= 128-token page) builder is read only on a GPU that runs TRTLLM prefill (SM100).
    monkeypatch.setattr(metadata, "_trtllm_prefill_supported", lambda: False)
    with pytest.raises(ValueError, match="FIPrefill"):
        vllm_groups(_runner("FLASHINFER", _flashinfer_builder(decode=True, forced=True)))
    monkeypatch.setattr(metadata, "_trtllm_prefill_supported", lambda: True)
    for builder in (_flashinfer_builder(decode=True, forced=True), _flashinfer_builder(decode=True, page=128)):
        assert len(vllm_groups(_runner("FLASHINFER", builder))) == 1
    with pytest.raises(ValueError, match="FIPrefill"):
        vllm_groups(_runner("FLASHINFER", _flashinfer_builder(decode=True, forced=False, page=128 // 2)))


def test_the_flashinfer_builder_fields_read_at_install_are_vllms() -> None:
    """FLASHINFER's builder cannot be made without ``flashinfer``: its ``__init__`` must set what the install
    check reads (the source of the installed vLLM, parsed)."""
    spec = importlib.util.find_spec("vllm.v1.attention.backends.flashinfer")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    builder = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FlashInferMetadataBuilder")
    init = next(n for n in builder.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assigned = {
        t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Attribute)
    }
    assert set(metadata.FLASHINFER_BUILDER_FIELDS) <= assigned, set(metadata.FLASHINFER_BUILDER_FIELDS) - assigned


def test_an_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="attention backend FLASHMLA, whose metadata the vLLM adapter does not know"):
        vllm_groups(_runner("FLASHMLA"))


# ---------------------------------------------------------------- the real engine, metadata seen as FLASHINFER's


def _as_flashinfer(monkeypatch: pytest.MonkeyPatch, corrupt: Any) -> list[int]:
    """Every step's CPU metadata is handed to the adapter as FLASHINFER's (TRTLLM paths) of the same batch;
    ``corrupt(fi, common, step)`` may change it.  Returns the steps seen (a list the caller can read)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    steps = [0]

    def group_view(meta: Any, slot_mapping: Any, num_reqs: int, num_tokens: int) -> translate.GroupView:
        qsl = meta.query_start_loc[: num_reqs + 1]
        seq = meta.seq_lens[:num_reqs]
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=num_reqs,
            num_actual_tokens=num_tokens, max_query_len=int((qsl[1:] - qsl[:-1]).max()), max_seq_len=int(seq.max()),
            block_table_tensor=meta.block_table[:num_reqs], slot_mapping=meta.slot_mapping,
        )  # fmt: skip
        fi = corrupt(flashinfer_metadata(common, ENGINE_PAGE), common, steps[0])
        steps[0] += 1
        return GROUP_VIEW(fi, slot_mapping, num_reqs, num_tokens)

    monkeypatch.setattr(translate, "group_view", group_view)
    return steps


def _swap_first_pages(fi: Any, common: Any, step: int, done: list[bool]) -> Any:
    """Once: the first decode row with two pages gets them swapped (what attention would read is wrong)."""
    if done or fi.decode is None:
        return fi
    seq = fi.decode.seq_lens
    rows = (seq > ENGINE_PAGE).nonzero().flatten().tolist()
    if step < 8 or not rows:
        return fi
    done.append(True)
    table = fi.decode.block_tables.clone()
    table[rows[0], [0, 1]] = table[rows[0], [1, 0]]
    return dataclasses.replace(fi, decode=dataclasses.replace(fi.decode, block_tables=table))


def _run_in_log_mode(llm: Any, requests: int) -> tuple[Any, list[Any]]:
    """Install the canary in log mode, generate ``requests`` prompts, flush and uninstall: (canary, outputs)."""
    llm.reset_prefix_cache()
    canary = install(llm, "log")
    assert canary is not None
    try:
        outs = generate(llm, make_workload(seed=11, num_requests=requests))
        canary.flush()
    finally:
        canary.uninstall()
    return canary, outs


@pytest.mark.parametrize("corrupting", [False, True])
def test_engine_with_flashinfer_metadata_is_silent_clean_and_reports_corruption(
    llm: Any, monkeypatch: pytest.MonkeyPatch, corrupting: bool
) -> None:
    done: list[bool] = []
    steps = _as_flashinfer(monkeypatch, lambda fi, c, s: _swap_first_pages(fi, c, s, done) if corrupting else fi)
    canary, outs = _run_in_log_mode(llm, 8)
    features, stats = canary.features(), canary.stats()
    assert len(outs) == 8 and features["canary_errors"] == 0 and steps[0] > 8
    assert features["decode_rows"] > 0 and features["prefill_rows"] > 0
    assert (stats["violations"] > 0) == corrupting == bool(done), (stats, done)


def test_engine_step_on_flashinfers_native_path_is_a_logged_canary_error(
    llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    native = flashinfer_source().FIDecode(wrapper=object())
    _as_flashinfer(monkeypatch, lambda fi, c, s: fi if fi.decode is None else dataclasses.replace(fi, decode=native))
    canary, outs = _run_in_log_mode(llm, 4)
    assert len(outs) == 4 and all(outs)
    assert canary.features()["canary_errors"] > 0 and canary.stats()["violations"] == 0
