"""sglang adapter: the seed's ``--kv-canary`` install flow on sglang's KV pools.

Validated against sglang 0.5.23's real pools, allocators, radix cache and torch-native attention
backend (``tests/engines/sglang``, run by ``scripts/ci-sglang.sh``).  Importing this package imports
no sglang module; everything works on duck-typed sglang objects.

Usage inside sglang's ``ModelRunner.initialize`` (after ``init_memory_pool``, before graph capture)::

    from kvcanary.adapters.sglang import install_canary
    self.kv_canary = install_canary(self)          # None when --kv-canary none
    ...                                            # warm-up, CUDA-graph capture
    if self.kv_canary is not None:
        self.kv_canary.mark_init_finished()
"""

from kvcanary.adapters.sglang.host_pool import SUPPORTED_HOST_POOLS, HostRecordMirror, attach_host_pool
from kvcanary.adapters.sglang.install import SglangCanary, install_canary
from kvcanary.adapters.sglang.options import SglangCanaryOptions, add_cli_args, options_from_args
from kvcanary.adapters.sglang.pools import SUPPORTED_POOLS
from kvcanary.adapters.sglang.translate import SUPPORTED_MODES
from kvcanary.adapters.sglang.version import SUPPORTED_SGLANG_VERSIONS

install = install_canary

__all__ = [
    "SUPPORTED_HOST_POOLS",
    "SUPPORTED_MODES",
    "SUPPORTED_POOLS",
    "SUPPORTED_SGLANG_VERSIONS",
    "HostRecordMirror",
    "SglangCanary",
    "SglangCanaryOptions",
    "add_cli_args",
    "attach_host_pool",
    "install",
    "install_canary",
    "options_from_args",
]
