"""Multi-level cascade attention over composable formats (SPEC sections 1, 3;
golden: :func:`nbattn.reference.cascade`; FlashInfer's
MultiLevelCascadeAttentionWrapper).

``levels[l]`` is a :class:`nbattn.layout.CascadeLevel`: block row g makes the
query rows ``qo_indptr[g]:qo_indptr[g+1]`` read the level's pages for g.  A
request's keys are its levels' pages concatenated in level order.

How it runs:

1. One prefill launch per level (:mod:`nbattn.cuda.prefill`, "paged" mode)
   whose work items are the level's *groups*: all query rows of a group --
   every request sharing the prefix, with their GQA heads fused in -- form
   the query tiles, so each KV tile of a shared prefix is loaded once for the
   whole group (SPEC section 6: ``P + nS`` tokens read instead of ``n(P+S)``).
   Each row carries its own request, query position and the position of the
   level's first key (its ``kvoff``: the lengths of its earlier levels).
2. A level whose work is too little to fill the GPU (a long shared prefix
   read by one group) has its keys split into chunks; each chunk writes a
   partial state (float32).
3. The states are merged per row in order -- chunks of level 0, then of
   level 1, ... -- with the merge operator of SPEC section 3 (sigmoid
   attention: partial outputs add) into the output in q's dtype.
"""
from __future__ import annotations

import math

import numpy as np

from .. import _compat
from .. import layout as L
from . import prefill as P
from .prefill import cuda, float32

__all__ = ["cascade"]

TARGET_CTAS = 2 * 132    # two blocks per H200 SM
MIN_CHUNK = 512


