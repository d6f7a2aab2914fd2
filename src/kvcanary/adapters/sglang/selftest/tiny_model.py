"""A tiny random-weight Llama checkpoint directory, built offline, for sglang's own model loader.

sglang loads it like any Hugging Face checkpoint (``config.json`` + safetensors) into its own
``LlamaForCausalLM`` (``sglang.srt.models.llama``).  Weights are seeded, so greedy decoding is
deterministic: the self-test's control and faulted runs take the same path up to the injection.
"""

from __future__ import annotations

import os
import pathlib

VOCAB = 128
CONTEXT = 256


def build_tiny_llama(directory: str | os.PathLike[str], *, seed: int = 0) -> pathlib.Path:
    """Write the checkpoint into ``directory`` (created; reused when already complete)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = pathlib.Path(directory)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=CONTEXT,
        bos_token_id=1,
        eos_token_id=None,  # no end-of-sequence: requests stop at max_new_tokens, deterministically
        dtype="float32",
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out
