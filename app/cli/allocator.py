"""Keep glibc's malloc from holding on to the memory of large bodies once they are freed.

glibc serves an allocation of 128 KiB or more with its own `mmap`, and gives it back to the
system when it is freed. But each such free also raises that threshold to the freed size (up
to 32 MiB): after one 12 MB body, every allocation below 12 MB comes from the heap, which only
returns memory from its top. A proxy that sees a few multi-megabyte bodies then keeps tens of
megabytes of heap pinned by a few small objects allocated after them. Measured with `python
-m load soak --minutes 20` (its 12-17 MB bodies every 2 s among the small ones): the proxy's
RSS moved between 193 and 245 MiB with the threshold moving, and between 174 and 213 MiB with
it fixed at 128 KiB (`MALLOC_MMAP_THRESHOLD_=131072`, what `fix_mmap_threshold`
sets from inside). The data path's own allocations (64 KiB reads, small JSON) stay below it,
so the requests of normal size make no more system calls than before.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's default starting threshold
_ENVIRONMENT_OVERRIDE = "MALLOC_MMAP_THRESHOLD_"


def fix_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at 128 KiB; False where there is no glibc (musl, macOS)
    or the operator set `MALLOC_MMAP_THRESHOLD_` themselves."""
    if _ENVIRONMENT_OVERRIDE in os.environ:
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc's own symbol: not musl's mallopt
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
