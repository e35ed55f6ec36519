"""``split_kv`` on the kernels: FlashDecoding over explicit KV chunks of one request.

Each chunk ``[kv_chunk_indptr[c], kv_chunk_indptr[c+1])`` becomes one level of
a cascade over a page-size-1 view of ``k, v``: the cascade kernel computes the
state of every chunk with the request's own positions (query i at
``K - Q + i``, key j at ``j``) and the merge kernel folds the states in chunk
order -- the same computation :func:`nbattn.reference.split_kv` describes.
"""
from __future__ import annotations

import numpy as np

from .. import layout as L
from .cascade import cascade
from .tuning import CASCADE, CascadeTuning, check_tuning

__all__ = ["split_kv"]


def _paged(k, v, kv_layout: str):
    """``[K, 2, 1, Hkv, D]`` (NHD) cache holding k and v, in their own kind."""
    if type(k).__module__.startswith("torch"):
        import torch
        if kv_layout == "HND":
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        return torch.stack([k, v], dim=1).unsqueeze(2).contiguous()
    k, v = L.to_numpy(k), L.to_numpy(v)
    if kv_layout == "HND":
        k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    return np.ascontiguousarray(np.stack([k, v], axis=1)[:, :, None])


def split_kv(q, k, v, kv_chunk_indptr, *, kv_layout: str = "NHD", return_lse: bool = False,
             return_partials: bool = False, out=None, lse=None, tensor_cores: bool | None = None,
             stream=0, kv_chunk=None, tuning: CascadeTuning | None = None, **variant):
    """:func:`nbattn.reference.split_kv` on the kernels (q ``[Q, Hq, D]``, k/v
    ``[K, Hkv, D]`` NHD).  ``return_partials`` is the golden model's view of the
    per-chunk states; the kernels keep theirs in a workspace, so asking for them
    here is an error.  ``tuning``: the cascade's (a
    :class:`nbattn.cuda.tuning.CascadeTuning`)."""
    tuning = check_tuning(tuning, CascadeTuning, CASCADE)
    if return_partials:
        raise ValueError("return_partials: the kernels do not return per-chunk states; "
                         "use nbattn.reference.split_kv for them")
    L.check_kv_layout(kv_layout)
    if getattr(k, "ndim", None) != 3 or getattr(v, "shape", None) != getattr(k, "shape", None):
        raise L.LayoutError(f"v: k and v must both be 3-D with equal shapes, got "
                            f"{getattr(k, 'shape', None)} and {getattr(v, 'shape', None)}")
    n_kv = int(k.shape[0] if kv_layout == "NHD" else k.shape[1])
    chunks = L.check_indptr("kv_chunk_indptr", kv_chunk_indptr, total=n_kv, total_name="kv length")
    L.check_same_dtype(q=q, k=k, v=v)
    n_q = int(q.shape[0]) if getattr(q, "ndim", None) == 3 else None
    if n_q is None:
        raise L.LayoutError(f"q: must have shape [qo_len, num_qo_heads, head_dim], got {getattr(q, 'shape', None)}")
    qo = np.array([0, n_q], np.int32)
    levels = [L.CascadeLevel(qo, np.array([0, z - a], np.int32), np.arange(a, z, dtype=np.int32),
                             np.array([1 if z > a else 0], np.int32))
              for a, z in zip(chunks[:-1].tolist(), chunks[1:].tolist())]
    if not levels:
        raise L.LayoutError("kv_chunk_indptr: must list at least one chunk")
    return cascade(q, levels, _paged(k, v, kv_layout), return_lse=return_lse, out=out, lse=lse,
                   tensor_cores=tensor_cores, stream=stream, kv_chunk=kv_chunk, tuning=tuning, **variant)
