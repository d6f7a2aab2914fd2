"""A fixed-shape decode workload for CUDA-graph runs of the runtime (shared by the GPU scripts).

``n_req`` requests sit in table rows 1..n_req.  Step 0 prefills ``prompt`` tokens each (eager, its
own shapes); every later step decodes one token per request into static device buffers refilled in
place, so one captured graph serves every decode step.  The batch-row order rotates each step, so a
request id can only be right if the runtime keeps each step's own ids.

Two groups read the same requests: ``full`` (a token table, page size 1) and ``paged`` (a block
table, page size 16, its own pool).  Tokens are a function of (request, position) and the ground
truth is handed in, so token checks are active too.
"""

from __future__ import annotations

import torch

from kvcanary import CanaryGroup, Capacities, StepBatch

PAGE = 16


def token(req: int, pos: int) -> int:
    return 7919 * req + 31 * pos + 1


class DecodeWorkload:
    def __init__(self, n_req: int, prompt: int, steps: int, device: torch.device | str) -> None:
        self.n_req, self.prompt, self.device = n_req, prompt, torch.device(device)
        width = -(-(prompt + steps + 2) // PAGE) * PAGE
        blocks = width // PAGE
        rows = n_req + 1  # row 0 is the padding row
        self.width = width
        # Slots of request r (row r + 1): a contiguous range per row; slot/block 0 stay reserved.
        pos = torch.arange(width, dtype=torch.int64)
        self.full_table = torch.zeros(rows, width, dtype=torch.int32)
        self.block_table = torch.zeros(rows, blocks, dtype=torch.int32)
        truth = torch.zeros(rows, width, dtype=torch.int32)
        for r in range(n_req):
            self.full_table[r + 1] = (1 + r * width + pos).to(torch.int32)
            self.block_table[r + 1] = (1 + r * blocks + torch.arange(blocks)).to(torch.int32)
            truth[r + 1] = torch.tensor([token(r, int(p)) for p in pos], dtype=torch.int32)
        self.groups = [
            CanaryGroup(num_slots=1 + n_req * width, group_id=0, name="full"),
            CanaryGroup(num_slots=(1 + n_req * blocks) * PAGE, group_id=1, name="paged", page_size=PAGE),
        ]
        self.caps = Capacities(
            max_batch=n_req, max_tokens=n_req * prompt, verify_entries=n_req * width, max_context=width
        )
        dev = self.device
        self.dev_full_table = self.full_table.to(dev)
        self.dev_block_table = self.block_table.to(dev)
        self.dev_truth = truth.to(dev)
        self.lens = [0] * n_req
        # Static decode buffers (one token per request), refilled in place by fill_decode.
        self.static = {
            name: torch.zeros(n_req, dtype=torch.int32, device=dev)
            for name in ("rows", "prefix", "extend", "ids", "pos", "loc_full", "loc_paged", "truth_lens")
        }

    def request_ids(self, order: list[int]) -> list[object]:
        return [f"req-{r}" for r in order]

    def order(self, step: int) -> list[int]:
        return [(b + step) % self.n_req for b in range(self.n_req)]

    def _slots(self, reqs: list[int], positions: list[int]) -> tuple[list[int], list[int]]:
        full = [int(self.full_table[r + 1, p]) for r, p in zip(reqs, positions, strict=True)]
        paged = [
            int(self.block_table[r + 1, p // PAGE]) * PAGE + p % PAGE for r, p in zip(reqs, positions, strict=True)
        ]
        return full, paged

    def _batches(self, t: dict[str, torch.Tensor]) -> dict[str, StepBatch]:
        common = dict(
            rows=t["rows"],
            prefix_lens=t["prefix"],
            extend_lens=t["extend"],
            input_ids=t["ids"],
            positions=t["pos"],
            truth=self.dev_truth,
            truth_lens=t["truth_lens"],
        )
        return {
            "full": StepBatch(table=self.dev_full_table, out_cache_loc=t["loc_full"], **common),
            "paged": StepBatch(table=self.dev_block_table, out_cache_loc=t["loc_paged"], **common),
        }

    def prefill(self) -> tuple[dict[str, StepBatch], list[object]]:
        """Step 0 (eager): every request writes its prompt."""
        reqs = list(range(self.n_req))
        tok_reqs = [r for r in reqs for _ in range(self.prompt)]
        tok_pos = [p for _ in reqs for p in range(self.prompt)]
        full, paged = self._slots(tok_reqs, tok_pos)

        def i32(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int32, device=self.device)

        t = {
            "rows": i32([r + 1 for r in reqs]),
            "prefix": i32([0] * self.n_req),
            "extend": i32([self.prompt] * self.n_req),
            "ids": i32([token(r, p) for r, p in zip(tok_reqs, tok_pos, strict=True)]),
            "pos": i32(tok_pos),
            "loc_full": i32(full),
            "loc_paged": i32(paged),
            "truth_lens": i32([self.prompt] * self.n_req),
        }
        self.lens = [self.prompt] * self.n_req
        return self._batches(t), self.request_ids(reqs)

    def decode_batches(self) -> dict[str, StepBatch]:
        """The static decode batches (what a graph captures)."""
        return self._batches(self.static)

    def fill_decode(self, step: int) -> list[object]:
        """Refill the static buffers in place for decode step ``step``; returns its request ids."""
        order = self.order(step)
        pos = [self.lens[r] for r in order]
        full, paged = self._slots(order, pos)
        host = {
            "rows": [r + 1 for r in order],
            "prefix": pos,
            "extend": [1] * self.n_req,
            "ids": [token(r, p) for r, p in zip(order, pos, strict=True)],
            "pos": pos,
            "loc_full": full,
            "loc_paged": paged,
            "truth_lens": [p + 1 for p in pos],
        }
        for name, values in host.items():
            self.static[name].copy_(torch.tensor(values, dtype=torch.int32))
        for r in order:
            self.lens[r] += 1
        return self.request_ids(order)

    def alias(self, victim: int, owner: int, pos: int) -> None:
        """Engine-side fault: the victim's table entry (both groups) points at the owner's slot/block."""
        self.dev_full_table[victim + 1, pos].fill_(int(self.full_table[owner + 1, pos]))
        self.dev_block_table[victim + 1, pos // PAGE].fill_(int(self.block_table[owner + 1, pos // PAGE]))
