"""The process's C heap told to keep the memory it frees, so a model step reuses it instead of faulting it in again.

glibc's malloc serves each block above a threshold (128 KiB at first, moving with what is freed) with its own
``mmap`` and hands it back on ``free``; a step's activations (a 2,048-token prefill of a 256-wide model makes
tensors of 1-4 MiB dozens of times a step) then come back as fresh pages, and every page costs a fault, dearer
in a VM. `keep_freed_memory` raises the ``mmap`` threshold and the trim threshold and pads each heap growth, as
vLLM's CPU images get by loading another allocator (tcmalloc). On a 2-core Xeon with AMX a bfloat16 prefill step
of 2,048 tokens (256-wide 8-layer folder) took ~97 ms instead of ~118 with ``F.linear``, ~95 instead of ~102 with
packed weights (three alternating runs each; on a first-generation AMD EPYC an earlier trial found no consistent
difference). A process that calls it keeps up to ``TRIM_BYTES`` of freed memory at its heap's top instead of
returning it. Where the C library is not glibc (no ``mallopt``), nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks below this come from the heap (glibc's largest allowed value on 64-bit)."""
TRIM_BYTES = 256 << 20
"""Freed memory at the heap's top kept, not returned to the kernel."""
TOP_PAD_BYTES = 64 << 20
"""Extra bytes each growth of the heap asks for."""

_done = False


def keep_freed_memory() -> bool:
    """Set the thresholds once per process; True when glibc took all three (also on a repeated call)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        log.info("C heap: left as it is (no glibc mallopt)")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_BYTES), (M_TOP_PAD, TOP_PAD_BYTES))
    _done = all(mallopt(param, value) == 1 for param, value in settings)
    log.info("C heap: freed memory kept for reuse" if _done else "C heap: mallopt refused a setting")
    return _done
