"""Batch decode over a paged KV cache (docs/concepts/layouts.md, masks.md, state.md,
performance.md): one query row per request reads its whole KV history.  This
module is the public operation and its host plumbing (validation, work lists,
launches); the kernels are in :mod:`nbattn.cuda.kernels`.

Work items (FlashDecoding split-KV, and the scheduler's interface)
------------------------------------------------------------------
Every decode kernel runs a *work list* in CSR form over CTAs: CTA ``c`` runs items
``cta_indptr[c]:cta_indptr[c+1]``; item ``i`` attends request ``request[i]``'s
keys ``kv_start[i]:kv_end[i]`` and writes either the final output
(``out_slot[i] == -1``) or a partial state (normalized fp32 output + base-2
LSE) into slot ``out_slot[i]`` of ``partial_o [slots, num_qo_heads, head_dim]``
/ ``partial_lse [slots, num_qo_heads]``.  :mod:`nbattn.cuda.merge` then
contracts partial slots in the order a reduction map gives.  Positions stay the
request's: the query sits at ``kv_len - 1`` and key j at ``j`` whatever chunk
it falls in, so masks and ALiBi are chunk-independent.

Three paths
-----------
* ``"smem"``: :mod:`nbattn.cuda.kernels.decode_smem`, the teaching kernel (KV
  tiles gathered into shared memory); the simulator's path and the fallback.
* ``"warp"``: :mod:`nbattn.cuda.kernels.decode_warp`, the same work list with no
  block barrier in its main loop; picked on a GPU whenever the head dimension
  maps onto a warp (16-byte chunks, power-of-two lanes per token) and the
  arrays are 16-byte aligned.
* ``"tc"``: :mod:`nbattn.cuda.kernels.decode_tc`, ``mma.sync`` with the group's
  heads as one operand, for GQA groups of at least ``DecodeTuning.tc_min_group``
  heads, fp16/bf16, head_dim 32..128 and softmax variants (GPU only); an fp8
  cache too, with head_dim 64 or 128 on a GPU of compute capability 8.9 or later
  (:func:`~nbattn.cuda.kernels.decode_common.tc_eligible`, :mod:`nbattn.cuda.fp8`).

:func:`~nbattn.cuda.kernels.decode_common.make_config` picks one;
``tuning=DECODE.replace(path=...)`` (:class:`nbattn.cuda.tuning.DecodeTuning`)
forces it, falling back to ``"smem"`` where the path is not eligible.  Forcing
``"warp"`` under the simulator runs it with emulated shuffles (tests).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from numba import cuda

from .. import layout as L
from ..variants import alibi_slopes, check_return_lse
from .decode_call import fast_decode
from .fp8 import kv_fp8
from .decode_problem import (KERNELS, MAX_HEAD_DIM, DecodeProblem, aligned_16, check_head_dim, check_out,
                             choose_chunk, decode_arg_index, decode_kernel, decode_launch, launch_for,
                             first_visible, launches_programmatically, split_rule, window_edge)
from .blocks.variants import kernel_variant
from .host import arrays as A
from .host.driver import launch_programmatic
from .kernels.decode_common import DecodeConfig, WorkList, heads_per_cta, make_config
from .tuning import DECODE, PREFILL, DecodeTuning, PrefillTuning, check_tuning

__all__ = ["batch_decode_paged", "single_decode", "DecodeProblem", "WorkList", "prepare_decode", "run_decode_work",
           "decode_launch", "launch_for", "decode_arg_index", "split_work", "split_rule", "split_runner",
           "choose_chunk", "run_split", "finish_decode", "decode_kernel", "DecodeConfig", "make_config",
           "heads_per_cta", "launches_programmatically", "check_head_dim", "check_out", "aligned_16",
           "upload_int32", "KERNELS", "MAX_HEAD_DIM"]


# ---------------------------------------------------------------------------
# Validation and device arrays: everything checked before any launch
# ---------------------------------------------------------------------------

def prepare_decode(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                   *, kv_layout="NHD", return_lse=False, out=None, lse=None, tuning=None,
                   k_scale=None, v_scale=None, **variant) -> DecodeProblem:
    """Validate every argument (nothing is launched or modified on error) and
    bring the arrays to the device; ``tuning``: a :class:`~nbattn.cuda.tuning.DecodeTuning`
    (None: ``DECODE``); ``k_scale`` / ``v_scale``: an fp8 cache's scales (:mod:`nbattn.cuda.fp8`)."""
    tuning = check_tuning(tuning, DecodeTuning, DECODE)
    var = kernel_variant(dict(variant))
    check_return_lse(var, return_lse)
    L.check_kv_layout(kv_layout)
    fp8, k_scale, v_scale = kv_fp8(q, k_scale, v_scale, paged_kv_cache=paged_kv_cache)
    code = A.dtype_code(q, "q")
    if fp8 is None and A.dtype_code(paged_kv_cache, "paged_kv_cache") != code:
        raise L.LayoutError(f"paged_kv_cache: dtype must match q, got q={L.dtype_of(q)}, "
                            f"paged_kv_cache={L.dtype_of(paged_kv_cache)}")
    L.check_same_device(q=q, paged_kv_cache=paged_kv_cache, out=out, lse=lse)
    kind = A.kind_of(q)
    if A.is_device_kind(kind) != A.is_device_kind(A.kind_of(paged_kv_cache)):
        raise L.LayoutError(f"paged_kv_cache: must live where q lives ({kind}), "
                            f"got {A.kind_of(paged_kv_cache)}")
    host = {n: A.host_meta(n, x) for n, x in (("paged_kv_indptr", paged_kv_indptr),
                                              ("paged_kv_indices", paged_kv_indices),
                                              ("paged_kv_last_page_len", paged_kv_last_page_len))}
    pkv, dims = L.PagedKV.from_cache(paged_kv_cache, host["paged_kv_indptr"], host["paged_kv_indices"],
                                     host["paged_kv_last_page_len"], kv_layout)
    check_head_dim(dims.head_dim, fp8)
    L.check_q(q, dims.head_dim, rows=pkv.batch_size)
    L.check_heads(int(q.shape[1]), dims.num_kv_heads)
    if var.causal:
        L.check_causal_lengths(np.ones(pkv.batch_size, np.int64), pkv.kv_lens, name="q")
    shape = tuple(int(s) for s in q.shape)
    if out is not None:
        check_out("out", out, shape, code, kind)
    if lse is not None:
        check_out("lse", lse, shape[:2], None, kind)
    if A.is_device_kind(kind):
        A.check_contiguous(q, "q")
        A.check_contiguous(paged_kv_cache, "paged_kv_cache")

    # -- all checks passed: device arrays (zero-copy for device inputs) --
    stream = A.launch_stream(q, paged_kv_cache, out, lse)
    q_dev = A.to_device(q, "q", stream, code)
    kv_dev = A.to_device(paged_kv_cache, "paged_kv_cache", stream, fp8 or code)
    meta = [A.device_meta(x, host[n], stream) for n, x in (("paged_kv_indptr", paged_kv_indptr),
                                                           ("paged_kv_indices", paged_kv_indices),
                                                           ("paged_kv_last_page_len", paged_kv_last_page_len))]
    out_user, out_dev = A.output_for("out", out, kind, shape, code, stream, like=q)
    lse_user, lse_dev = A.output_for("lse", lse, kind, shape[:2], "f32", stream, like=q)
    slopes = alibi_slopes(shape[1]) if var.has_alibi else np.zeros(shape[1], np.float32)
    q_w, kv_w = A.words(q_dev), A.words(kv_dev)
    return DecodeProblem(code, kind, stream, var, var.scale(dims.head_dim) * k_scale, pkv.batch_size, shape[1],
                         dims.num_kv_heads, dims.head_dim, dims.page_size, kv_layout,
                         pkv.kv_lens.astype(np.int32), q_w, kv_w, *meta,
                         cuda.to_device(slopes, stream=stream), out_user, out_dev, lse_user, lse_dev,
                         aligned_16(q_dev, kv_dev), tuning, fp8, v_scale)


