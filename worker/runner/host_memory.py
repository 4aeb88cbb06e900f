"""Large CPU tensors: the weights, the KV pool, and a step's activations.

`zeros(shape, dtype)` is an anonymous mapping of its own (`mmap`): the kernel's zero pages, mapped as
they are first written, so a pool of gigabytes costs nothing until used (`torch.zeros`
writes every page first: 2.8 s for the default model's 2 GB pool, all of a standby worker's
activation). It is aligned to 2 MB and, on Linux, advised for transparent huge pages
(`madvise(MADV_HUGEPAGE)`, which the kernel honours where THP is `always` or `madvise`, the
usual default), so its pages are mapped 2 MB at a time as they are first written.

Why huge pages: at a few sequences a decode step's time is the time to stream the weights,
and the hardware prefetcher stops at every 4 KB page; on an Intel host whose cores each read
at ~10 GB/s the few-row matmuls streamed the weights 29% faster from huge pages
(docs/benchmarks.md, "Weights in huge pages"). `LlamaForward` copies the fused weights into
one such tensor, in the order a decode step reads them, at load. The KV pool is not advised:
its pages are first written while requests are served, and with THP's `defrag` at
`madvise` (the usual default) a huge-page fault may compact memory first, a stall in a
request's step; the pool's blocks are read scattered, 2 KB at a time, where huge pages
gave the decode attention nothing on an AMD host (session 23).

Where madvise is refused (another OS, THP `never`), the tensor is the same mapping
in 4 KB pages.

`keep_freed_memory()` is for the other large allocations, a step's activations: made and
freed every step (a 2,048-token prompt step's MLP output alone is 12 MB). glibc's malloc
gives large blocks back to the kernel when they are freed (blocks over its mmap threshold,
and the heap's free top over its trim threshold), and the next step's first writes then
fault them in again, page by page, each zeroed by the kernel: a fifth to a quarter of a prompt step's
time on an Intel host. Raising both thresholds (`mallopt`, as `GLIBC_TUNABLES` would)
keeps the freed memory in the process for the next step, at the cost of holding the
largest step's activations (tens of MB) after it. vLLM's CPU backend gets the same by
preloading tcmalloc; a worker is one long-lived process, so a setting at start does it here
without a preload.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import sys

import torch

log = logging.getLogger("llmfleet.worker")

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def zeros(shape: tuple[int, ...], dtype: torch.dtype, *, huge_pages: bool = True) -> torch.Tensor:
    """A zeroed CPU tensor, 2 MB aligned, its pages advised as huge unless `huge_pages` is
    False (see the module)."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # its own anonymous mapping: always fresh zero pages, never reused heap memory already
    # mapped in 4 KB pages (after `keep_freed_memory` malloc would hand those out)
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # not shared: THP covers private memory
    raw = torch.frombuffer(mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, private), dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    tensor = raw[offset : offset + num_bytes]
    if huge_pages:
        _advise_huge(tensor.data_ptr(), num_bytes)
    return tensor.view(dtype).view(shape)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> None:
    """Keeps freed blocks of up to 32 MB (and up to 1 GB of free heap top) in the process
    instead of giving them back to the kernel (see the module). glibc only; once per
    process is enough, more is harmless."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


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
    if hasattr(libc, "mallopt"):  # glibc's; musl has none
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return libc
