"""The "where the time goes" section of benchmarks/README.md: the canary's graph node by node
(``canary_graph_profile.py``) and the kernels under ncu (``scripts/gpu/check_kernels.sh ncudeep``), rendered
from the stored results, with the reading of them that the kernel goals' closing notes rely on."""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent

GRAPH_INTRO = (
    "`canary_graph_profile.py` replays the canary's before/after graph of `bench_e2e.py`'s points (the same "
    "tables) under torch's profiler: each node's device time, their sum and the replay's wall time between two "
    "CUDA events (the pump's device-to-host copy runs after the replay, outside the wall time). The wall time "
    "less the graph's nodes is launch and the gaps between dependent nodes: about 2.4 us a node at 1cc2958, "
    "which is why the step's close became one launch (`ops/kernels/step_close.py`) at 35926c9."
)
NCU_INTRO = (
    "ncu on one eager step per goal scenario (caches cold, clocks left alone; `results/*-ncu-deep.txt` has every "
    "section). `occupancy` = theoretical / achieved; `memory stalls` = the share of a warp's cycles between two "
    "issued instructions spent waiting on an L1TEX (global memory) result."
)
READING = """Reading (issue 18's kernel goals):

- The table at 0ff92b3 (an H100), goal by goal, with ncu on nine scenarios (`results/*-0ff92b3-ncu-deep.txt`):
  - Decode at batch 1 (10.7-11.4 us, goal 5): plan + verify alone replay in 5.43 us, over the goal before the
    stamp, whose chain must start after every verify program (the same-step checks need every read mark) and
    adds 5.5 us.  A third single-launch design, the fused launch's last program stamping a step of up to 128
    tokens (branch `stamp-tail`, c9dddb7, not merged), took 16.96 us against 10.97 in two launches: under ncu
    that program runs about 36.8k cycles against 11.1k for the verify alone and 8.3k for the stamp's own
    launch, its four warps walking the stamp's checks after the verify's finalize
    (`results/nvidia-h100-80gb-hbm3-c9dddb7-stamp-tail.txt`).
  - Decode 32 x 4k (15.0 us, goal 6) keeps three launches (the plan fuses up to 8 rows only; fused beyond,
    32 x 16k measured 33.9 against 26.4 us): plan, verify and stamp take 5.8, 9.3 and 8.1 us cold, each a
    chain of dependent round trips on 1, 288 and 33 programs at 13 % of DRAM bandwidth at most.
  - The 16k prefill chunk (14.0 us, goal 5): no entries to verify, but its stamp scans 16k tokens with the
    decoupled look-back on 33 programs after the verify launch that marks the writes (12.6 and 6.5 us cold).
  - At least 1M entries (2.08x at 256 x 16k, 3.22x at 256 x 4k, 3.49x at 128 x 16k; goal 2x): at 256 x 16k
    the verify moves 157.6 MB against the floor's 151.0 MB (the floor counts what it moves; 1.81M L2
    reduction sectors are the read marks' atomic max) at 53 % of DRAM peak.  At 256 x 4k plan and stamp take
    more than a third of the step (7.2 + 9.3 of 43.4 us cold).  At 128 x 16k the verify compiles to 149
    registers (128 at batch 32 and 256), so 3 of its 128-thread blocks fit an SM where the grid launches 4 an SM
    (528 = 132 x 4): a second, partial wave, 15 % achieved occupancy against 24 % and 29 % of DRAM peak against
    52 %; that is why 2M entries take 88 us where 4M take 105.  Capping the unfused verify at 65,536 / (4 x 128)
    = 128 registers (branch `regcap`, ac10909, not merged: its compiled suites wait for device time) took 128 x
    16k from 86.8 to 58.2 us and 128 x 4k from 35.0 to 27.0 on an H200, but 256 x 16k from 97.7 to 101.6, 256 x
    4k from 38.9 to 40.0 and the window (153 registers) from 83.1 to 84.6
    (`results/nvidia-h200-ac10909-register-cap.txt`): the cap belongs only where it restores a wave and the
    kernel does not lose by it.  Even at 256 x 16k's rate per entry, with plan and stamp fixed, 2M entries take
    at least 2.1x their floor.
  - The 4k window (14.9x, goal 4x): the random lookup makes the verify move 128.1 MB for 524k entries (244
    bytes an entry) against the 21.0 MB the floor counts: at the measured copy bandwidth those bytes alone take
    42.8 us, 6.1x the floor, so no kernel over records kept as separate token, position, link and read-mark
    arrays reaches 4x here.  Records that keep all four in one 32-byte sector would; that layout change reaches
    every kernel, the reference, the digest and the adapters' record views.
  - The graph: counting the before-forward phase mark in the first launch (0ff92b3) took the batch-1 replay
    from 31.5 to 24.5 us (4 nodes to 3) and bench_e2e's canary time at batch 1 x 512 from 40.7 to 25.7 us.

- Small steps (decode at batch 1 and 32, a 16k prefill chunk) are chains of dependent steps on one or two SMs:
  verify and stamp run on grids of 2 to 33 programs, one warp group each, at 0.2-2 % of DRAM bandwidth; each
  warp issues an instruction every 9-13 cycles and 34-45 % of those cycles wait on memory (table entry, then the
  record and its predecessor's link, then the marks and the finalize's atomics).  The floor (one replayed kernel,
  0.8 us) assumes no such chain.  Fusing plan, verify and stamp into one launch with a barrier between verify and
  stamp (d14ae1e) did not shorten it: 11.54 us against 10.89 in two launches at batch 1, 13.75 against 13.58 for
  the prefill chunk (`results/nvidia-h200-d14ae1e-single-launch.txt`), so it was reverted.  Nor did the same
  launch on one program, which waits for no other (`results/nvidia-h100-80gb-hbm3-3dc855c-one-program-step.txt`,
  an H100): 13.3 us at batch 1 against 11.8 on a wave and 11.2 in two launches, since plan, verify and stamp then
  run one after another; plan + verify alone take 5.9 us and stamp about 5.3, whatever the launches.  Each phase's
  own chain is the cost, not the launches or the barrier between them.  The chain in numbers (H200): a replayed
  kernel costs 0.83 us and a dependent round trip 0.17 us in L2, 0.34 in DRAM (`results/*-fedbc4d-latency.json`);
  the batch-1 verify ran 17,017 cycles at 1.98 GHz with about 8,100 instructions over its 8 warps (ncu: 244
  branches at 3 %), each warp issuing one every 9.9 cycles, so the critical warp issues about 1,000-1,700
  instructions, most of them one entry's checks (index arithmetic in int64, eight reserved-slot compares,
  the predecessor's resolution, the link recomputed through two 64-bit multiply chains), at a cycles-per-
  instruction that four resident warps cannot hide.  The stamp's phase is the same length for one token.  Two
  such phases in series (the same-step checks need every read mark before any write) in 5 us or less leave each
  1.7 us beyond its launch: about 330 instructions on the critical warp at today's issue rate, a third to a fifth
  of the checks' path today.  These tables hold slots; with a block table the kernels also page each position.
  Until 19a90c9 they paged in int64, a call of about 80 sm_90 SASS instructions a lane for the quotient and
  another for the remainder (22 such calls in the fused verify); in unsigned 32 bits, with one reserved-slot
  compare ahead of a uniform branch, 16-slot block tables take 11.6 / 14.6 / 131 / 14.4 / 105 us (b1, b32 x 4k,
  256 x 16k, prefill, window) against 14.6 / 18.3 / 189 / 16.2 / 110 before, and token tables 10.9 / 14.4 / 105 /
  13.9 / 104 (`results/nvidia-h100-80gb-hbm3-19a90c9-paging-compare.txt`, one H100 call).  What would help
  further: fewer dependent round trips per launch (stamp's loads issued before the verify's marks are needed; one
  finalize for both phases) and fewer instructions per warp (the int64 index arithmetic left).
- Large steps (>= 1M entries, the 4k window): the verify is 77-85 % of the step.  It runs 528 programs at 25 %
  occupancy, capped by registers (128 a thread, 4 blocks an SM), reaches 39-44 % of DRAM bandwidth, and 54 %
  (contiguous 64-slot runs) to 76 % (the window's random lookup) of its stall cycles wait on memory: it is
  latency-bound, not bandwidth-bound, so the floor (bytes / copy bandwidth) is 4.7-26x away.  Part of that was
  the floor's count: the verify also reads and writes back each entry's 8-byte read mark (an atomic max, for the
  same-step checks), which the bytes left out until a6c3e29 (ncu: about 155 MB moved at 256 x 16k against 84 MB
  counted); counted, the 1cc2958 times sit at 4.7x (128 x 16k), 4.1x (256 x 4k), 2.6x (256 x 16k) and 15.8x (the
  window).  ncu estimates up to 75 % from occupancy; the sweeps of tile, warps and programs per SM
  (`results/*-kernel-sweep.txt`) found the current point best.  A register cap (`KernelTuning.verify_maxnreg`,
  `results/nvidia-h100-80gb-hbm3-e7ec2c2-kernel-sweep.txt`, an H100) bought little: 64 registers and 8 programs
  an SM took 256 x 16k from 105.9 to 99.6 us (6 %), 96 and 5 the window from 84.2 to 78.5 us (7 %), and both
  cost 1-1.4 us at batch 1; doubling the resident programs moved the time by 6 %, so more loads in flight is
  not what the large steps lack.  The same sweep's small-step gains are a microsecond at most: verify items of
  128 entries took batch 1 from 10.9 to 10.0 us (and 256 x 16k from 106 to 143), stamp items of 256 tokens on 4
  warps a 16k prefill from 14.2 to 13.6.  Untried: software-pipelining the next item's table loads under the
  current item's record loads, and timing the verify without its read-mark atomics (4M at 256 x 16k) to size
  their share.
- The window scenario gathers records through a random permutation: every entry is its own 32-byte sector for
  tokens, positions and links, so 72 % of the sectors it moves are excess (ncu; 16 % at 256 x 16k), L2 runs at
  62 % and its cycles per instruction are 37 against 11.  The floor counts the bytes the entries need, not the
  sectors a random gather moves, so no tuning reaches 4x of it; a lookup laid out in runs (as engines' window
  pools are) would.
- The graph's nodes: at batch 1 and for the prefill chunk the close kernel took the replay from 36.4 to 29.4 us
  and 37.4 to 30.5 us (4 nodes instead of 7); at 32 x 4k the wall did not move (41.8 and 41.7 us) although the
  nodes' work fell by 2.2 us.  One profile each; not yet understood.
- The graph's nodes on an H100 at 5a85e33 (32-bit paging): batch 1 took 31.5 us, of which the four nodes' work
  15.2 (verify 6.4, stamp 5.8, the close 1.9, the before-forward phase mark's add on one word 1.1) and launch and
  gaps 16.3; 32 x 4k 40.5 us over five nodes (its nine-plus rows do not fuse the plan: 3.3 us more work and one
  more gap).  Past the two kernels a step needs, each node costs its work and 2-3 us of gap: the phase mark could
  ride in the first group's plan or verify launch, and the close in the last group's stamp where no digest
  follows it, two nodes at batch 1 (about 6-8 us less, judged from the 7 -> 4 node change above; untried)."""


