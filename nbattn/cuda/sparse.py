"""Block-sparse attention over a BSR view (docs/concepts/layouts.md, golden:
:func:`nbattn.reference.block_sparse`).

Query row i reads key j iff block ``(i // B_r, j // B_c)`` is non-zero; the
variants apply on top (causal bottom-right aligned over M x N).  Any
``(B_r, B_c)`` works: a block row is one work item of the prefill kernel in
its ``"bsr"`` mode (:mod:`nbattn.cuda.prefill`), whose key walk runs over the
row's non-zero column blocks only -- they are gathered into the KV tiles the
way pages are, ``B_c`` playing the page size -- so zero blocks cost nothing.
A block row taller than the query tile (with GQA, ``B_r*group`` fused rows)
is split into several query tiles that read the same blocks.

RoPE at attention time turns query row i to its position ``N - M + i`` and key j
to ``j`` (its row in k), the positions the causal mask uses; it runs on the
prefill teaching tile (correct, not fast).
"""
from __future__ import annotations

import numpy as np

from .. import layout as L
from ..variants import check_return_lse
from .blocks.variants import kernel_variant
from . import prefill as P
from .tuning import PREFILL, PrefillTuning, check_tuning

__all__ = ["block_sparse"]


def block_sparse(q, k, v, bsr: L.BSR, *, kv_layout: str = "NHD", return_lse: bool = False,
                 out=None, lse=None, tensor_cores: bool | None = None, stream=0,
                 tuning: PrefillTuning | None = None, **variant):
    """``q [M, Hq, D]``, ``k, v [N, Hkv, D]`` (NHD), ``bsr`` of shape (M, N); ``tuning`` (a
    :class:`nbattn.cuda.tuning.PrefillTuning`, default ``PREFILL``) shapes the kernel."""
    tuning = check_tuning(tuning, PrefillTuning, PREFILL)
    var = kernel_variant(variant)
    check_return_lse(var, return_lse)
    bsr = L.BSR.check(bsr)
    L.check_same_device(q=q, k=k, v=v)
    kind = P.check_kind_match(q=q, k=k, v=v)
    n_kv, hkv, d = P.contig_dims(k, v, kv_layout)
    shape = L.check_q(q, d)
    if bsr.shape != (shape[0], n_kv):
        raise L.LayoutError(f"bsr: shape {bsr.shape} does not match (q rows, kv rows) = {(shape[0], n_kv)}")
    L.check_heads(shape[1], hkv)
    if var.causal:      # as the dense forms: a causal request has no more queries than keys
        L.check_causal_lengths(np.array([shape[0]]), np.array([n_kv]), name="q")
    b_r, b_c = bsr.block_shape
    spec = P.make_spec("bsr", kv_layout, kind, d, shape[1], hkv, var, tensor_cores, tuning=tuning)
    stream = P.resolve_stream(stream, q, k, v, out, lse)
    outs = P.Outputs(q, shape, kind, out, lse, return_lse, stream)
    m = shape[0]
    starts = np.arange(bsr.n_block_rows, dtype=np.int64) * b_r
    lens = np.minimum(b_r, m - starts)
    n_blocks = np.diff(bsr.row_ptr).astype(np.int64)
    work = P.build_work(starts, lens, bsr.row_ptr[:-1], np.zeros_like(starts), n_blocks * b_c,
                        spec.group, spec.tile_q)
    row_pos = (n_kv - m + np.arange(m)).astype(np.int32)        # bottom-right aligned
    zeros = np.zeros(m, np.int32)
    if m:
        P.launch(spec, P.device_in(q, "q", kind, stream), P.device_in(k, "k", kind, stream),
                 P.device_in(v, "v", kind, stream), bsr.col_indices, work, row_pos, zeros, zeros, b_c,
                 n_kv, hkv, outs.d_out, outs.d_lse, stream)
    # a block row with no non-zero block still gets its work item: it writes o = 0, lse = -inf
    return outs.finish()

