"""Build entry for setuptools (the project's metadata is in pyproject.toml).

By default kvcanary installs as pure Python.  With ``KVCANARY_COMPILE=1`` the modules of the transformers adapter's
per-step path (:data:`COMPILED`) are compiled to C extensions with mypyc: the same source, type-checked, with each
call and attribute read a C call instead of interpreted bytecode.  The canary's step runs between two engine steps
with every CPU cache cold, where what it costs follows the instructions it runs and the cache lines it touches:
compiled, a steady translation step runs a quarter to a third fewer of each (cachegrind on the CPU).  On two H100
machines (the GPU demo's three models, compiled and pure interleaved) the canary's own timed work fell by 0.4 to
0.9 points of step time on every model, and its host time per step in four of the six comparisons.  The Python
source stays the spec: the test suite runs on both builds (``scripts/test_compiled.sh``).

    KVCANARY_COMPILE=1 pip install --no-build-isolation .        # needs mypy (the test extra) and a C compiler
    KVCANARY_COMPILE=1 python setup.py build_ext --inplace -j 4  # a checkout: the extensions next to the sources

``KVCANARY_MYPY_FLAGS`` adds flags for mypy, e.g. to build for another Python than the one running the build
(``scripts/gpu/prebuild_compiled.sh``: ``--python-version 3.12 --python-executable <an env with torch>``).
"""

from __future__ import annotations

import os

from setuptools import setup

ADAPTER = "src/kvcanary/adapters/transformers_cb"
RUNTIME = "src/kvcanary/runtime"

# The per-step path: the step tap and what it calls on a steady step (translation, truth, staging, the manager's
# forward and host steps, the outbox pump and the decoder of its copies), and the mirror of the engine's block moves
# with the wrappers that run it.  Left out: byte_moves (a torch function mode) and layout (its group kind's default
# is a None cast to the enum, which compiled code refuses).
COMPILED = [
    *(f"{ADAPTER}/{name}.py" for name in (
        "batch_shapes", "host_batch", "staging", "steady_region", "steady_step", "step_buffers", "step_plan",
        "step_tap", "tap_timer", "translate", "translate_kernel", "translation", "truth_store", "torch_path",
    )),
    *(f"{RUNTIME}/{name}.py" for name in ("capture", "decode", "manager", "pump", "step_graphs", "streams")),
    f"{ADAPTER}/binding.py", f"{ADAPTER}/bulk_moves.py", f"{ADAPTER}/mirror.py", f"{ADAPTER}/move_entries.py",
    f"{ADAPTER}/queued_moves.py",
]  # fmt: skip


def extensions() -> list[object]:
    if os.environ.get("KVCANARY_COMPILE") != "1":
        return []
    from mypyc.build import mypycify

    flags = os.environ.get("KVCANARY_MYPY_FLAGS", "").split()
    return list(mypycify(["--strict", "--ignore-missing-imports", *flags, *COMPILED], opt_level="3"))


setup(ext_modules=extensions())