def cascade(q, levels, paged_kv_cache, *, kv_layout: str = "NHD", return_lse: bool = False,
            out=None, lse=None, tensor_cores: bool | None = None, stream=0, kv_chunk=None, **variant):
    """``q [rows, Hq, D]``; ``levels`` a list of CascadeLevel (or 4-tuples);
    ``paged_kv_cache`` shared by all levels.  ``kv_chunk`` fixes the split size
    (default: chosen to fill the GPU; 0 = never split)."""
    var = P.parse_variant(variant)
    P._check_lse(var, return_lse)
    L.check_same_device(q=q, paged_kv_cache=paged_kv_cache)
    kind = P._check_kind_match(q=q, paged_kv_cache=paged_kv_cache)
    dims = L.cache_dims(paged_kv_cache, kv_layout)
    lv = L.validate_cascade(levels, dims.page_size, dims.num_pages,
                            total_rows=q.shape[0] if len(q.shape) == 3 else None)
    shape = L.check_q(q, dims.head_dim)
    L.check_heads(shape[1], dims.num_kv_heads)
    req_q = lv[-1][0]
    rows, hq, d = shape
    group_of = [np.searchsorted(qo.qo_indptr, req_q.qo_indptr[:-1], side="right") - 1 for qo, _ in lv]
    lens = np.stack([p.kv_lens[g] for (_, p), g in zip(lv, group_of)]).astype(np.int64)  # [levels, nreq]
    total = lens.sum(axis=0)
    if var.causal:
        L.check_causal_lengths(req_q.lengths, total, name=f"levels[{len(lv) - 1}].qo_indptr")
    offsets = np.concatenate([np.zeros((1, req_q.batch_size), np.int64), np.cumsum(lens, axis=0)[:-1]])

    spec = P.make_spec("paged", kv_layout, kind, d, hq, dims.num_kv_heads, var, tensor_cores, out_kind="f32")
    outs = P._Outputs(q, shape, kind, out, lse, return_lse)
    row_pos, _, row_req = P.request_rows(req_q, total)
    dq = P.to_device(q)
    cache = P.to_device(paged_kv_cache)

    # Work per level, with the KV split that fills the GPU.
    plans = []
    n_states = 0
    for li, (qo, pkv) in enumerate(lv):
        chunk = _chunk_size(qo, pkv, spec, dims.num_kv_heads) if kv_chunk is None else int(kv_chunk)
        n = max(1, max((-(-int(x) // chunk) for x in pkv.kv_lens), default=1)) if chunk else 1
        work = P.build_work(qo.qo_indptr[:-1], qo.lengths, pkv.paged_kv_indptr[:-1],
                            np.zeros(qo.batch_size, np.int64), pkv.kv_lens, spec.group, spec.tile_q,
                            kv_chunk=chunk or None, out_starts=n_states * rows + qo.qo_indptr[:-1],
                            chunk_stride=rows)
        plans.append((pkv, work, offsets[li][row_req].astype(np.int32)))
        n_states += n

    states_o = cuda.device_array((n_states * rows, hq, d), np.float32)
    states_lse = cuda.device_array((n_states * rows, hq), np.float32)
    if rows:
        _empty_states(states_o, states_lse, var.use_sigmoid, stream)
        for pkv, work, kvoff in plans:
            P.launch(spec, dq, cache, cache, pkv.paged_kv_indices, work, row_pos, kvoff, row_req,
                     dims.page_size, 0, dims.num_kv_heads, states_o, states_lse, stream)
        P.enqueue(_merge(kind, var.use_sigmoid), (rows, hq), min(128, max(32, d)), stream,
                  (states_o, states_lse, np.int32(n_states), np.int32(rows), outs.d_out, outs.d_lse))
    return outs.finish()


def _chunk_size(qo: L.RaggedQ, pkv: L.PagedKV, spec: P.KernelSpec, num_kv_heads: int) -> int:
    """Keys per chunk so that the level's work items reach ~TARGET_CTAS blocks (0: no split)."""
    if _compat.simulator_enabled():
        return 0
    tiles = int(np.sum(-(-qo.lengths.astype(np.int64) * spec.group // spec.tile_q)))
    if tiles == 0 or tiles * num_kv_heads >= TARGET_CTAS:
        return 0
    longest = int(pkv.kv_lens.max(initial=0))
    want = max(1, TARGET_CTAS // (tiles * num_kv_heads))
    chunk = max(MIN_CHUNK, -(-longest // want))
    return 0 if chunk >= longest else chunk


# ---------------------------------------------------------------------------
# Small kernels: empty states, ordered merge
# ---------------------------------------------------------------------------

@cuda.jit
def _fill_empty(states_o, states_lse, zero_o):
    """Every state starts empty (lse = -inf; sigmoid also needs o = 0): chunks
    a group does not have are then neutral in the merge."""
    i = cuda.blockIdx.x
    h = cuda.blockIdx.y
    if cuda.threadIdx.x == 0:
        states_lse[i, h] = -math.inf
    if zero_o:
        for dd in range(cuda.threadIdx.x, states_o.shape[2], cuda.blockDim.x):
            states_o[i, h, dd] = 0.0


def _empty_states(states_o, states_lse, sigmoid: bool, stream) -> None:
    n, hq, d = states_o.shape
    P.enqueue(_fill_empty, (n, hq), 32, stream, (states_o, states_lse, bool(sigmoid)))


_MERGES: dict = {}


def _merge(kind: str, sigmoid: bool):
    """Kernel: fold the n_states states of each (row, head) in order (SPEC
    section 3) into out (q's dtype) and lse.  Empty states are skipped, never
    multiplied, so unwritten partial outputs cannot leak NaN."""
    key = (kind, sigmoid)
    if key in _MERGES:
        return _MERGES[key]
    write = P._element_writer(kind)
    neg_inf = float32(-math.inf)
    ln2 = float32(math.log(2.0))

    @cuda.jit
    def merge(states_o, states_lse, n_states, rows, out, lse):
        r = cuda.blockIdx.x
        h = cuda.blockIdx.y
        d_all = out.shape[2]
        for dd in range(cuda.threadIdx.x, d_all, cuda.blockDim.x):
            if sigmoid:
                acc = float32(0.0)
                for i in range(n_states):
                    acc += states_o[i * rows + r, h, dd]
                out[r, h, dd] = write(acc)
            else:
                m = neg_inf
                acc = float32(0.0)
                weight = float32(0.0)
                for i in range(n_states):
                    s = states_lse[i * rows + r, h]
                    if s == neg_inf:
                        continue
                    if s > m:       # rescale what is accumulated to the new max
                        shrink = math.exp((m - s) * ln2) if m != neg_inf else float32(0.0)
                        acc *= shrink
                        weight *= shrink
                        m = s
                    w = math.exp((s - m) * ln2)
                    acc += states_o[i * rows + r, h, dd] * w
                    weight += w
                out[r, h, dd] = write(acc / weight if weight > 0 else float32(0.0))
        if cuda.threadIdx.x == 0:
            if sigmoid:
                lse[r, h] = math.nan
            else:
                m = neg_inf
                for i in range(n_states):
                    m = max(m, states_lse[i * rows + r, h])
                total = float32(0.0)
                if m != neg_inf:
                    for i in range(n_states):
                        s = states_lse[i * rows + r, h]
                        if s != neg_inf:
                            total += math.exp((s - m) * ln2)
                lse[r, h] = m + math.log2(total) if total > 0 else neg_inf

    _MERGES[key] = merge
    return merge
