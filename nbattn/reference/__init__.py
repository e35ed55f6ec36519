"""The golden model (NumPy): what every nbattn kernel must compute.

Same names and arguments as :mod:`nbattn.cuda`, so a differential test is one
comparison.  See docs/concepts/ (layouts.md, including fp8 KV caches; masks.md,
custom_mask.md, sinks.md, state.md).
"""
from .attention import (attend, batch_decode_paged, batch_prefill_paged, batch_prefill_ragged,
                        block_sparse, cascade, single_decode, single_prefill, split_kv)
from .custom_mask import packbits, segment_packbits
from .page import append_paged_kv_cache
from .rope import apply_llama31_rope, apply_llama31_rope_pos_ids, apply_rope, apply_rope_pos_ids
from .._diff import golden_entry
from .state import (AttentionState, lse_base2_to_natural, lse_natural_to_base2, merge_state,
                    merge_state_in_place, merge_states)

__all__ = [
    "attend", "single_prefill", "single_decode", "batch_prefill_ragged", "batch_prefill_paged",
    "batch_decode_paged", "block_sparse", "cascade", "split_kv", "append_paged_kv_cache",
    "AttentionState", "merge_state", "merge_states", "merge_state_in_place",
    "lse_natural_to_base2", "lse_base2_to_natural",
    "apply_rope", "apply_rope_pos_ids", "apply_llama31_rope", "apply_llama31_rope_pos_ids",
    "packbits", "segment_packbits",
]

# The kernels' keywords (out=, lse=, stream=, tensor_cores=, kv_chunk=) and torch
# inputs, torch outputs: one call for a differential test (nbattn._diff).
(single_prefill, single_decode, batch_prefill_ragged, batch_prefill_paged, batch_decode_paged, block_sparse,
 cascade, split_kv) = (golden_entry(f) for f in (single_prefill, single_decode, batch_prefill_ragged,
                                                 batch_prefill_paged, batch_decode_paged, block_sparse,
                                                 cascade, split_kv))
