"""Issue 14's workload: a Qwen3-0.6B-shaped model through transformers' ``generate_batch`` with the canary.

Random bf16 weights (hidden 1024, intermediate 3072, 28 layers, 16 heads, 8 KV heads, head dim 128, vocab
151936, ``sdpa``); ``ContinuousBatchingConfig(page_size=16, num_blocks=4096, max_batch_tokens=2048,
max_requests_per_batch=64)``, asynchronous batching on; 1 and 32 prompts of 512 random tokens, 64 greedy
new tokens; CUDA graphs on and off; canary in ``log`` mode.

Acceptance per run: zero health failures, zero violations, zero adapter errors, and the canary's verified
slots equal to what attention read: the sum of every verified step's past lengths, taken from the
scheduler's own view of each batch (warm-up batches excluded, they are never verified).  The kvcanary log
lines of each run are kept.  Writes ``<out>/cb_qwen3.json`` (every finished run, rewritten after each) and
prints one line per run; exit 1 if a run fails its acceptance.

Usage: PYTHONPATH=src python scripts/gpu/cb_qwen3_workload.py [--out DIR] [--runs b1_graphs,...] [--toy]
(``--toy``: a 2-layer model on the CPU, 2 new tokens, graphs off: checks the script only)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers.generation.continuous_batching import input_outputs

from kvcanary.adapters.transformers_cb import install
from kvcanary.adapters.transformers_cb.host_batch import WARMUP_PREFIX
from kvcanary.config import CanaryConfig, Mode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the model benchmarks share
from host_profile import print_profile, profiled, tap_probe

from qwen3_model import QWEN3_06B, TOY, build_model, transformers_version

RUNS = {  # name: (prompts, CUDA graphs)
    "b1_graphs": (1, True),
    "b32_graphs": (32, True),
    "b1_eager": (1, False),
    "b32_eager": (32, False),
}


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class ReadCount:
    """Sums the past lengths of every batch the scheduler prepares (what attention reads), read from the engine's
    own request states by wrapping its ``prepare_batch_tensors`` (entered after the canary is installed, so around
    the canary's wrapper; both read before the engine advances the states).  Nothing of the adapter is used: on
    the compiled build its batch capture cannot be wrapped."""

    def __init__(self) -> None:
        self.read = 0
        self.batches = 0
        self._owner: Any = input_outputs.ContinuousBatchingIOs
        self._original = self._owner.prepare_batch_tensors

    def __enter__(self) -> ReadCount:
        original = self._original

        def prepare_batch_tensors(io: Any, requests_in_batch: Any, *args: Any, **kwargs: Any) -> Any:
            states = [fs.state for fs in requests_in_batch]
            if states and not str(states[0].request_id).startswith(WARMUP_PREFIX):
                self.read += sum(s.position_offset for s in states)
                self.batches += 1
            return original(io, requests_in_batch, *args, **kwargs)

        self._owner.prepare_batch_tensors = prepare_batch_tensors
        return self

    def __exit__(self, *exc: object) -> None:
        self._owner.prepare_batch_tensors = self._original


def run_one(model: Any, prompts: int, graphs: bool, toy: bool) -> dict[str, Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=2 if toy else 64, do_sample=False, eos_token_id=-1)  # type: ignore[no-untyped-call]
    cb = ContinuousBatchingConfig(
        page_size=16, num_blocks=4096, max_batch_tokens=2048, max_requests_per_batch=64,
        use_cuda_graph=graphs, use_async_batching=not toy,
    )  # fmt: skip
    g = torch.Generator().manual_seed(prompts)
    vocab = model.config.vocab_size
    inputs = [torch.randint(1, vocab, (512,), generator=g).tolist() for _ in range(prompts)]
    collect = Collect()
    log = logging.getLogger("kvcanary")
    log.addHandler(collect)
    canary = install(model, CanaryConfig(mode=Mode.LOG))
    try:
        with ReadCount() as reads:
            start = time.perf_counter()
            out = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb)
            seconds = time.perf_counter() - start
        canary.flush()
        stats, features = canary.stats(), canary.features()
    finally:
        canary.uninstall()
        log.removeHandler(collect)
    generated = sum(len(o.generated_tokens) for o in dict(out).values())
    ok = (
        stats["health_failures"] == 0 and stats["violations"] == 0 and stats["adapter_errors"] == 0
        and stats["verified_slots"] == reads.read and generated == prompts * gen.max_new_tokens
    )  # fmt: skip
    return {
        "prompts": prompts, "cuda_graphs": graphs, "async_batching": not toy, "seconds": round(seconds, 2),
        "generated_tokens": generated, "read_by_attention": reads.read, "prepared_batches": reads.batches,
        "stats": stats, "features": features, "log": collect.lines[:40], "passed": ok,
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/cb-qwen3"))
    p.add_argument("--name", default="cb_qwen3", help="the JSON file's name, without .json")
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--toy", action="store_true")
    p.add_argument("--probe", action="store_true", help="record the tap's torch modes and call costs in each run")
    p.add_argument("--profile", default="", help="runs to profile, comma-separated (cProfile in the step tap; printed)")
    args = p.parse_args()
    dev = "cpu" if args.toy else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --toy)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(TOY if args.toy else QWEN3_06B, dev)
    failed = 0
    done: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers_version(), "runs": {}}
    for name in args.runs.split(","):
        prompts, graphs = RUNS[name]
        if args.toy:
            graphs = False
        try:
            with (
                profiled("tap") if name in args.profile.split(",") else contextlib.nullcontext() as prof,
                tap_probe(dev, 2 if args.toy else 20) if args.probe else contextlib.nullcontext() as probe,
            ):
                rec = run_one(model, prompts, graphs, args.toy)
            if probe is not None:
                rec["tap_probe"] = probe
                print(f"{name} tap probe: {probe}", flush=True)
            if prof is not None:
                print_profile(prof, 30)
        except Exception as exc:  # keep going: the other runs still tell something
            rec = {"error": f"{type(exc).__name__}: {exc}", "passed": False}
        done["runs"][name] = rec
        (out / f"{args.name}.json").write_text(json.dumps(done, indent=1) + "\n")
        failed += not rec["passed"]
        s = rec.get("stats", {})
        print(
            f"{name:12} passed={rec['passed']} steps={s.get('steps')} verified={s.get('verified_slots')} "
            f"read={rec.get('read_by_attention')} health_failures={s.get('health_failures')} "
            f"violations={s.get('violations')} adapter_errors={s.get('adapter_errors')} "
            f"tap_median_us={s.get('tap_median_us')} by phase "
            f"{[s.get(f'tap_median_{k}_us') for k in ('capture', 'translate', 'launch', 'host_step')]} "
            f"cpu {s.get('tap_median_cpu_us')} "
            f"{rec.get('error', '')}",
            flush=True,
        )
        for line in rec.get("log", [])[:6]:
            print(f"    {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
