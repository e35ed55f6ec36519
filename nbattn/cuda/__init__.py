"""numba.cuda kernels with the golden model's signatures (:mod:`nbattn.reference`).

Run on a GPU when one is present, else in numba's CUDA simulator (chosen by
:mod:`nbattn._compat` when :mod:`nbattn` is imported, before numba.cuda).

Public:
    batch_decode_paged(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices,
                       paged_kv_last_page_len, *, kv_layout="NHD", return_lse=False,
                       out=None, lse=None, **variant)
    merge_state(v_a, s_a, v_b, s_b), merge_states(v, s),
    merge_state_in_place(v, s, v_other, s_other, mask=None)

Building blocks for other kernels and the scheduler's plan()/run():
    nbattn.cuda._arrays     input kinds, streams, raw word views
    nbattn.cuda.primitives  16-byte loads, fp16/bf16 unpack, exp2 (GPU + simulator faces)
    nbattn.cuda.variants    variant_device_fns(variant) -> (transform, keep)
    nbattn.cuda.decode      prepare_decode, WorkList, run_decode_work, split_work
    nbattn.cuda.merge       MergeMap, run_merge_partials
"""
from .. import _compat  # noqa: F401  (numpy shim + simulator choice before numba.cuda)
from .decode import batch_decode_paged
from .merge import merge_state, merge_state_in_place, merge_states

__all__ = ["batch_decode_paged", "merge_state", "merge_states", "merge_state_in_place"]

# Prefill / append, block-sparse and cascade kernels (issue 4).
from .prefill import batch_prefill_paged, batch_prefill_ragged, single_prefill  # noqa: E402
from .sparse import block_sparse  # noqa: E402
from .cascade import cascade  # noqa: E402

__all__ += ["batch_prefill_paged", "batch_prefill_ragged", "single_prefill", "block_sparse", "cascade"]

# Plan/run wrappers over a preallocated workspace (issue 5, SPEC section 5).
from .wrappers import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper  # noqa: E402

__all__ += ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"]

# Appending tokens into pages (FlashInfer's append_paged_kv_cache) and one-query decode.
from .page import append_paged_kv_cache  # noqa: E402
from .decode import single_decode  # noqa: E402

__all__ += ["append_paged_kv_cache", "single_decode"]