def _graph_rows(path: Path) -> list[tuple[str, float, float, int]]:
    """(point, wall median, the graph's nodes' device time, node count) of one canary-graph file; the pump's
    device-to-host copy, which runs after the replay, is left out."""
    rows: list[tuple[str, float, float, int]] = []
    for block in path.read_text().split("## ")[1:]:
        head = re.match(r"(\w+): \d+ replays, wall median ([\d.]+) us", block)
        if head is None:
            continue
        nodes = [(float(t), int(n)) for t, n, name in re.findall(r"([\d.]+) us/replay  x(\d+)  (.+)", block)
                 if "Memcpy DtoH" not in name]  # fmt: skip
        rows.append((head.group(1), float(head.group(2)), sum(t for t, _ in nodes), sum(n for _, n in nodes)))
    return rows


def _field(block: str, pattern: str) -> str:
    m = re.search(pattern, block)
    return m.group(1) if m else "-"


def _ncu_rows(path: Path) -> list[str]:
    """One table row per profiled kernel; each scenario's launches end with its stamp."""
    text = path.read_text()
    names = iter(re.findall(r"^(\w+): 1 eager steps", text, re.M))
    name = next(names, "?")
    out = []
    patterns = {
        "grid": r"\(([0-9]+), 1, 1\)x",
        "us": r"Duration\s+us\s+([\d.,]+)",
        "regs": r"Registers Per Thread\s+register/thread\s+(\d+)",
        "theory": r"Theoretical Occupancy\s+%\s+([\d.]+)",
        "achieved": r"Achieved Occupancy\s+%\s+([\d.]+)",
        "dram": r"DRAM Throughput\s+%\s+([\d.]+)",
        "cpi": r"Warp Cycles Per Issued Instruction\s+cycle\s+([\d.]+)",
    }
    for b in re.split(r"\n  (?=(?:verify|stamp|plan)_kernel \()", text)[1:]:
        kernel = b.split()[0]
        f = {k: _field(b, pat) for k, pat in patterns.items()}
        stall = re.findall(r"This stall type represents about ([\d.]+)% of the total", " ".join(b.split()))
        out.append(
            f"| {name} | {kernel} | {f['grid']} | {f['us']} | {f['regs']} | {f['theory']} / {f['achieved']} "
            f"| {f['dram']} | {f['cpi']} | {stall[0] if stall else '-'} |"
        )
        if kernel == "stamp_kernel":
            name = next(names, "?")
    return out


