"""Large CPU tensors for what the decode streams: the weights and the KV pool.

`zeros(shape, dtype)` comes from calloc (numpy's zeros): the kernel's zero pages, mapped as
they are first written, so a pool of gigabytes costs nothing until used (`torch.zeros`
writes every page first: 2.8 s for the default model's 2 GB pool, all of a standby worker's
activation). It is aligned to 2 MB and, on Linux, advised for transparent huge pages
(`madvise(MADV_HUGEPAGE)`, which the kernel honours where THP is `always` or `madvise`, the
usual default), so its pages are mapped 2 MB at a time as they are first written.

Why huge pages: at a few sequences a decode step's time is the time to stream the weights,
and the hardware prefetcher stops at every 4 KB page; on an Intel host whose cores each read
at ~10 GB/s the few-row matmuls streamed the weights 29% faster from huge pages
(docs/benchmarks.md, "Weights in huge pages"). `LlamaForward` copies the fused weights into
one such tensor, in the order a decode step reads them.

Where madvise is refused (another OS, THP `never`), the tensor is the same calloc'd memory
in 4 KB pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import sys

import numpy
import torch

log = logging.getLogger("llmfleet.worker")

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor, 2 MB aligned, its pages advised as huge (see the module)."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(numpy.zeros(num_bytes + HUGE_PAGE_BYTES, dtype=numpy.uint8))
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    tensor = raw[offset : offset + num_bytes]
    _advise_huge(tensor.data_ptr(), num_bytes)
    return tensor.view(dtype).view(shape)


def _advise_huge(address: int, num_bytes: int) -> None:
    libc = _libc()
    if libc is None or num_bytes < HUGE_PAGE_BYTES:
        return
    length = num_bytes - num_bytes % HUGE_PAGE_BYTES  # whole huge pages only
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused (errno %d): 4 KB pages", ctypes.get_errno())


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc
