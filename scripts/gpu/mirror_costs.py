"""Where the mirror's host time goes on the GPU demo, piece by piece, without a profiler's inflation.

Runs the demo's clean workload (``kvcanary demo``'s model and prompts) ``--runs`` times with the canary on, each
piece of the transformers adapter's mirror of the engine's block moves wrapped in a clock: the move wrappers whole
(the engine's own move, the observer and the mirror), the observer's set-up, and the mirror's helpers down to the
record stores' copies and the index builds, and what those are made of (the run test, the pinned index build, each
gather and write of a record tensor, the stream switches: the tap's among them).  Prints, per run, the canary's
``mirror_us`` a step, the moves the engine made, and each piece's calls, host time a call and a step.  Pieces nest
(a helper's time is inside its caller's), so the column does not add up.  Run it on the pure-Python tree: the compiled
build's calls between its modules do not go through the module attributes patched here.

Usage: PYTHONPATH=src:scripts/gpu python scripts/gpu/mirror_costs.py [--model hybrid] [--device cuda] [--runs 3]
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import probe_args

from kvcanary import demo, layout
from kvcanary.adapters.transformers_cb import bulk_moves, byte_moves, install, mirror
from kvcanary.config import CanaryConfig, Mode
from kvcanary.runtime import streams

# (label, owner, attribute): the pieces timed, outermost first.
_PIECES: tuple[tuple[str, Any, str], ...] = (
    ("observer set-up", bulk_moves.BulkMoveWrappers, "_observer"),
    ("views' keys", byte_moves.BlockViews, "keys"),
    *((name, bulk_moves, name) for name in ("_save_rows", "_restore_joined", "_restore_rows", "_mirror_copies")),
    ("_digest_moved", bulk_moves, "_digest_moved"),
    *(
        (f"HostRecords.{m}", mirror.HostRecords, m)
        for m in ("save_all", "save_all_rows", "restore", "restore_rows", "restore_joined")
    ),
    ("apply_block_write", mirror, "apply_block_write"),
    ("RecordStore.copy_blocks", layout.RecordStore, "copy_blocks"),
    ("RecordStore.clear_blocks", layout.RecordStore, "clear_blocks"),
    ("RecordRows.copy_blocks", layout.RecordRows, "copy_blocks"),
    *((f"MoveIndex.{m}", mirror.MoveIndex, m) for m in ("blocks", "hosts", "joined")),
    # What an index build and a record copy are made of: the run test, the pinned tensor and its copy, one gather or
    # write of a record tensor (an op each), the switch to the engine's stream and back.
    ("block_run", mirror, "block_run"),
    ("block_index", mirror, "block_index"),
    ("gather of records", layout, "_take"),
    ("write of records", layout, "_put"),
    ("stream switch in (the tap's too)", streams.StreamSwitch, "__enter__"),
    ("stream switch out (the tap's too)", streams.StreamSwitch, "__exit__"),
)
# The move wrappers' factories (install calls them): the wrapper each returns is timed whole.
_MOVES = ("copy_blocks", "cache_copy", "offload", "restore")


@contextlib.contextmanager
def clocks(ns: collections.Counter[str]) -> Iterator[None]:
    """Every piece and every move wrapper timed into ``ns`` while inside; the originals put back after."""
    with probe_args.clocks(ns, _PIECES) as patches:
        for name in _MOVES:

            def timed_factory(factory: Callable[..., Any], name: str = name) -> Callable[..., Any]:
                return lambda self, original: probe_args.timed(factory(self, original), f"move wrapper {name}", ns)

            patches.wrap(bulk_moves.BulkMoveWrappers, name, timed_factory)
        yield


def one_run(model: Any, prompts: list[list[int]], opts: demo.DemoOptions, run: int) -> None:
    ns: collections.Counter[str] = collections.Counter()
    with clocks(ns), install(model, CanaryConfig(mode=Mode.LOG)) as canary:
        demo.generate_waves(model, prompts, opts)
        canary.flush()
    stats, features = canary.stats(), canary.features()
    steps = max(int(stats["steps"]), 1)
    moves = {k: features.get(k, 0) for k in ("fork_block_copies", "offloads", "restores")}
    print(f"run {run}: {steps} steps, mirror {stats['mirror_us'] / steps:.1f} us a step; moves {moves}")
    labels = [k for k in ns if not k.endswith("_calls")]
    for label in sorted(labels, key=lambda k: -ns[k]):
        calls, us = ns[label + "_calls"], ns[label] / 1e3
        print(f"  {label:34} calls {calls:5}  us a call {us / calls:8.2f}  us a step {us / steps:7.2f}")


def main() -> None:
    p = probe_args.demo_parser(__doc__.splitlines()[0], default_model="hybrid")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    opts = probe_args.options_of(args)
    model, prompts = demo.workload(opts)
    print(f"model {args.model}, device {args.device}; the first run warms up (kernels, allocator, the canary's set-up)")
    with demo.quiet_engine_logs():
        for run in range(args.runs):
            one_run(model, prompts, opts, run)


if __name__ == "__main__":
    main()
