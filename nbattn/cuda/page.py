"""Appending new K/V tokens into a paged cache (docs/concepts/layouts.md; FlashInfer's
``append_paged_kv_cache``), the kernel twin of :mod:`nbattn.reference.page`.

What it computes: token i of ``append_key/append_value [nnz, num_kv_heads,
head_dim]`` belongs to request ``batch_indices[i]`` at logical position
``positions[i]``; it is written to page ``paged_kv_indices[paged_kv_indptr[r] +
pos // page_size]``, slot ``pos % page_size``.  The page and slot of every
token come from :func:`nbattn.layout.check_append`, which also validates
everything before the cache is touched.

Launch shape: one CTA per appended token; its threads stride over the token's
``num_kv_heads * head_dim`` elements.  The kernel copies raw element words
(fp16/bf16 bits or fp32), so no conversion happens and the write is exact.

An fp8 cache (torch ``float8_e4m3fn`` / ``float8_e5m2``) takes ``k_scale`` /
``v_scale``: the golden model's :func:`nbattn.reference.page.fp8_append_data`
checks the arguments and quantizes the new K/V on the host (``x / scale``
rounded once to the nearest fp8 value, ties to even, finite values saturating:
:func:`nbattn.reference.fp8.quantize`), and the kernel copies the bytes, so the
cache holds exactly what the golden model writes.  K/V that already have the
cache's fp8 dtype are copied as they are.

Caches on the device (torch CUDA, numba, ``__cuda_array_interface__``) are
written in place; a NumPy or CPU torch cache is copied to the device, written,
and copied back into the caller's array, so the call has the golden model's
effect whatever the input kind.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from .. import layout as L
from ..reference.fp8 import fp8_kind, kv_scales
from ..reference.page import fp8_append_data
from .host import arrays as A
from .blocks.fp8 import FP8_CODES
from .blocks.primitives import SIMULATOR

__all__ = ["append_paged_kv_cache"]

THREADS = 32 if SIMULATOR else 128


def _append_kernel(nhd: bool):
    @cuda.jit
    def append(src_k, src_v, page, slot, cache):
        i = cuda.blockIdx.x
        p = page[i]
        s = slot[i]
        heads = src_k.shape[1]
        dim = src_k.shape[2]
        for e in range(cuda.threadIdx.x, heads * dim, cuda.blockDim.x):
            h = e // dim
            d = e - h * dim
            if nhd:
                cache[p, 0, s, h, d] = src_k[i, h, d]
                cache[p, 1, s, h, d] = src_v[i, h, d]
            else:
                cache[p, 0, h, s, d] = src_k[i, h, d]
                cache[p, 1, h, s, d] = src_v[i, h, d]
    return append


_KERNELS = {}


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *,
                          kv_layout: str = "NHD", k_scale=None, v_scale=None) -> None:
    """Write the appended tokens into ``paged_kv_cache`` in place (golden
    signature: :func:`nbattn.reference.append_paged_kv_cache`); into an fp8 cache
    with ``k_scale`` / ``v_scale`` (None: 1.0), quantized as the golden model does."""
    fp8 = fp8_kind("paged_kv_cache", paged_kv_cache)
    as_is = fp8 is None or fp8_kind("append_key", append_key) is not None    # no quantization
    if fp8 is not None:
        page, slot, append_key, append_value = fp8_append_data(
            append_key, append_value, batch_indices, positions, paged_kv_cache, paged_kv_indptr,
            paged_kv_indices, paged_kv_last_page_len, kv_layout, fp8, k_scale, v_scale)
        code = FP8_CODES[fp8]
    else:
        kv_scales(k_scale, v_scale, None, "paged_kv_cache", L.dtype_of(paged_kv_cache))
        page, slot = L.check_append(append_key, append_value, batch_indices, positions, paged_kv_cache,
                                    paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, kv_layout)
        code = A.dtype_code(paged_kv_cache, "paged_kv_cache")
    kind = A.kind_of(paged_kv_cache)
    if as_is:                                  # quantized K/V were made on the host: any device will do
        L.check_same_device(append_key=append_key, paged_kv_cache=paged_kv_cache)
    if len(page) == 0:
        return
    stream = A.launch_stream(append_key, append_value, paged_kv_cache)
    cache = A.to_device(paged_kv_cache, "paged_kv_cache", stream, code)
    k = A.to_device(append_key, "append_key", stream, code)
    v = A.to_device(append_value, "append_value", stream, code)
    page_d = cuda.to_device(np.ascontiguousarray(page, np.int32), stream=stream)
    slot_d = cuda.to_device(np.ascontiguousarray(slot, np.int32), stream=stream)
    nhd = kv_layout == "NHD"
    if nhd not in _KERNELS:
        _KERNELS[nhd] = _append_kernel(nhd)
    _KERNELS[nhd][len(page), THREADS, stream](k, v, page_d, slot_d, cache)
    if not A.is_device_kind(kind):
        host = cache.copy_to_host(stream=stream)
        if fp8 is not None:                    # the bytes back into the caller's fp8 tensor
            import torch
            paged_kv_cache.view(torch.uint8).copy_(torch.from_numpy(host))
        else:
            A.copy_into_host(paged_kv_cache, host)
