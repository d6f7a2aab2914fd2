"""A tiny random-weight Llama built offline and a real in-process vLLM engine on it (tests, self-test).

The model (2 layers, head_dim 64, one KV head, vocabulary 512) is written with ``save_pretrained`` plus a
word-level tokenizer: no hub access.  The engine runs vLLM's V1 engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the canary, the faults and the test see the same objects.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

VOCAB = 512
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def build_model(path: str | os.PathLike[str], seed: int = 0) -> pathlib.Path:
    """Write the tiny Llama (config, random weights, tokenizer) to ``path`` once; returns it."""
    out = pathlib.Path(path)
    if (out / "config.json").exists():
        return out
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger logits than the default init: greedy tokens vary with the context
        model.lm_head.weight.mul_(50.0)
    model.save_pretrained(out)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")  # type: ignore[no-untyped-call]
    fast.save_pretrained(out)
    return out


def engine_kwargs(**overrides: Any) -> dict[str, Any]:
    """``LLM(...)`` arguments of the test engine: prefix caching on, small batches, a small block budget."""
    kw: dict[str, Any] = dict(
        dtype="float32", block_size=32, enforce_eager=True, enable_prefix_caching=True, skip_tokenizer_init=True,
        max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, enable_chunked_prefill=True,
        num_gpu_blocks_override=24, seed=0,
    )  # fmt: skip
    kw.update(overrides)
    return kw


def start_engine(model_dir: str | os.PathLike[str], **overrides: Any) -> Any:
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    from vllm import LLM

    return LLM(model=str(model_dir), **engine_kwargs(**overrides))
