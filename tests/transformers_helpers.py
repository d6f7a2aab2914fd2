"""Shared by the transformers adapter tests: a hand-written model of the engine's index layout (no engine),
and a demo workload run with the canary installed (the real engine)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.host_batch import HostBatch
from kvcanary.demo import FOLLOW_UP, DemoOptions, RunResult, build_model, build_prompts, quiet_engine_logs, run_workload
from kvcanary.ops import Backend

PAGE, STRIDE, BPS = 4, 8, 2  # page size, physical stride (2 rows x 1 layer x page), blocks per sector


def geometry(window: int = 0) -> GroupGeometry:
    return GroupGeometry(
        name="sliding_attention" if window else "full_attention",
        index=0,
        sliding_window=window,
        page_size=PAGE,
        stride=STRIDE,
        num_blocks=BPS * 6,
        read_trash_index=0,
        sentinel_index=1,
        write_trash_index=STRIDE * BPS,
    )


class FakeEngine:
    """Index lists the way transformers builds them, for requests with fixed block tables."""

    def __init__(self, g: GroupGeometry, tables: dict[str, list[int]], tokens: dict[str, list[int]]) -> None:
        self.g, self.tables, self.tokens = g, tables, tokens
        self.past = dict.fromkeys(tables, 0)

    def phys(self, rid: str, pos: int) -> int:
        ring = pos % self.g.sliding_window if self.g.is_sliding else pos
        return self.tables[rid][ring // PAGE] * STRIDE + ring % PAGE

    def step(self, queries: dict[str, int]) -> tuple[dict[str, Any], HostBatch]:
        g = self.g
        ids, pos, read, write, cu_q, cu_k = [], [], [], [], [0], [0]
        has_past = any(self.past[r] for r in queries)  # else transformers hands an empty read_index
        for rid, q in queries.items():
            p = self.past[rid]
            ids += self.tokens[rid][p : p + q]
            pos += list(range(p, p + q))
            if g.is_sliding:
                n = min(p, g.sliding_window - 1)
                read += [self.phys(rid, x) for x in range(p - n, p)] + [g.sentinel_index] * q
                keep = min(q, g.sliding_window)
                write += [g.write_trash_index] * (q - keep) + [self.phys(rid, x) for x in range(p + q - keep, p + q)]
                cu_k.append(cu_k[-1] + n + q)
            else:
                read += [self.phys(rid, x) for x in range(p + q)]
                write += [self.phys(rid, x) for x in range(p, p + q)]
                cu_k.append(cu_k[-1] + p + q)
            cu_q.append(cu_q[-1] + q)
        host = HostBatch(
            request_ids=tuple(queries),
            past_lens=tuple(self.past[r] for r in queries),
            query_lens=tuple(queries.values()),
            truth=tuple(self.tokens[r] for r in queries),
        )
        for rid, q in queries.items():
            self.past[rid] += q
        i32 = torch.int32
        kwargs: dict[str, Any] = {
            "input_ids": torch.tensor([ids], dtype=i32),
            "position_ids": torch.tensor([pos], dtype=i32),
            "cu_seq_lens_q": torch.tensor(cu_q, dtype=i32),
            "cu_seq_lens_k": {g.name: torch.tensor(cu_k, dtype=i32)},
            "read_index": [torch.tensor(read if has_past else [], dtype=torch.int64)],
            "write_index": [torch.tensor(write, dtype=torch.int64)],
            "block_table": None,
        }
        return kwargs, host


def demo_run(
    kind: str,
    *,
    fault: str | None = None,
    requests: int = 64,
    backend: Backend = Backend.AUTO,
    queue_moves: bool = True,
) -> RunResult:
    follow_up = FOLLOW_UP if fault is None else 0  # the follow-up wave matters for the clean runs' features
    options = DemoOptions(model=kind, requests=requests, follow_up=follow_up, fault_after_step=10, backend=backend)
    options = dataclasses.replace(options, queue_moves=queue_moves)
    prompts = build_prompts(requests + follow_up)
    with quiet_engine_logs():
        return run_workload(build_model(kind), prompts, options, label=kind, fault=fault)


def tiny_generate(model: torch.nn.Module, n: int = 4) -> dict[str, object]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1)
    cb = ContinuousBatchingConfig(page_size=8, num_blocks=16, max_batch_tokens=32, max_requests_per_batch=4)
    with quiet_engine_logs():
        return model.generate_batch(build_prompts(n), generation_config=gen, continuous_batching_config=cb)


def kwargs_to(kwargs: dict[str, Any], device: str) -> dict[str, Any]:
    """The engine's forward kwargs with every tensor (in lists and dicts too) moved to ``device``."""

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, list):
            return [move(v) for v in x]
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        return x

    return {k: move(v) for k, v in kwargs.items()}


class StaticInputs:
    """The engine's index tensors copied into buffers of fixed addresses, as transformers' static tensors are:
    each step's tensors are views of the same storage, with the step's lengths."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def _view(self, name: str, i: int, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.setdefault((name, i), torch.zeros(4096, dtype=t.dtype, device=self.device))
        flat = buf[: t.numel()]
        flat.copy_(t.reshape(-1))
        return flat.view(t.shape)

    def put(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        out = dict(kwargs)
        for name in ("read_index", "write_index"):
            out[name] = [self._view(name, i, t) for i, t in enumerate(kwargs[name])]
        out["cu_seq_lens_k"] = {k: self._view(k, 0, t) for k, t in kwargs["cu_seq_lens_k"].items()}
        for name in ("input_ids", "position_ids"):
            out[name] = self._view(name, 0, kwargs[name])
        return out


def growing(host: HostBatch) -> HostBatch:
    """``host`` with each request's truth cut to the tokens it has so far (the fake engine hands them all)."""
    truth = tuple(t[: p + q] for t, p, q in zip(host.truth, host.past_lens, host.query_lens, strict=True))
    return dataclasses.replace(host, truth=truth)
