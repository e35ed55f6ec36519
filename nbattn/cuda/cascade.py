"""Multi-level cascade attention over composable formats (docs/concepts/layouts.md, state.md;
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
   whole group (docs/concepts/performance.md: ``P + nS`` tokens read instead of ``n(P+S)``).
   Each row carries its own request, query position and the position of the
   level's first key (its ``kvoff``: the lengths of its earlier levels).
   A level whose groups are single decode rows (the unique suffixes of a
   decode step) is a batch decode over the level's page table instead
   (:mod:`nbattn.cuda.decode`, writing its states into the same slots) when
   no variant needs key positions: a query tile of one row would waste all
   but a few of its rows.  RoPE at attention time turns each key by its
   position in its request, so a group's rows must agree on where the level's
   keys sit (:func:`check_rope_positions`); its levels run on the teaching tile
   (correct, not fast), as every RoPE prefill does.
2. A level whose work is too little to fill the GPU (a long shared prefix
   read by one group) has its keys split into chunks; each chunk writes a
   partial state (float32).
3. The states are merged per row in order -- chunks of level 0, then of
   level 1, ... -- with the merge operator of docs/concepts/state.md (sigmoid
   attention: partial outputs add) into the output in q's dtype, by
   :func:`nbattn.cuda.merge.run_merge_partials`'s kernel over a merge map that
   lists, per row, exactly the states written for it (a group with fewer
   chunks than its level's longest has none beyond them), so nothing needs
   clearing first.
"""
from __future__ import annotations

import sys
import types

import numpy as np
from numba import cuda

from .. import layout as L
from ..variants import check_return_lse
from .blocks.variants import kernel_variant
from .host import arrays as A
from . import merge as M
from . import prefill as P
from .kernels.prefill_cc import dynamic_smem
from .kernels.prefill_common import KernelSpec, plain_variant
from .host.driver import jit_kernel, sm_count
from .blocks.primitives import SIMULATOR
from .tuning import CASCADE, CascadeTuning, check_tuning

__all__ = ["cascade", "chunk_size", "split_blocks", "decode_level", "check_rope_positions"]


def check_rope_positions(req_q: L.RaggedQ, group_of: list, offsets: np.ndarray) -> None:
    """RoPE turns a key by its position in its request, and a level's group shares
    one turned copy of its keys among its rows: every request with query rows in a
    group must find the level's keys at the same offset (true of a cascade whose
    groups nest: a shared prefix, then each request's own pages).  Raises
    NotImplementedError naming the level otherwise, before anything is built."""
    live = req_q.lengths > 0
    for li, groups in enumerate(group_of):
        g, off = groups[live], offsets[li][live]
        if g.size == 0:
            continue
        n = int(g.max()) + 1
        lo = np.full(n, np.iinfo(np.int64).max)
        hi = np.full(n, -1, np.int64)
        np.minimum.at(lo, g, off)
        np.maximum.at(hi, g, off)
        bad = (hi >= 0) & (lo != hi)
        if bad.any():
            k = int(np.argmax(bad))
            raise NotImplementedError(
                f"levels[{li}]: with pos_encoding_mode='ROPE_LLAMA' the requests of a group must find its keys at "
                f"one position, but group {k} serves requests whose earlier levels hold {int(lo[k])} and "
                f"{int(hi[k])} keys; give such requests groups of their own at this level")