# ---------------------------------------------------------------------------
# Work lists: the unsplit list, FlashDecoding chunks, and running them
# ---------------------------------------------------------------------------

def split_work(kv_lens: np.ndarray, kv_chunk_size: int | None, first: np.ndarray | None = None):
    """Host work list and reduction map for fixed-size KV chunks.

    One CTA per item.  A request whose keys from ``first[r]`` (default 0; see
    :func:`~nbattn.cuda.decode_problem.first_visible`) on are more than ``kv_chunk_size``
    becomes ``ceil(len / chunk)`` items writing consecutive partial slots in KV order;
    shorter ones (and empty ones) write their final output directly.
    Returns ``(cta_indptr, request, kv_start, kv_end, out_slot,
    merge_indptr, merge_row, merge_slots, num_slots)`` as int32 NumPy arrays
    (and an int).
    """
    req, ks, ke, slot = [], [], [], []
    m_indptr, m_row, m_slots = [0], [], []
    n_slots = 0
    lens = np.asarray(kv_lens, np.int64)
    first = np.zeros(lens.shape, np.int64) if first is None else np.asarray(first, np.int64)
    for r, (n, lo) in enumerate(zip(lens.tolist(), first.tolist())):
        if kv_chunk_size is None or n - lo <= kv_chunk_size:
            req.append(r); ks.append(lo); ke.append(n); slot.append(-1)
            continue
        starts = range(lo, n, int(kv_chunk_size))
        for a in starts:
            req.append(r); ks.append(a); ke.append(min(int(n), a + int(kv_chunk_size)))
            slot.append(n_slots); m_slots.append(n_slots); n_slots += 1
        m_row.append(r)
        m_indptr.append(len(m_slots))
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return (np.arange(len(req) + 1, dtype=np.int32), i32(req), i32(ks), i32(ke), i32(slot),
            i32(m_indptr), i32(m_row), i32(m_slots), n_slots)


