"""Triton kernels (``@triton.jit`` only) for plan, verify and stamp; launchers live in ``ops/launchers.py``.

Modules mirror the reference: :mod:`.plan`, :mod:`.verify`, :mod:`.stamp`; shared device helpers sit in
:mod:`.hashing` (the link), :mod:`.indexing` (bounds-checked index resolution) and :mod:`.log` (the
deterministic violation log).  Importing this package imports triton.
"""
