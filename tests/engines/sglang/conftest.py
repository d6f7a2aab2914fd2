"""sglang engine tests: collected only where sglang is importable (the .venv-sglang job).

In the main suite these files are ignored outright (no import of sglang, no skip noise).  Here, the
sglang modules are imported once with their import-time UserWarnings silenced (CUDA-only quantisation
notices), since the project's pytest config turns warnings into errors.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py", "sglang_harness.py"]
else:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in (
            "sglang.srt.layers.attention.torch_native_backend",
            "sglang.srt.mem_cache.radix_cache",
            "sglang.srt.mem_cache.swa_memory_pool",
            "sglang.srt.speculative.eagle_info",
        ):
            importlib.import_module(module)