def run_decode_work(p: DecodeProblem, work: WorkList, partial_o=None, partial_lse=None,
                    programmatic: bool = False) -> None:
    """Launch :func:`decode_launch`'s kernel, asynchronously on ``p.stream``.

    ``programmatic=True`` launches with programmatic stream serialization (FlashInfer's
    ``enable_pdl``): the CTAs may start while the stream's previous kernel ends and read
    the work list meanwhile (``decode_common.work_item`` waits after it), so the work list
    must not be written by a kernel just before (``split_runner`` uploads its own once).
    """
    launch = decode_launch(p, work, partial_o, partial_lse, prefetch=programmatic)
    if launch is None:
        return
    kern, grid, threads, args = launch
    if not (programmatic and launch_programmatic(kern, grid, threads, p.stream, args)):
        kern[grid, threads, p.stream](*args)


def upload_int32(stream, *arrays):
    """Each host array as a new int32 device array, copied on ``stream``."""
    return [cuda.to_device(np.ascontiguousarray(a, dtype=np.int32), stream=stream) for a in arrays]


def split_runner(p: DecodeProblem, kv_chunk_size: int | None) -> Callable[[], None]:
    """Upload the work list of fixed-size KV chunks (None: unsplit) and the
    partial buffers once; the returned function launches the decode and, for
    split requests, the merge of their partials in KV order, on ``p.stream`` as
    it is when called (so it can be captured in a CUDA graph and replayed).  The
    merge of up to ``MergeTuning.few_partials`` partials a row is launched
    programmatically: it starts while the decode kernel runs and waits for the
    partials on the device.  So is the decode kernel in its small-batch shape
    (:func:`launches_programmatically`): its CTAs start while the previous kernel
    on the stream (a previous step's merge, say) ends, and read this work list
    before they wait for it.  Both follow ``p.tuning``."""
    from .merge import MergeMap, run_merge_partials

    first = first_visible(p.kv_lens, window_edge(p.variant), split_rule(p.config(), p.batch, p.num_qo_heads)[2])
    (cta_indptr, req, ks, ke, slot, m_indptr, m_row, m_slots, n_slots) = split_work(
        p.kv_lens, kv_chunk_size, first)
    work = WorkList(*upload_int32(p.stream, cta_indptr, req, ks, ke, slot))
    # allocated here, not per launch: a launch inside a CUDA-graph capture must not allocate
    po = cuda.device_array((max(n_slots, 1), p.num_qo_heads, p.head_dim), np.float32, stream=p.stream)
    pl = cuda.device_array((max(n_slots, 1), p.num_qo_heads), np.float32, stream=p.stream)
    cfg = p.config()
    pdl = launches_programmatically(cfg)
    if n_slots == 0:
        return lambda: run_decode_work(p, work, po, pl, pdl)
    mmap = MergeMap(*upload_int32(p.stream, m_indptr, m_row, m_slots))
    most = int(np.diff(m_indptr).max())

    def run() -> None:
        run_decode_work(p, work, po, pl, pdl)
        run_merge_partials(po, pl, mmap, p.out_dev, p.lse_dev, code=p.code,
                           use_sigmoid=p.variant.use_sigmoid, max_partials=most, stream=p.stream,
                           tuning=cfg.tuning.merge)
    return run


