"""Where queries and KV live: ragged Q, paged KV, BSR views (docs/concepts/layouts.md).

One module that the golden model (:mod:`nbattn.reference`), the kernels
(:mod:`nbattn.cuda`) and the scheduler (:mod:`nbattn.sched`) all use, so a
layout rule is written once and checked once.

Everything here works on *index arrays only*: building a view never touches or
copies KV data.  Validation raises :class:`LayoutError` (a ``ValueError``) whose
message starts with the argument's name and states the rule it broke; it runs
before anything is computed or modified.

Names follow FlashInfer: ``qo_indptr``, ``paged_kv_indptr``,
``paged_kv_indices``, ``paged_kv_last_page_len``, ``kv_layout`` ("NHD" or "HND").
"""
from __future__ import annotations

from .checks import (KV_LAYOUTS, CacheDims, LayoutError, as_int32, cache_dims, check_heads, check_indptr,
                     check_kv_layout, check_q, check_same_device, check_same_dtype, dtype_of, is_torch, to_numpy,
                     INT32_MAX)
from .ragged import IndptrRows, RaggedQ
from .paged import (PagedKV, append_slots, check_append, check_causal_lengths, gather_kv,
                    get_batch_indices_positions, kv_lengths)
from .bsr import BSR, bsr_to_page_table, page_table_to_bsr
from .cascade import CascadeLevel, cascade_decompose, cascade_keys, validate_cascade

__all__ = ["KV_LAYOUTS", "LayoutError", "is_torch", "to_numpy", "dtype_of", "as_int32", "check_indptr",
           "check_kv_layout", "CacheDims", "cache_dims", "check_heads", "check_q", "check_same_device",
           "check_same_dtype", "INT32_MAX", "IndptrRows", "RaggedQ", "PagedKV", "kv_lengths", "gather_kv",
           "check_causal_lengths", "get_batch_indices_positions", "append_slots", "check_append", "BSR",
           "page_table_to_bsr", "bsr_to_page_table", "CascadeLevel", "validate_cascade", "cascade_keys",
           "cascade_decompose"]
