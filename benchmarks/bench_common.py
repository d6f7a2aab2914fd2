"""What every benchmark here shares: CUDA-graph timing, the device's copy bandwidth and one replayed
kernel (the floors' two terms), and the results files (``<gpu>-<commit><suffix>`` under
``benchmarks/results``, ``{"meta", "records"}`` JSON whose meta names the GPU, driver, torch, triton and
commit)."""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

RESULTS = Path(__file__).resolve().parent / "results"


def time_graph(record_steps, steps: int, replays: int) -> list[float]:
    """Per-step microseconds of each replay of a graph holding ``steps`` steps."""
    if not torch.cuda.is_available():  # --dry-run: no graph, wall clock
        out = []
        for _ in range(max(2, replays // 10)):
            t0 = time.perf_counter()
            record_steps()
            out.append((time.perf_counter() - t0) * 1e6 / steps)
        return out
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        record_steps()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    out = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1000.0 / steps)
    return out


@triton.jit
def _empty_kernel(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr))


def graph_kernel_us(dev: torch.device) -> float:
    """Median time of one trivial kernel inside a graph of many."""
    if dev.type != "cuda":
        return 1.0
    x = torch.zeros(1, device=dev)
    n = 64

    def record() -> None:
        for _ in range(n):
            _empty_kernel[(1,)](x)

    _empty_kernel[(1,)](x)
    return statistics.median(time_graph(record, n, 50))


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes read + written per second of a large device-to-device copy."""
    if dev.type != "cuda":
        return 1e10
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    del src, dst
    return 2 * n / statistics.median(times)


def bf16_matmul_rate(dev: torch.device) -> float:
    """FLOP/s of a large bf16 matrix product on random data."""
    if dev.type != "cuda":
        return 1e11
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(10):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1000.0)
    return 2 * n**3 / statistics.median(ts)


def result_path(out_dir: str | None, gpu: str, commit: str, suffix: str = ".json") -> Path:
    """Where a run's results go: ``<out_dir or benchmarks/results>/<gpu>-<commit><suffix>`` (folder made)."""
    path = Path(out_dir or RESULTS) / f"{gpu.replace(' ', '-').lower()}-{commit}{suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def save_result(out_dir: str | None, gpu: str, commit: str, suffix: str, text: str) -> Path:
    """Write one run's results (a table, or ``{"meta", "records"}`` JSON) under :func:`result_path`."""
    path = result_path(out_dir, gpu, commit, suffix)
    path.write_text(text)
    print(f"wrote {path}")
    return path


def save_records(out_dir: str | None, m: dict, commit: str, suffix: str, records: list) -> Path:
    """Write ``{"meta", "records"}`` JSON (the format every results file shares) under :func:`result_path`."""
    return save_result(out_dir, m["gpu"], commit, suffix, json.dumps({"meta": m, "records": records}, indent=1) + "\n")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def meta(commit: str, dev: torch.device) -> dict[str, str]:
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if dev.type != "cuda":
        base = {"gpu": "cpu-dry-run", "driver": "-"}
        return base | {"torch": torch.__version__, "triton": triton.__version__, "commit": commit, "date": date}
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        driver = "unknown"
    return {
        "gpu": torch.cuda.get_device_name(dev),
        "driver": driver,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
        "date": date,
    }
