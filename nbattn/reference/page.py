"""Appending new K/V tokens into a paged cache (FlashInfer's append_paged_kv_cache).

The index math (batch index + position -> page + slot) lives in
:func:`nbattn.layout.append_slots`; this is the NumPy write that the
:mod:`nbattn.cuda` kernel mirrors.  Everything is validated before the cache
is touched.
"""
from __future__ import annotations

import numpy as np

from .. import layout as L
from .fp8 import check_scale, fp8_kind, kv_scales, quantize


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *,
                          kv_layout: str = "NHD", k_scale=None, v_scale=None) -> None:
    """Write ``append_key/append_value [nnz, num_kv_heads, head_dim]`` into the
    cache at the pages and slots of (``batch_indices``, ``positions``), in place.

    The page table must already describe the grown lengths (as in FlashInfer:
    the caller allocates pages and updates ``paged_kv_last_page_len`` first).

    The cache is a NumPy array of the appended dtype, or a torch fp8 tensor
    (``float8_e4m3fn`` / ``float8_e5m2``, NumPy has no fp8).  Into an fp8 cache,
    non-fp8 K/V are quantized: ``append_key / k_scale`` and ``append_value /
    v_scale`` (float scales, None = 1.0) rounded once to the nearest fp8 value,
    finite values saturating at the fp8 maximum (:func:`nbattn.reference.fp8.quantize`);
    K/V already of the cache's fp8 dtype are written as they are (no scales).
    Scales are rejected for a cache that is not fp8.
    """
    fp8 = fp8_kind("paged_kv_cache", paged_kv_cache)
    if fp8 is not None:
        return _append_fp8(append_key, append_value, batch_indices, positions, paged_kv_cache,
                           paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, kv_layout,
                           fp8, k_scale, v_scale)
    if not isinstance(paged_kv_cache, np.ndarray):
        raise L.LayoutError("paged_kv_cache: the golden model writes into a NumPy array; "
                            f"got {type(paged_kv_cache).__name__}")
    kv_scales(k_scale, v_scale, None, "paged_kv_cache", L.dtype_of(paged_kv_cache))
    page, slot = L.check_append(append_key, append_value, batch_indices, positions, paged_kv_cache,
                                paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, kv_layout)
    _write(paged_kv_cache, page, slot, L.to_numpy(append_key), L.to_numpy(append_value), kv_layout)


def _write(cache, page, slot, k, v, kv_layout: str) -> None:
    """Token t's K and V into ``(page[t], slot[t])`` of a NumPy or torch cache."""
    if kv_layout == "NHD":
        cache[page, 0, slot] = k
        cache[page, 1, slot] = v
    else:
        cache[page, 0, :, slot] = k
        cache[page, 1, :, slot] = v


def fp8_append_data(append_key, append_value, batch_indices, positions, cache, paged_kv_indptr,
                    paged_kv_indices, paged_kv_last_page_len, kv_layout: str, fp8: str, k_scale, v_scale):
    """What an append into the fp8 cache ``cache`` (of fp8 dtype name ``fp8``) writes, checked:
    ``(page, slot, k, v)``, the page and slot of every token (NumPy) and its K and V as
    torch tensors of the cache's fp8 dtype (K/V already of that dtype as they are, others
    quantized with :func:`~nbattn.reference.fp8.quantize`).  The kernels'
    ``append_paged_kv_cache`` writes the same bytes."""
    kinds = (fp8_kind("append_key", append_key), fp8_kind("append_value", append_value))
    if L.dtype_of(append_key) != L.dtype_of(append_value):
        raise L.LayoutError(f"append_value: must have append_key's dtype, got append_key="
                            f"{L.dtype_of(append_key)}, append_value={L.dtype_of(append_value)}")
    if kinds[0] is not None:                                   # already quantized: copied as it is
        if kinds[0] != fp8:
            raise L.LayoutError(f"append_key: an fp8 append must have the cache's dtype ({fp8}), "
                                f"got {kinds[0]}; or give unquantized K/V with k_scale / v_scale")
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is not None:
                raise L.LayoutError(f"{name}: append_key and append_value are already {fp8} and are "
                                    f"written as they are; pass {name}=None (or give them unquantized)")
        ks = vs = None
    else:
        ks, vs = check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)
    page, slot = L.check_append(append_key, append_value, batch_indices, positions, cache,
                                paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, kv_layout,
                                check_dtypes=False)
    if ks is None:
        return page, slot, append_key, append_value
    k, v = L.to_numpy(append_key), L.to_numpy(append_value)
    for name, x in (("append_key", k), ("append_value", v)):
        if x.dtype.kind != "f":
            raise L.LayoutError(f"{name}: must be a floating-point array or tensor, got {x.dtype}")
    return page, slot, quantize(k, ks, fp8), quantize(v, vs, fp8)


def _append_fp8(append_key, append_value, batch_indices, positions, cache, paged_kv_indptr,
                paged_kv_indices, paged_kv_last_page_len, kv_layout, fp8, k_scale, v_scale) -> None:
    import torch
    page, slot, k, v = fp8_append_data(append_key, append_value, batch_indices, positions, cache,
                                       paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, kv_layout,
                                       fp8, k_scale, v_scale)
    p = torch.from_numpy(page.astype(np.int64)).to(cache.device)
    t = torch.from_numpy(slot.astype(np.int64)).to(cache.device)
    _write(cache, p, t, k.to(cache.device), v.to(cache.device), kv_layout)