def cascade(q, levels, paged_kv_cache, *, kv_layout: str = "NHD", return_lse: bool = False,
            out=None, lse=None, tensor_cores: bool | None = None, stream=0, kv_chunk=None,
            tuning: CascadeTuning | None = None, **variant):
    """``q [rows, Hq, D]``; ``levels`` a list of CascadeLevel (or 4-tuples);
    ``paged_kv_cache`` shared by all levels.  ``kv_chunk`` fixes the split size
    (default: chosen to fill the GPU; 0 = never split).  ``tuning`` (a
    :class:`nbattn.cuda.tuning.CascadeTuning`, default ``CASCADE``) shapes the
    level kernels and hands its ``prefill``, ``decode`` and ``merge`` parts to the
    passes it runs."""
    tuning = check_tuning(tuning, CascadeTuning, CASCADE)
    var = kernel_variant(variant)
    check_return_lse(var, return_lse)
    L.check_same_device(q=q, paged_kv_cache=paged_kv_cache)
    kind = P.check_kind_match(q=q, paged_kv_cache=paged_kv_cache)
    dims = L.cache_dims(paged_kv_cache, kv_layout)
    lv = L.validate_cascade(levels, dims.page_size, dims.num_pages,
                            total_rows=q.shape[0] if len(q.shape) == 3 else None)
    shape = L.check_q(q, dims.head_dim)
    L.check_heads(shape[1], dims.num_kv_heads)
    req_q = lv[-1][0]
    rows, hq, d = shape
    group_of, total, offsets = L.cascade_keys(lv)
    if var.causal:
        L.check_causal_lengths(req_q.lengths, total, name=f"levels[{len(lv) - 1}].qo_indptr")
    if var.has_rope:
        check_rope_positions(req_q, group_of, offsets)

    spec = P.make_spec("paged", kv_layout, kind, d, hq, dims.num_kv_heads, var, tensor_cores, out_kind="f32",
                       tuning=tuning.prefill)
    stream = P.resolve_stream(stream, q, paged_kv_cache, out, lse)
    outs = P.Outputs(q, shape, kind, out, lse, return_lse, stream)
    row_pos, _, row_req = P.request_rows(req_q, total)
    dq = P.device_in(q, "q", kind, stream)
    cache = P.device_in(paged_kv_cache, "paged_kv_cache", kind, stream)

    # Work per level, with the KV split that fills the GPU.
    plans, states = [], []
    n_states = 0
    for li, (qo, pkv) in enumerate(lv):
        chunk = chunk_size(qo, pkv, spec, dims.num_kv_heads, tuning) if kv_chunk is None else int(kv_chunk)
        n = max(1, max((-(-int(x) // chunk) for x in pkv.kv_lens), default=1)) if chunk else 1
        work = P.build_work(qo.qo_indptr[:-1], qo.lengths, pkv.paged_kv_indptr[:-1],
                            np.zeros(qo.batch_size, np.int64), pkv.kv_lens, spec.group, spec.tile_q,
                            kv_chunk=chunk or None, out_starts=n_states * rows + qo.qo_indptr[:-1],
                            chunk_stride=rows)
        plans.append((pkv, work, offsets[li][row_req].astype(np.int32),
                      split_blocks(spec, tuning) if chunk else tuning.min_blocks))
        # chunks each group has (as build_work makes them), per query row
        chunks = (np.maximum(1, -(-pkv.kv_lens.astype(np.int64) // chunk)) if chunk
                  else np.ones(qo.batch_size, np.int64))
        row_group = np.searchsorted(qo.qo_indptr, np.arange(rows), side="right") - 1
        states.append((n_states, n, chunks[row_group]))
        n_states += n

    states_o = cuda.device_array((n_states * rows, hq, d), np.float32, stream=stream)
    states_lse = cuda.device_array((n_states * rows, hq), np.float32, stream=stream)
    if rows:
        for (qo, _), (pkv, work, kvoff, blocks), (first, n, _) in zip(lv, plans, states):
            if decode_level(qo, pkv, n, var, kind, kv_layout, dims, dq, cache, first * rows, states_o,
                            states_lse, outs, stream, tuning):
                continue
            _launch(spec, blocks, dq, cache, pkv.paged_kv_indices, work, row_pos, kvoff, row_req,
                    dims.page_size, dims.num_kv_heads, states_o, states_lse, stream)
        host_map = _merge_map(states, rows)
        merge_map = M.MergeMap(*(A.device_meta(x, x, stream) for x in host_map))
        kernel, grid, threads, args = M.merge_partials_launch(
            states_o, states_lse, merge_map, outs.d_out, outs.d_lse, code=kind, use_sigmoid=var.use_sigmoid,
            max_partials=int(np.diff(host_map[0]).max()), tuning=tuning.merge)
        P.enqueue(kernel, grid, threads, stream, args)
    return outs.finish()


_KERNELS: dict = {}


def _level_kernel(spec: KernelSpec, min_blocks: int):
    """:func:`nbattn.cuda.prefill.prefill_entry` around the spec's tile, with
    launch bounds promising ``min_blocks`` resident CTAs per SM."""
    key = (spec, min_blocks)
    kern = _KERNELS.get(key)
    if kern is None:
        tile = P.get_tile(spec)

        def kernel(q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes, block, n_keys,
                   out, lse):
            if min_blocks > 0:          # (min_blocks in the closure: part of the on-disk cache key)
                tile(cuda.blockIdx.x, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req,
                     slopes, block, n_keys, out, lse)
        kern = _KERNELS[key] = jit_kernel(kernel, launch_bounds=(spec.threads, min_blocks))
        kern.dynamic_smem = dynamic_smem(spec)
    return kern


def _launch(spec, min_blocks, q, cache, kv_indices, work, row_pos, row_kvoff, row_req, block, num_kv_heads, out, lse,
            stream):
    """One level: :func:`nbattn.cuda.prefill.launch` on :func:`_level_kernel`."""
    if len(work) == 0:
        return
    slopes = P.tile_slopes(spec.num_qo_heads, spec.variant.has_alibi)
    idx = kv_indices if len(kv_indices) else np.zeros(1, np.int32)
    meta = [A.device_meta(x, x, stream) for x in (idx, work, row_pos, row_kvoff, row_req)]
    args = (q, cache, cache, *meta, cuda.to_device(slopes, stream=stream), np.int32(block), np.int32(0), out, lse)
    P.enqueue(_level_kernel(spec, min_blocks), (len(work), num_kv_heads), spec.threads, stream, args)


def decode_level(qo: L.RaggedQ, pkv: L.PagedKV, n_states: int, var, code: str, kv_layout: str, dims, dq, cache,
                 slot0: int, states_o, states_lse, outs, stream, tuning: CascadeTuning = CASCADE) -> bool:
    """Launch one level as a batch decode (module doc, step 1) when it is one and
    ``tuning.decode_levels`` is on: every group a single query row, one state per row
    (no KV split), contiguous q and cache, and no variant that reads key positions
    (the decode kernel puts the query at the level's last key).  Row g's state goes
    to slot ``slot0 + g``; the decode kernel follows ``tuning.decode``."""
    from . import decode as Dec

    positional = (int(var.window_left) >= 0 or var.sink_size or var.has_alibi or var.has_rope
                  or var.score_mod is not None or var.mask_mod is not None or var.use_sigmoid)
    if (not tuning.decode_levels or positional or n_states != 1 or not np.all(qo.lengths == 1)
            or not (dq.is_c_contiguous() and cache.is_c_contiguous())):
        return False
    g = qo.batch_size
    hq = int(dq.shape[1])
    meta = [A.device_meta(x, x, stream) for x in (pkv.paged_kv_indptr,
                                                 pkv.paged_kv_indices if len(pkv.paged_kv_indices)
                                                 else np.zeros(1, np.int32), pkv.paged_kv_last_page_len)]
    prob = Dec.DecodeProblem(code, "device", stream, var, var.scale(dims.head_dim), g, hq, dims.num_kv_heads,
                             dims.head_dim, dims.page_size, kv_layout, pkv.kv_lens.astype(np.int32),
                             A.words(dq), A.words(cache), *meta,
                             cuda.to_device(np.zeros(hq, np.float32), stream=stream), None, outs.d_out, None,
                             outs.d_lse, Dec.aligned_16(dq, cache), tuning=tuning.decode)
    work = Dec.WorkList(*Dec.upload_int32(stream, np.arange(g + 1), np.arange(g), np.zeros(g), pkv.kv_lens,
                                         slot0 + np.arange(g)))
    kernel, grid, threads, args = Dec.decode_launch(prob, work, states_o, states_lse)
    P.enqueue(kernel, grid, threads, stream, args)
    return True


def _merge_map(states, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(merge_indptr, merge_row, merge_slots) folding, for each query row, the
    states written for it in level order, chunks in order.  ``states``: per
    level (first state, states of the level, chunks of each row's group)."""
    slots, written = [], []
    for first, n, row_chunks in states:
        c = np.arange(n)
        slots.append((first + c)[None, :] * rows + np.arange(rows)[:, None])   # state i, row r
        written.append(c[None, :] < row_chunks[:, None])
    slots, written = np.concatenate(slots, axis=1), np.concatenate(written, axis=1)
    indptr = np.concatenate([[0], np.cumsum(written.sum(axis=1))])
    return indptr.astype(np.int32), np.arange(rows, dtype=np.int32), slots[written].astype(np.int32)


def split_blocks(spec: KernelSpec, tuning: CascadeTuning = CASCADE) -> int:
    """CTAs per SM for a split level's kernel (launch bounds: registers <= 65536 /
    (threads * blocks)): ``tuning.min_blocks_split`` for the plain non-causal
    pipelined tensor-core build (head_dim 64/128; see CascadeTuning.min_blocks_split),
    else ``tuning.min_blocks`` (causal and variant builds of that tile need more
    registers than the tighter cap leaves)."""
    v = spec.variant
    plain = not v.causal and plain_variant(v)
    if spec.tensor_cores and spec.head_dim in (64, 128) and plain:
        return tuning.min_blocks_split
    return tuning.min_blocks


def chunk_size(qo: L.RaggedQ, pkv: L.PagedKV, spec: KernelSpec, num_kv_heads: int,
               tuning: CascadeTuning = CASCADE) -> int:
    """Keys per chunk so that the level's work items fill one wave of CTAs
    (resident slots = SMs x :func:`split_blocks`; a second, partial wave would cost a
    whole one), in whole KV tiles so no chunk ends inside a tile and never fewer than
    ``tuning.min_chunk``; 0: no split."""
    if SIMULATOR:
        return 0
    slots = split_blocks(spec, tuning) * sm_count()
    tiles = int(np.sum(-(-qo.lengths.astype(np.int64) * spec.group // spec.tile_q)))
    if tiles == 0 or tiles * num_kv_heads >= slots:
        return 0
    longest = int(pkv.kv_lens.max(initial=0))
    want = max(1, slots // (tiles * num_kv_heads))
    chunk = -(-longest // want)
    chunk = max(tuning.min_chunk, -(-chunk // spec.tile_k) * spec.tile_k)
    return 0 if chunk >= longest else chunk


def _cascade_with_sinks(*args, **kwargs):
    from .sinks import with_sinks       # (imports nbattn.cuda.merge, as this module does)
    return with_sinks(cascade)(*args, **kwargs)


class _CallableModule(types.ModuleType):
    """This module, callable as :func:`cascade`: ``import nbattn.cuda.cascade`` gives
    the module and ``nbattn.cuda.cascade(...)`` still runs the cascade."""

    def __call__(self, *args, **kwargs):
        kwargs.pop("dtype", None)      # the golden model's keyword: a no-op here
        return _cascade_with_sinks(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
