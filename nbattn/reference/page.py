"""Appending new K/V tokens into a paged cache (FlashInfer's append_paged_kv_cache).

The index math (batch index + position -> page + slot) lives in
:func:`nbattn.layout.append_slots`; this is the NumPy write that the
:mod:`nbattn.cuda` kernel mirrors.  Everything is validated before the cache
is touched.
"""
from __future__ import annotations

import numpy as np

from .. import layout as L


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *,
                          kv_layout: str = "NHD") -> None:
    """Write ``append_key/append_value [nnz, num_kv_heads, head_dim]`` into the
    cache at the pages and slots of (``batch_indices``, ``positions``), in place.

    The page table must already describe the grown lengths (as in FlashInfer:
    the caller allocates pages and updates ``paged_kv_last_page_len`` first).
    """
    if not isinstance(paged_kv_cache, np.ndarray):
        raise L.LayoutError("paged_kv_cache: the golden model writes into a NumPy array; "
                            f"got {type(paged_kv_cache).__name__}")
    page, slot = L.check_append(append_key, append_value, batch_indices, positions, paged_kv_cache,
                                paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, kv_layout)
    k, v = L.to_numpy(append_key), L.to_numpy(append_value)
    if kv_layout == "NHD":
        paged_kv_cache[page, 0, slot] = k
        paged_kv_cache[page, 1, slot] = v
    else:
        paged_kv_cache[page, 0, :, slot] = k
        paged_kv_cache[page, 1, :, slot] = v
