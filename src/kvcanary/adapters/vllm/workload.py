"""The seeded request mix the tests and the self-test run on the tiny engine (:mod:`.tiny`).

Requests share a few prompt prefixes of two or more blocks (prefix-cache hits; the first three are admitted
in one step and two of them hit blocks the first writes in that step), a few prompts exceed the step's token
budget (chunked prefill), and the block budget of :func:`~.tiny.engine_kwargs` (24 blocks of 32 tokens for
up to 8 running requests) forces preemption, recompute and the eviction of cached blocks.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from kvcanary.adapters.vllm.tiny import VOCAB


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    def requests(self) -> list[dict[str, Any]]:
        return [{"prompt_token_ids": list(p)} for p in self.prompts]

    def sampling(self) -> list[Any]:
        from vllm import SamplingParams

        return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in self.max_tokens]


def make_workload(seed: int, num_requests: int = 40, num_prefixes: int = 4) -> Workload:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    prefixes = [tokens(rng.choice((64, 70, 96))) for _ in range(num_prefixes)]
    prompts, max_tokens = [], []
    for i in range(num_requests):
        if i < 3:
            prompt = prefixes[0][:64] + tokens(2)  # a burst admitted in one step: same-step prefix hits
        elif i % 10 == 3:
            prompt = tokens(rng.randrange(180, 260))  # longer than the 128-token step budget: chunked
        elif i % 10 == 7:
            prompt = prefixes[i % num_prefixes][:64] + tokens(rng.randrange(1, 4))  # short: admitted together
        else:
            prompt = prefixes[i % num_prefixes] + tokens(rng.randrange(5, 60))
        prompts.append(prompt)
        max_tokens.append(rng.randrange(16, 48))
    return Workload(prompts, max_tokens)


def generate(llm: Any, workload: Workload) -> list[list[int]]:
    """Run the workload to completion; each request's generated token ids, in request order."""
    outs = llm.generate(workload.requests(), workload.sampling(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
