"""The Qwen3-0.6B-shaped model the end-to-end measurements run (and a 2-layer toy of it for dry runs):
transformers' own modelling code with random weights, ``sdpa`` attention; no checkpoint needed."""

from __future__ import annotations

from typing import Any

import torch

QWEN3_06B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
)  # fmt: skip
TOY = QWEN3_06B | dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=1000)  # fmt: skip


def build_model(cfg_kw: dict[str, Any], dev: torch.device | str) -> Any:
    """The model of ``cfg_kw`` (:data:`QWEN3_06B` or :data:`TOY`) on ``dev``: bf16 on CUDA, fp32 on the CPU."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dev = torch.device(dev)
    cfg = Qwen3Config(**cfg_kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return model.eval()


def kv_bytes_per_token(cfg: Any, dtype_bytes: int) -> int:
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def weight_bytes(model: Any) -> int:
    """Bytes of every distinct parameter (tied embeddings counted once: the LM head reads them)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def matmul_flops(model: Any, tokens: int) -> float:
    """2 x tokens x the parameters every token multiplies (all but the embedding gather; LM head once for
    the last token only, as an engine's prefill keeps one logit row)."""
    cfg = model.config
    embed = cfg.vocab_size * cfg.hidden_size
    body = sum(p.numel() for p in model.parameters()) - embed
    return 2.0 * (tokens * body + embed)


def transformers_version() -> str:
    import transformers

    return str(transformers.__version__)
