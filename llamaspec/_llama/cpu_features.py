"""CPU features that the CPU advertises but this process may not be able to use.

ggml compiled with ``-march=native`` on a CPU with AMX (Intel Sapphire Rapids and later) multiplies quantized
weights with AMX tiles, from its "extra" weight buffers. In some virtual machines and sandboxes the CPU
advertises AMX, the kernel grants the tile permission, and yet ggml's AMX kernels fault: the process dies with
SIGILL on the first decode of a quantized model (seen here: ``tilezero`` in ``ggml_backend_amx_mul_mat``).
Where the CPU advertises AMX, models therefore load without the extra buffer types (llama.cpp's
``--no-repack``): the plain AVX-512 kernels, the same results, no crash. ``LLAMASPEC_REPACK=1`` keeps
llama.cpp's default (repacked weights and AMX) on a machine where AMX works.
"""
from __future__ import annotations

import functools
import logging
import os
import sys

__all__ = ["amx_advertised", "use_extra_buffers"]

log = logging.getLogger("llamaspec")


def amx_advertised() -> bool:
    """Whether ``/proc/cpuinfo`` lists the AMX tile feature (Linux x86-64 only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


@functools.lru_cache(maxsize=1)
def use_extra_buffers() -> bool:
    """Whether models load with llama.cpp's extra weight buffers (repacking, AMX): module docstring."""
    if os.environ.get("LLAMASPEC_REPACK", "") not in ("", "0"):
        return True
    if amx_advertised():
        log.info("the CPU advertises AMX: models load without weight repacking (llama.cpp's --no-repack), "
                 "because ggml's AMX kernels crash where AMX is advertised but not usable; "
                 "LLAMASPEC_REPACK=1 keeps repacking")
        return False
    return True
