"""Batch prefill / append attention as numba.cuda kernels (docs/concepts/layouts.md, masks.md, state.md).

What it computes: exactly :func:`nbattn.reference.batch_prefill_paged`,
``batch_prefill_ragged`` and ``single_prefill`` -- same arguments, same
variants, output in q's dtype plus the base-2 LSE in float32.  ``tuning=`` (a
:class:`nbattn.cuda.tuning.PrefillTuning`) shapes the kernels, never what they
compute.

Work decomposition (docs/concepts/masks.md).  GQA heads are fused into rows: for one
KV head, fused row ``r`` of a request is query position ``r // group`` and
query head ``kv_head*group + r % group``.  A *work item* is one tile of
``T_q`` consecutive fused rows of one request (or of one cascade group, or one
BSR block row).  A kernel build is a per-row body ``tile(w, ...)`` (a device
function) under one of two entries (:mod:`nbattn.cuda.kernels.prefill_common`):
``prefill_entry``, grid ``(n_work, num_kv_heads)`` with one block per work item
and KV head (the public functions), or ``persistent_entry``, a fixed grid of C
blocks per KV head each walking its queue of work items (the plan/run wrapper).
Either way every KV tile a block gathers serves ``T_q`` rows -- all the query
heads of the group at once.

Keys.  A work item walks its keys ``t = 0 .. kv_len-1`` in tiles of ``T_k``.
Where key ``t`` lives is the one thing that differs between forms, chosen when
the kernel is built (``mode``, :func:`nbattn.cuda.kernels.prefill_common.key_locator`):

- ``"paged"``: page ``kv_indices[kv_ptr + t // page_size]``, slot ``t % page_size``;
- ``"contig"``: row ``kv_start + t`` of a contiguous ``k``/``v``;
- ``"bsr"``: column block ``kv_indices[kv_ptr + t // B_c]``, row
  ``block*B_c + t % B_c`` of a contiguous ``k``/``v`` (keys past N are dropped).

Positions (``nbattn.variants``).  Each query row carries its position
``q_idx`` (``row_pos``), its request ``b`` (``row_req``) and the position of
its first key (``row_kvoff``: non-zero only for the later levels of a cascade),
so key ``t`` sits at ``kv_idx = row_kvoff + t`` ("bsr": at its row in k).
With positions monotone in ``t``, a causal tile range ends at
``max(q_idx - kvoff) + 1`` and a window starts at ``min(q_idx - kvoff) - window_left``:
tiles outside are never loaded.

The tiles (:mod:`nbattn.cuda.kernels.prefill_dispatch` picks one):

- :mod:`nbattn.cuda.kernels.prefill_core`: the teaching tile -- the one to read,
  beside :func:`nbattn.reference.attend`; the fallback on CUDA cores;
- :mod:`nbattn.cuda.kernels.prefill_cc`: the register-tiled CUDA-core tile (what
  numba's simulator runs in CI for the head dims it covers);
- :mod:`nbattn.cuda.kernels.prefill_mma` and
  :mod:`nbattn.cuda.kernels.prefill_pipelined`: tensor cores (GPU, fp16/bf16).

Host side (:mod:`nbattn.cuda.host.prefill_launch`): inputs, outputs and streams
(with torch tensors the kernels launch on torch's current stream unless a
``stream`` is passed), work lists and the launch.  The names other modules use
(the plan/run wrapper, cascade, block-sparse, benchmarks) are importable from
here as well.
"""
from __future__ import annotations

import numpy as np

from .. import layout as L
from ..variants import check_return_lse
from .blocks.variants import kernel_variant
from .fp8 import prefill_kv, widen
from .host.driver import torch_stream
from .host.prefill_launch import (NAN_ROW, Outputs, build_work, check_kind_match, contig_dims,  # noqa: F401
                                  default_stream, device_in, enqueue, launch_work, longest_first, nan_row_at,
                                  recording, request_rows, resolve_stream, tile_slopes, torch_direct)
