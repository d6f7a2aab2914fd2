"""The transformers workloads of the demo and the self-test: tiny random-weight models, prompts, configs.

Models are built in code (no download); prompts mix lengths and share prefixes; one engine-config builder
serves both the demo's shape (64+ prompts, sampled) and the self-test's smaller, top-1 (deterministic) one.
transformers is imported only when a function is called.
"""

from __future__ import annotations

import random
from contextlib import AbstractContextManager
from typing import Any, cast

import torch

from kvcanary.adapters.transformers_cb.geometry import FULL_ATTENTION, SLIDING_ATTENTION
from kvcanary.selftest.quiet import quiet_loggers

MODEL_KINDS: tuple[str, ...] = ("dense", "hybrid", "sliding")
SLIDING_WINDOW = 12  # smaller than most sequences, and not a multiple of the page size
PAGE_SIZE = 8
DEMO_NUM_BLOCKS = {"dense": 48, "hybrid": 48, "sliding": 20}  # tight enough to force offloading


def build_model(kind: str, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    """A 2-layer random-weight model: Llama (dense), Qwen2 sliding+full (hybrid) or Mistral (sliding)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common: dict[str, Any] = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(seed)
    model: torch.nn.Module
    if kind == "dense":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "hybrid":
        layer_types = [SLIDING_ATTENTION, FULL_ATTENTION]
        cfg = Qwen2Config(**common, layer_types=layer_types, sliding_window=SLIDING_WINDOW, use_sliding_window=True)
        model = Qwen2ForCausalLM(cfg)
    elif kind == "sliding":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=SLIDING_WINDOW))
    else:
        raise ValueError(f"model kind must be one of {', '.join(MODEL_KINDS)}, got {kind!r}")
    model.config._attn_implementation = "sdpa"
    moved: torch.nn.Module = cast(Any, model).to(device)
    return moved.eval()


def build_prompts(n: int, seed: int = 0, vocab: int = 1000) -> list[list[int]]:
    """Mixed lengths (about 8 to 70 tokens); three in four prompts start with one of three shared prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, vocab) for _ in range(length)] for length in (16, 24, 40)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(1, vocab) for _ in range(rng.randrange(2, 30))]
        prompts.append(tail + tail[:6] if i % 4 == 3 else prefixes[i % 4] + tail)
    return prompts


def engine_configs(
    kind: str,
    new_tokens: int,
    seed: int,
    async_batching: bool | None = False,  # None: transformers decides (the self-test's choice)
    cuda_graphs: bool = False,
    *,
    num_blocks: int | None = None,
    max_batch_tokens: int = 64,
    max_requests_per_batch: int = 16,
    top_k: int | None = None,
) -> tuple[Any, Any]:
    """(GenerationConfig, ContinuousBatchingConfig): two sampled sequences per prompt (forks), CPU offload on.

    The defaults are the demo's; the self-test passes a smaller cache and batch and ``top_k=1`` (greedy, so
    a faulted run is identical to its control up to the injection).
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    sampling: dict[str, Any] = {} if top_k is None else {"top_k": top_k}
    gen = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=new_tokens, do_sample=True, num_return_sequences=2, eos_token_id=-1, **sampling
    )
    cb = ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=DEMO_NUM_BLOCKS[kind] if num_blocks is None else num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
        cpu_offload_space=0.01,  # GiB: a few sectors of CPU swap space, enough for every offload
        use_async_batching=async_batching,
        use_cuda_graph=True if cuda_graphs else None,  # None: transformers decides (off with sdpa's masks)
        seed=seed,
    )
    return gen, cb


def quiet_engine_logs() -> AbstractContextManager[None]:
    """The demo and the self-test print their own report: silence transformers' and the canary's log lines."""
    return quiet_loggers("transformers", "ContinuousBatchingLogger", "kvcanary")