def _header(path: Path, pattern: str) -> str:
    """A field of the file's first line (where the profiles keep their run's meta), or ""."""
    with path.open() as f:
        m = re.search(pattern, f.readline())
    return m.group(1) if m else ""


def _dated(path: Path) -> str:
    """The run's date (ISO, so it sorts), for an order a fresh clone keeps too."""
    return _header(path, r"(\d{4}-\d\d-\d\dT[\d:]+)")


def profile_section() -> list[str]:
    graphs = sorted(HERE.glob("results/*-canary-graph.txt"), key=_dated)
    ncu = sorted(HERE.glob("results/*-ncu-deep.txt"), key=_dated)
    if not graphs and not ncu:
        return []
    lines = ["", "## Where the time goes", ""]
    if graphs:
        lines += ["### The canary's graph, node by node (`canary_graph_profile.py`)", "", GRAPH_INTRO, ""]
        lines += ["| point | commit | wall us | nodes' device time us | nodes | launch and gaps us | source |"]
        lines.append("|---|---|---:|---:|---:|---:|---|")
        for path in graphs:
            commit = _header(path, r"'commit': '(\w+)'")
            for point, wall, work, nodes in _graph_rows(path):
                lines.append(
                    f"| {point} | {commit} | {wall:.1f} | {work:.1f} | {nodes} | {wall - work:.1f} "
                    f"| `{path.relative_to(HERE)}` |"
                )
    if ncu:
        path = ncu[-1]
        lines += ["", f"### The kernels under ncu (`{path.relative_to(HERE)}`)", "", NCU_INTRO, ""]
        lines.append("| scenario | kernel | grid | us | registers | occupancy % | DRAM % | cycles / instruction "
                     "| memory stalls % |")  # fmt: skip
        lines.append("|---|---|---:|---:|---:|---|---:|---:|---:|")
        lines += _ncu_rows(path)
    return [*lines, "", READING]