from .kernels.prefill_common import KernelSpec, NO_KEY, persistent_entry, prefill_entry  # noqa: F401
from .kernels.prefill_dispatch import (KERNELS, generated_source, get_kernel, get_persistent_kernel,  # noqa: F401
                                       get_tile, kernel_tiles, make_spec, tensor_cores_usable)
from ..reference.custom_mask import mask_indptr, request_masks
from .tuning import PREFILL, PrefillTuning, check_tuning

__all__ = ["batch_prefill_paged", "batch_prefill_ragged", "single_prefill"]


def launch(spec: KernelSpec, q, k_src, v_src, kv_indices: np.ndarray, work: np.ndarray,
           row_pos: np.ndarray, row_kvoff: np.ndarray, row_req: np.ndarray,
           block: int, n_keys: int, num_kv_heads: int, out, lse, stream=0, mask=None):
    """Launch one prefill kernel over a work list (the shared entry of prefill,
    block-sparse and cascade); an empty list launches (and compiles) nothing.
    ``mask``: a custom mask's ``(mask_bits, mask_rows)`` (:func:`mask_arrays`)."""
    if len(work) == 0:
        return
    launch_work(get_kernel(spec), spec, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req,
                block, n_keys, num_kv_heads, out, lse, stream, mask)


def mask_arrays(custom_mask, packed_custom_mask, qo_lens, kv_lens, *, causal: bool):
    """The kernel's view of a runtime custom mask (docs/concepts/custom_mask.md), or None
    when neither form is given: ``(mask_bits, mask_rows)`` as
    :func:`~nbattn.cuda.kernels.prefill_common.masked_entry` reads them.  The mask is
    checked by the golden model's :func:`nbattn.reference.custom_mask.request_masks`
    (same rules, same messages) before anything is built; a GPU tensor is copied to
    the host once, and the packed bits go to the device with the call."""
    blocks = request_masks(custom_mask, packed_custom_mask, qo_lens, kv_lens, causal=causal)
    if blocks is None:
        return None
    qo = np.asarray(qo_lens, np.int64)
    kv = np.asarray(kv_lens, np.int64)
    seg = (qo * kv + 7) // 8
    start = np.zeros(qo.shape[0] + 1, np.int64)
    np.cumsum(seg, out=start[1:])
    if packed_custom_mask is not None:
        bits = L.to_numpy(packed_custom_mask).astype(np.uint8, copy=False)
    else:       # each request's row-major block packed on its own, little-endian: element e of
        #         request r goes to bit 8 * start[r] + (e - ptr[r]), the padding bits stay 0
        flat = np.concatenate([b.ravel() for b in blocks] + [np.zeros(0, bool)])
        ptr = mask_indptr(qo, kv)
        to = np.arange(flat.shape[0], dtype=np.int64) + np.repeat(start[:-1] * 8 - ptr[:-1], qo * kv)
        spread = np.zeros(int(start[-1]) * 8, bool)
        spread[to] = flat
        bits = np.packbits(spread, bitorder="little")
    rows = np.empty((qo.shape[0], 2), np.int64)
    rows[:, 0] = start[:-1] * 8 - (kv - qo) * kv        # bit of (q_idx, kv_idx) = rows[r, 0] + q_idx * K + kv_idx
    rows[:, 1] = kv
    return (bits if bits.size else np.zeros(1, np.uint8)), rows


# ---------------------------------------------------------------------------
# Public forms
# ---------------------------------------------------------------------------

