"""numba.cuda kernels with the golden model's signatures (:mod:`nbattn.reference`).

Run on a GPU when one is present, else in numba's CUDA simulator (chosen by
:mod:`nbattn._compat` when :mod:`nbattn` is imported, before numba.cuda).

Public (the golden model's arguments, plus ``out=``/``lse=`` buffers):
    single_prefill, single_decode, batch_prefill_ragged, batch_prefill_paged,
    batch_decode_paged, block_sparse, cascade, append_paged_kv_cache,
    merge_state, merge_states, merge_state_in_place, split_kv (FlashDecoding over given KV chunks)
    apply_rope, apply_rope_pos_ids, apply_llama31_rope, apply_llama31_rope_pos_ids (standalone RoPE)
    BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
                            (FlashInfer's plan()/run() over a preallocated workspace)

Building blocks for other kernels and the scheduler's plan()/run():
    nbattn.cuda.host.arrays     input kinds, streams, raw word views
    nbattn.cuda.blocks.primitives  16-byte loads, fp16/bf16 unpack, exp2 (GPU + simulator faces)
    nbattn.cuda.blocks.fp8         fp8 (e4m3fn / e5m2) bytes to float32 in registers
    nbattn.cuda.blocks.variants    variant_device_fns(variant) -> (transform, keep)
    nbattn.cuda.decode      prepare_decode, WorkList, decode_launch, run_decode_work, split_work
    nbattn.cuda.merge       MergeMap, run_merge_partials
"""
from .. import _compat  # noqa: F401  (numpy shim + simulator choice before numba.cuda)
from .._diff import kernel_entry
from .decode import batch_decode_paged, single_decode
from .merge import merge_state, merge_state_in_place, merge_states
from .prefill import batch_prefill_paged, batch_prefill_ragged, single_prefill
from .sparse import block_sparse
from . import cascade # the module, callable as the cascade function
from .split import split_kv
from .wrappers import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper
from .page import append_paged_kv_cache
from .rope import apply_llama31_rope, apply_llama31_rope_pos_ids, apply_rope, apply_rope_pos_ids
from .sinks import with_sinks
from .fp8 import refuse_fp8

__all__ = ["batch_decode_paged", "merge_state", "merge_states", "merge_state_in_place",
           "batch_prefill_paged", "batch_prefill_ragged", "single_prefill", "block_sparse", "cascade",
           "BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
           "append_paged_kv_cache", "single_decode", "split_kv",
           "apply_rope", "apply_rope_pos_ids", "apply_llama31_rope", "apply_llama31_rope_pos_ids"]

# Forms that do not read fp8 K/V refuse it (and k_scale / v_scale) first, naming the argument
# (nbattn.cuda.fp8); the decode and prefill forms, the decode wrapper and append_paged_kv_cache read it.
(block_sparse, split_kv) = (refuse_fp8(f, f.__name__) for f in (block_sparse, split_kv))
# The golden model's dtype= keyword is a documented no-op here (nbattn._diff).
# Learnable sinks (sinks=) are one more state merged once after the kernels (nbattn.cuda.sinks).
(batch_decode_paged, single_decode, batch_prefill_paged, batch_prefill_ragged, single_prefill,
 block_sparse) = (kernel_entry(with_sinks(f)) for f in (batch_decode_paged, single_decode, batch_prefill_paged,
                                                       batch_prefill_ragged, single_prefill, block_sparse))
split_kv = kernel_entry(split_kv)