def run_split(p: DecodeProblem, kv_chunk_size: int | None) -> None:
    """Decode with fixed-size KV chunks (None: unsplit), merging partials in KV order."""
    split_runner(p, kv_chunk_size)()


def finish_decode(p: DecodeProblem, return_lse: bool, out=None, lse=None):
    """Copy host results back (host kinds) or hand back the device objects."""
    return A.finish_results(p.kind, p.code, p.stream, out, p.out_user, p.out_dev, lse, p.lse_user,
                            p.lse_dev, return_lse)


def batch_decode_paged(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                       *, kv_layout="NHD", return_lse=False, out=None, lse=None, tuning=None,
                       k_scale=None, v_scale=None, **variant):
    """One query row per request over a paged KV cache; same arguments as
    :func:`nbattn.reference.batch_decode_paged` plus optional ``out=``/``lse=`` and
    ``tuning`` (a :class:`~nbattn.cuda.tuning.DecodeTuning`; None: ``DECODE``).

    The cache may be fp8 (torch ``float8_e4m3fn`` / ``float8_e5m2``, head_dim a
    multiple of 16) with scalar ``k_scale`` / ``v_scale`` (None: 1.0) and q in
    float16, bfloat16 or float32: keys read as ``k.float() * k_scale``, values as
    ``v.float() * v_scale``, dequantized in registers (:mod:`nbattn.cuda.fp8`).

    Returns ``o [batch, num_qo_heads, head_dim]`` in q's dtype (and the base-2
    ``lse [batch, num_qo_heads]`` float32 with ``return_lse=True``), of q's kind.
    Splits long requests into KV chunks when the batch alone cannot fill the GPU.
    Device inputs take the launch layer (:mod:`nbattn.cuda.decode_call`): the page
    table is validated and uploaded once per call and the kernels are launched
    through launches bound once per configuration.
    """
    tuning = check_tuning(tuning, DecodeTuning, DECODE)
    res = fast_decode(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                      kv_layout=kv_layout, return_lse=return_lse, out=out, lse=lse, variant=variant,
                      tuning=tuning, k_scale=k_scale, v_scale=v_scale)
    if res is not NotImplemented:
        return res
    p = prepare_decode(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                       kv_layout=kv_layout, return_lse=return_lse, out=out, lse=lse, tuning=tuning,
                       k_scale=k_scale, v_scale=v_scale, **variant)
    run_split(p, choose_chunk(p))
    return finish_decode(p, return_lse, out, lse)


def single_decode(q, k, v, *, kv_layout: str = "NHD", return_lse: bool = False, out=None, lse=None,
                  tuning=None, k_scale=None, v_scale=None, **variant):
    """One query token over contiguous KV (golden: :func:`nbattn.reference.single_decode`):
    ``q [num_qo_heads, head_dim]``, ``k, v [kv_len, num_kv_heads, head_dim]`` (NHD).

    A one-row prefill over the contiguous keys, so no page table is built and
    no KV is copied; returns ``o [num_qo_heads, head_dim]`` (and ``lse``).  The
    kernel is the prefill tile, so ``tuning`` is a
    :class:`~nbattn.cuda.tuning.PrefillTuning` (None: ``PREFILL``), and fp8 ``k`` /
    ``v`` with ``k_scale`` / ``v_scale`` are read as :func:`single_prefill` reads them.
    """
    from .prefill import single_prefill

    tuning = check_tuning(tuning, PrefillTuning, PREFILL)
    if len(q.shape) != 2:
        raise L.LayoutError(f"q: must have shape [num_qo_heads, head_dim], got {tuple(q.shape)}")
    row = lambda x: None if x is None else x.reshape((1,) + tuple(x.shape))  # noqa: E731
    res = single_prefill(row(q), k, v, kv_layout=kv_layout, return_lse=return_lse, out=row(out),
                         lse=row(lse), tuning=tuning, k_scale=k_scale, v_scale=v_scale, **variant)
    if return_lse:
        o, s = res
        return o.reshape(tuple(o.shape[1:])), s.reshape(tuple(s.shape[1:]))
    return res.reshape(tuple(res.shape[1:]))