def batch_prefill_paged(q, paged_kv_cache, qo_indptr, paged_kv_indptr, paged_kv_indices,
                        paged_kv_last_page_len, *, kv_layout: str = "NHD", return_lse: bool = False,
                        out=None, lse=None, tensor_cores: bool | None = None, stream=0,
                        tuning: PrefillTuning | None = None, custom_mask=None, packed_custom_mask=None,
                        k_scale=None, v_scale=None, **variant):
    """Batch prefill/append over a paged KV cache (golden:
    :func:`nbattn.reference.batch_prefill_paged`).  ``tensor_cores`` forces a
    path (default: tensor cores on a GPU for fp16/bf16); ``tuning`` shapes the
    kernels (default :data:`nbattn.cuda.tuning.PREFILL`).  ``custom_mask`` (bool,
    each request's row-major ``[qo_len, kv_len]`` block flattened and concatenated)
    or ``packed_custom_mask`` (uint8, each block packed little-endian on its own, as
    ``segment_packbits(..., bitorder="little")`` gives) is a runtime mask, read by the
    CUDA-core teaching tile (docs/concepts/custom_mask.md).  An fp8 cache
    (``float8_e4m3fn`` / ``float8_e5m2`` with ``k_scale`` / ``v_scale``) is widened
    to q's dtype, the pages the call reads only (:func:`nbattn.cuda.fp8.widen`)."""
    tuning = check_tuning(tuning, PrefillTuning, PREFILL)
    var = kernel_variant(variant)
    check_return_lse(var, return_lse)
    L.check_same_device(q=q, paged_kv_cache=paged_kv_cache)
    fp8, ks, vs, kind = prefill_kv(q, k_scale, v_scale, paged_kv_cache=paged_kv_cache)
    pkv, dims = L.PagedKV.from_cache(paged_kv_cache, paged_kv_indptr, paged_kv_indices,
                                     paged_kv_last_page_len, kv_layout)
    qo = L.RaggedQ.validate(qo_indptr, total_rows=q.shape[0] if len(q.shape) == 3 else None)
    if qo.batch_size != pkv.batch_size:
        raise L.LayoutError(f"paged_kv_indptr: has {pkv.batch_size} requests, qo_indptr has {qo.batch_size}")
    shape = L.check_q(q, dims.head_dim, rows=qo.total)
    L.check_heads(shape[1], dims.num_kv_heads)
    kv_lens = pkv.kv_lens
    if var.causal:
        L.check_causal_lengths(qo.lengths, kv_lens)
    mask = mask_arrays(custom_mask, packed_custom_mask, qo.lengths, kv_lens, causal=var.causal)
    spec = make_spec("paged", kv_layout, kind, dims.head_dim, shape[1], dims.num_kv_heads, var, tensor_cores,
                     tuning=tuning, custom_mask=mask is not None)
    direct = torch_direct(q, paged_kv_cache, out, lse) and default_stream(stream)
    stream = torch_stream(q.device.index) if direct else resolve_stream(stream, q, paged_kv_cache, out, lse)
    outs = Outputs(q, shape, kind, out, lse, return_lse, stream, direct)
    work = build_work(qo.qo_indptr[:-1], qo.lengths, pkv.paged_kv_indptr[:-1],
                      np.zeros(qo.batch_size, np.int32), kv_lens, spec.group, spec.tile_q)
    indices = pkv.paged_kv_indices
    if fp8 is None:
        cache = device_in(paged_kv_cache, "paged_kv_cache", kind, stream, direct)
    else:       # the pages read, widened in order: page j of the scratch cache is indices[j]
        indices = indices[:int(pkv.paged_kv_indptr[-1])]
        cache = widen(paged_kv_cache, "paged_kv_cache", fp8, kind, ks, vs, stream, direct, pages=indices)
        indices = np.arange(len(indices), dtype=np.int32)
    launch(spec, device_in(q, "q", kind, stream, direct), cache, cache, indices, work,
           *request_rows(qo, kv_lens), dims.page_size, 0, dims.num_kv_heads, outs.d_out, outs.d_lse, stream, mask)
    return outs.finish()


def batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, *, kv_layout: str = "NHD",
                         return_lse: bool = False, out=None, lse=None,
                         tensor_cores: bool | None = None, stream=0, tuning: PrefillTuning | None = None,
                         custom_mask=None, packed_custom_mask=None, k_scale=None, v_scale=None, **variant):
    """Ragged Q over ragged contiguous KV (golden: :func:`nbattn.reference.batch_prefill_ragged`);
    ``tuning``, ``custom_mask``, ``packed_custom_mask`` and fp8 ``k`` / ``v`` with
    ``k_scale`` / ``v_scale`` as :func:`batch_prefill_paged`'s."""
    tuning = check_tuning(tuning, PrefillTuning, PREFILL)
    var = kernel_variant(variant)
    check_return_lse(var, return_lse)
    L.check_same_device(q=q, k=k, v=v)
    fp8, ks, vs, kind = prefill_kv(q, k_scale, v_scale, k=k, v=v)
    n_kv, hkv, d = contig_dims(k, v, kv_layout)
    qo = L.RaggedQ.validate(qo_indptr, total_rows=q.shape[0] if len(q.shape) == 3 else None)
    kvp = L.RaggedQ.validate(kv_indptr, total_rows=n_kv, name="kv_indptr")
    if kvp.batch_size != qo.batch_size:
        raise L.LayoutError(f"kv_indptr: has {kvp.batch_size} requests, qo_indptr has {qo.batch_size}")
    shape = L.check_q(q, d, rows=qo.total)
    L.check_heads(shape[1], hkv)
    if var.causal:
        L.check_causal_lengths(qo.lengths, kvp.lengths)
    mask = mask_arrays(custom_mask, packed_custom_mask, qo.lengths, kvp.lengths, causal=var.causal)
    spec = make_spec("contig", kv_layout, kind, d, shape[1], hkv, var, tensor_cores, tuning=tuning,
                     custom_mask=mask is not None)
    direct = torch_direct(q, k, v, out, lse) and default_stream(stream)
    stream = torch_stream(q.device.index) if direct else resolve_stream(stream, q, k, v, out, lse)
    outs = Outputs(q, shape, kind, out, lse, return_lse, stream, direct)
    work = build_work(qo.qo_indptr[:-1], qo.lengths, np.zeros(qo.batch_size, np.int32),
                      kvp.qo_indptr[:-1], kvp.lengths, spec.group, spec.tile_q)
    if fp8 is None:
        k_dev, v_dev = device_in(k, "k", kind, stream, direct), device_in(v, "v", kind, stream, direct)
    else:
        k_dev = widen(k, "k", fp8, kind, ks, ks, stream, direct)
        v_dev = widen(v, "v", fp8, kind, vs, vs, stream, direct)
    launch(spec, device_in(q, "q", kind, stream, direct), k_dev, v_dev, np.zeros(1, np.int32), work,
           *request_rows(qo, kvp.lengths), 1, n_kv, hkv, outs.d_out, outs.d_lse, stream, mask)
    return outs.finish()


def single_prefill(q, k, v, *, kv_layout: str = "NHD", return_lse: bool = False, out=None, lse=None,
                   tensor_cores: bool | None = None, stream=0, tuning: PrefillTuning | None = None,
                   custom_mask=None, packed_custom_mask=None, k_scale=None, v_scale=None, **variant):
    """One request over contiguous KV (golden: :func:`nbattn.reference.single_prefill`);
    ``tuning`` and fp8 ``k`` / ``v`` as :func:`batch_prefill_ragged`'s; ``custom_mask``
    bool ``[qo_len, kv_len]`` (or flattened), or ``packed_custom_mask`` its bits packed
    little-endian."""
    tuning = check_tuning(tuning, PrefillTuning, PREFILL)
    n_kv = contig_dims(k, v, kv_layout)[0]
    if len(q.shape) != 3:
        L.check_q(q, int(k.shape[-1]))
    nq = int(q.shape[0])
    var = kernel_variant(dict(variant))
    if var.causal:
        L.check_causal_lengths(np.array([nq]), np.array([n_kv]), name="q")
    if custom_mask is not None:     # the [qo_len, kv_len] form is checked here, then flattened
        custom_mask = request_masks(custom_mask, packed_custom_mask, [nq], [n_kv], causal=var.causal,
                                    single=True)[0].ravel()
    return batch_prefill_ragged(q, k, v, np.array([0, nq], np.int32), np.array([0, n_kv], np.int32),
                                kv_layout=kv_layout, return_lse=return_lse, out=out, lse=lse,
                                tensor_cores=tensor_cores, stream=stream, tuning=tuning,
                                custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
                                k_scale=k_scale, v_scale=v_scale, **variant)

