"""The golden model: every attention form nbattn computes, in plain NumPy.

Readable first, fast enough second: each function gathers a request's keys
(a loop over requests), then does two batched matmuls and one softmax for all
heads at once (no loop over tokens or heads).  Scores are computed in ``dtype``
(float32 by default, float64 for brute-force checks).

Shapes (FlashInfer's): ``q: [rows, num_qo_heads, head_dim]``; contiguous
``k, v: [kv_len, num_kv_heads, head_dim]`` ("NHD") or
``[num_kv_heads, kv_len, head_dim]`` ("HND"); paged cache
``[num_pages, 2, page_size, num_kv_heads, head_dim]`` ("NHD") or
``[num_pages, 2, num_kv_heads, page_size, head_dim]`` ("HND").
Outputs ``o: [rows, num_qo_heads, head_dim]`` and, with ``return_lse=True``,
the base-2 ``lse: [rows, num_qo_heads]``.

Variant keywords (all functions; see :mod:`nbattn.variants`): ``causal``,
``sm_scale``, ``logits_soft_cap``, ``pos_encoding_mode`` ("NONE"/"ALIBI"/"ROPE_LLAMA", with ``rope_scale``, ``rope_theta``),
``window_left``, ``sink_size``, ``use_sigmoid``, ``sigmoid_bias``,
``score_mod``, ``mask_mod`` -- or a ready ``variant=Variant(...)``.
The prefill forms (``single_prefill``, ``batch_prefill_ragged``,
``batch_prefill_paged``) also take a runtime ``custom_mask`` or
``packed_custom_mask`` (:mod:`nbattn.reference.custom_mask`).  The softmax
forms (all but ``split_kv``) take learnable attention ``sinks``
(:mod:`nbattn.reference.sinks`): one logit per query head, merged once into
every row's final state.  The contiguous and paged forms (not ``block_sparse``,
``cascade``, ``split_kv``) also read fp8 K/V (torch ``float8_e4m3fn`` /
``float8_e5m2``) with scalar ``k_scale`` / ``v_scale`` (:mod:`nbattn.reference.fp8`).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .. import layout as L
from ..variants import Variant, check_return_lse, unknown_keywords_message, variant_from_kwargs
from .custom_mask import check_mask_choice, request_masks
from .fp8 import check_kv_dtypes, check_no_fp8, dequantize, dequantize_cache, kv_scales, reject_fp8
from .masks import keep_mask, transform_logits
from .rotary import rope_angles, rotate
from .sinks import apply_sinks, check_sinks
from .state import LN2, AttentionState, merge_states

__all__ = [
    "attend", "single_prefill", "single_decode", "batch_prefill_ragged", "batch_prefill_paged",
    "batch_decode_paged", "block_sparse", "cascade", "split_kv", "float_input",
]


# ---------------------------------------------------------------------------
# The one kernel every form calls
# ---------------------------------------------------------------------------

def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, kv_pos: np.ndarray,
           variant: Variant, *, b: int = 0, dtype=np.float32,
           keep: np.ndarray | None = None) -> AttentionState:
    """Attention state of one request over one key set.

    ``q: [Q, Hq, D]``, ``k, v: [K, Hkv, D]``; ``q_pos: [Q]`` and ``kv_pos: [K]``
    are sequence positions; ``keep`` an optional extra boolean ``[Q, K]`` mask
    (block sparsity).  Returns ``o: [Q, Hq, D]`` and base-2 ``lse: [Q, Hq]``
    (for sigmoid attention ``lse`` is all NaN: there is none).

    The NaN rule (docs/bad_input.md): a key is *visible* to a row when every
    mask keeps it.  A visible key whose raw score ``q . k * sm_scale`` is not
    finite, whose V holds a non-finite element, or whose final score is NaN
    (or +inf, softmax only) makes the row NaN (o and lse).  Invisible keys are
    skipped, never weighted by 0.  A row with no visible key, or whose visible
    keys all score -inf, is ``o = 0, lse = -inf``.
    """
    nq, hq, d = q.shape
    nk, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    if nq == 0 or nk == 0:
        return AttentionState(np.zeros((nq, hq, d), dtype), np.full((nq, hq), -np.inf, dtype))
    if variant.has_rope:
        # RoPE at attention time: q turns by its position, each key by its position in the
        # request (the cache holds keys unrotated), in float64, before any score.
        q = rotate(q, rope_angles(q_pos, d, variant.rope_scale, variant.rope_theta), d, False)
        k = rotate(k, rope_angles(kv_pos, d, variant.rope_scale, variant.rope_theta), d, False)
    # GQA: fold the heads of one KV group into rows so each K/V head is read once.
    qf = q.astype(dtype, copy=False).reshape(nq, hkv, group, d).transpose(1, 2, 0, 3).reshape(hkv, group * nq, d)
    kf = k.astype(dtype, copy=False).transpose(1, 2, 0)          # [Hkv, D, K]
    vf = v.astype(dtype, copy=False).transpose(1, 0, 2)          # [Hkv, K, D]
    v_bad = ~np.isfinite(vf).all(axis=-1)                        # [Hkv, K]: a non-finite V element
    if v_bad.any():
        vf = np.where(np.isfinite(vf), vf, dtype(0))             # its weight never meets it
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.matmul(qf, kf)                                    # [Hkv, g*Q, K]
        s *= dtype(variant.scale(d))
    s = s.reshape(hq, nq, nk)                                    # head h = kv*g + gi
    bad = ~np.isfinite(s) | np.repeat(v_bad, group, axis=0)[:, None, :]   # [Hq, Q, K]
    heads = np.arange(hq)
    with np.errstate(invalid="ignore", over="ignore"):
        s = transform_logits(s, variant, b, heads, q_pos, kv_pos)
    bad |= np.isnan(s)
    if not variant.use_sigmoid:
        bad |= np.isposinf(s)
    mask = keep_mask(variant, b, heads, q_pos, kv_pos)
    if keep is not None:
        mask = keep[None] if mask is None else (mask & keep[None])
    if mask is not None:
        bad &= mask
    poisoned = bad.any(axis=-1)                                  # [Hq, Q]
    visible = ~bad if mask is None else (mask & ~bad)
    s = np.where(visible, s, -np.inf).astype(dtype, copy=False)
    if variant.use_sigmoid:
        with np.errstate(over="ignore"):
            p = np.where(visible, 1.0 / (1.0 + np.exp(-(s + dtype(variant.sigmoid_bias)))), 0.0)
        o = np.matmul(p.reshape(hkv, group * nq, nk).astype(dtype, copy=False), vf).reshape(hq, nq, d)
        o[poisoned] = np.nan
        o = o.reshape(hkv, group, nq, d).transpose(2, 0, 1, 3).reshape(nq, hq, d)
        return AttentionState(o, np.full((nq, hq), np.nan, dtype))
    m = s.max(axis=-1, keepdims=True)
    nz = ~np.isneginf(m[..., 0])                                 # the row sees a key (a flag, not l > 0)
    m_safe = np.where(np.isneginf(m), 0.0, m).astype(dtype)     # fully masked row: no -inf - -inf
    p = np.exp(s - m_safe, out=s)                                # invisible keys become exactly 0
    l = p.sum(axis=-1)                                           # [Hq, Q]
    o = np.matmul(p.reshape(hkv, group * nq, nk), vf).reshape(hq, nq, d)
    o *= np.where(nz, 1.0 / np.where(nz, l, 1.0), 0.0).astype(dtype)[..., None]
    lse = np.where(nz, (m_safe[..., 0] + np.log(np.where(nz, l, 1.0))) / LN2, -np.inf).astype(dtype)
    o[poisoned] = np.nan
    lse[poisoned] = np.nan
    o = o.reshape(hkv, group, nq, d).transpose(2, 0, 1, 3).reshape(nq, hq, d)
    return AttentionState(o, lse.T.copy())


# ---------------------------------------------------------------------------
# Argument handling shared by the public forms
# ---------------------------------------------------------------------------

def float_input(name: str, x: Any) -> np.ndarray:
    """A floating-point input as a host NumPy array (bf16 widened exactly to float32);
    fp8 and non-float inputs raise a LayoutError naming ``name``."""
    if L.dtype_of(x).startswith("float8"):
        reject_fp8(name, x)
    arr = L.to_numpy(x)
    if arr.dtype.kind == "V" and arr.dtype.itemsize == 2:  # bf16 seen as raw 2 bytes
        arr = (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif arr.dtype.kind != "f":
        raise L.LayoutError(f"{name}: must be a floating-point tensor, got {arr.dtype}")
    return arr


def _contiguous_kv(k: Any, v: Any, kv_layout: str,
                   scales: tuple[float, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``scales``: fp8 K/V (checked), dequantized to float64 with ``(k_scale, v_scale)``."""
    L.check_kv_layout(kv_layout)
    if scales is not None:
        k, v = dequantize(k, scales[0]), dequantize(v, scales[1])
    else:
        k, v = float_input("k", k), float_input("v", v)
    if k.ndim != 3 or k.shape != v.shape:
        raise L.LayoutError(f"v: k and v must both be 3-D with equal shapes, got {k.shape} and {v.shape}")
    if kv_layout == "HND":
        k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    return k, v


def _positions(nq: int, nk: int) -> tuple[np.ndarray, np.ndarray]:
    """Bottom-right aligned positions: query i of Q sits at K - Q + i."""
    return np.arange(nk - nq, nk, dtype=np.int64), np.arange(nk, dtype=np.int64)


def _finish(o: np.ndarray, lse: np.ndarray, return_lse: bool):
    return (o, lse) if return_lse else o


def _kv_scales(q, k_scale, v_scale, **kv) -> tuple[float, float] | None:
    """The dtype rule between q and K/V, then the scales: ``(k_scale, v_scale)``
    for fp8 K/V, None otherwise (where a scale is rejected)."""
    fp8 = check_kv_dtypes(q, **kv)
    what, x = next(iter(kv.items()))
    scales = kv_scales(k_scale, v_scale, fp8, what, L.dtype_of(x))
    return None if fp8 is None else scales


def _no_custom_mask(variant: dict) -> None:
    """The decode forms take no custom mask (as FlashInfer's): refuse it as an unknown keyword."""
    given = {"custom_mask", "packed_custom_mask"} & set(variant)
    if given:
        raise TypeError(unknown_keywords_message(given))


# ---------------------------------------------------------------------------
# Public forms
# ---------------------------------------------------------------------------

def single_prefill(q, k, v, *, kv_layout: str = "NHD", return_lse: bool = False,
                   dtype=np.float32, custom_mask=None, packed_custom_mask=None, sinks=None,
                   k_scale=None, v_scale=None, **variant):
    """One request, contiguous KV: ``q [Q, Hq, D]``, ``k, v [K, Hkv, D]`` (NHD).

    ``custom_mask``: bool ``[Q, K]`` (or flattened ``[Q*K]``), True keeps the key;
    or ``packed_custom_mask``: uint8 ``[ceil(Q*K/8)]``, the same bits as
    ``packbits(custom_mask.ravel(), bitorder="little")`` (docs/concepts/custom_mask.md).
    With either, ``causal`` must be False.

    ``sinks``: float ``[Hq]`` learnable sink logits, or None (docs/concepts/sinks.md);
    the same in every form that takes it.

    ``k``, ``v`` may be torch fp8 (``float8_e4m3fn`` or ``float8_e5m2``, one
    dtype for both) beside a non-fp8 ``q``; they are read as ``k.float() *
    k_scale`` and ``v.float() * v_scale`` (float scales, None = 1.0, given
    for fp8 only: docs/concepts/layouts.md); the same in every form that
    takes them."""
    var = variant_from_kwargs(variant)
    check_return_lse(var, return_lse)
    scales = _kv_scales(q, k_scale, v_scale, k=k, v=v)
    k, v = _contiguous_kv(k, v, kv_layout, scales)
    q = float_input("q", q)
    L.check_q(q, k.shape[2])
    L.check_heads(q.shape[1], k.shape[1])
    cm = request_masks(custom_mask, packed_custom_mask, [q.shape[0]], [k.shape[0]],
                       causal=var.causal, single=True)
    if var.causal:
        L.check_causal_lengths(np.array([q.shape[0]]), np.array([k.shape[0]]), name="q")
    sk = check_sinks(sinks, q.shape[1], var)
    o, lse = attend(q, k, v, *_positions(q.shape[0], k.shape[0]), var, dtype=dtype,
                    keep=None if cm is None else cm[0])
    return _finish(*apply_sinks(o, lse, sk), return_lse)


def single_decode(q, k, v, *, kv_layout: str = "NHD", return_lse: bool = False,
                  dtype=np.float32, sinks=None, k_scale=None, v_scale=None, **variant):
    """One query token: ``q [Hq, D]``; returns ``o [Hq, D]`` (and ``lse [Hq]``)."""
    _no_custom_mask(variant)
    q = float_input("q", q)
    if q.ndim != 2:
        raise L.LayoutError(f"q: must have shape [num_qo_heads, head_dim], got {q.shape}")
    out = single_prefill(q[None], k, v, kv_layout=kv_layout, return_lse=return_lse, dtype=dtype,
                         sinks=sinks, k_scale=k_scale, v_scale=v_scale, **variant)
    return (out[0][0], out[1][0]) if return_lse else out[0]


def batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, *, kv_layout: str = "NHD",
                         return_lse: bool = False, dtype=np.float32, custom_mask=None,
                         packed_custom_mask=None, sinks=None, k_scale=None, v_scale=None, **variant):
    """Ragged Q and ragged contiguous KV: request r's keys are
    ``k[kv_indptr[r]:kv_indptr[r+1]]``.

    ``custom_mask``: bool, flattened: request r's row-major ``[qo_len[r], kv_len[r]]``
    blocks concatenated (length ``sum(qo_len[r] * kv_len[r])``), True keeps the key;
    or ``packed_custom_mask``: uint8, each request's block packed on its own as
    ``segment_packbits`` gives (docs/concepts/custom_mask.md).  With either,
    ``causal`` must be False."""
    var = variant_from_kwargs(variant)
    check_return_lse(var, return_lse)
    scales = _kv_scales(q, k_scale, v_scale, k=k, v=v)
    k, v = _contiguous_kv(k, v, kv_layout, scales)
    q = float_input("q", q)
    qo = L.RaggedQ.validate(qo_indptr, total_rows=q.shape[0] if q.ndim == 3 else None)
    kv = L.RaggedQ.validate(kv_indptr, total_rows=k.shape[0], name="kv_indptr")
    if kv.batch_size != qo.batch_size:
        raise L.LayoutError(f"kv_indptr: has {kv.batch_size} requests, qo_indptr has {qo.batch_size}")
    L.check_q(q, k.shape[2], rows=qo.total)
    L.check_heads(q.shape[1], k.shape[1])
    cm = request_masks(custom_mask, packed_custom_mask, qo.lengths, kv.lengths, causal=var.causal)
    if var.causal:
        L.check_causal_lengths(qo.lengths, kv.lengths)
    sk = check_sinks(sinks, q.shape[1], var)
    o = np.zeros((q.shape[0], q.shape[1], q.shape[2]), dtype)
    lse = np.full(q.shape[:2], -np.inf, dtype)
    for r in range(qo.batch_size):
        qs = slice(qo.qo_indptr[r], qo.qo_indptr[r + 1])
        ks = slice(kv.qo_indptr[r], kv.qo_indptr[r + 1])
        o[qs], lse[qs] = attend(q[qs], k[ks], v[ks], *_positions(qs.stop - qs.start, ks.stop - ks.start),
                                var, b=r, dtype=dtype, keep=None if cm is None else cm[r])
    return _finish(*apply_sinks(o, lse, sk), return_lse)


def _paged_common(q, paged_kv_cache, qo_indptr, paged_kv_indptr, paged_kv_indices,
                  paged_kv_last_page_len, kv_layout, var, k_scale=None, v_scale=None):
    scales = _kv_scales(q, k_scale, v_scale, paged_kv_cache=paged_kv_cache)
    L.check_same_device(q=q, paged_kv_cache=paged_kv_cache)
    if scales is not None:
        L.cache_dims(paged_kv_cache, kv_layout)         # the shape first, then the (whole) conversion
        cache = dequantize_cache(paged_kv_cache, *scales)
    else:
        cache = float_input("paged_kv_cache", paged_kv_cache)
    pkv, dims = L.PagedKV.from_cache(cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                                     kv_layout)
    q = float_input("q", q)
    qo = L.RaggedQ.validate(qo_indptr, total_rows=q.shape[0] if q.ndim == 3 else None)
    if qo.batch_size != pkv.batch_size:
        raise L.LayoutError(f"paged_kv_indptr: has {pkv.batch_size} requests, qo_indptr has {qo.batch_size}")
    L.check_q(q, dims.head_dim, rows=qo.total)
    L.check_heads(q.shape[1], dims.num_kv_heads)
    if var.causal:
        L.check_causal_lengths(qo.lengths, pkv.kv_lens)
    return q, cache, qo, pkv


def batch_prefill_paged(q, paged_kv_cache, qo_indptr, paged_kv_indptr, paged_kv_indices,
                        paged_kv_last_page_len, *, kv_layout: str = "NHD", return_lse: bool = False,
                        dtype=np.float32, custom_mask=None, packed_custom_mask=None, sinks=None,
                        k_scale=None, v_scale=None, **variant):
    """Batch prefill/append over a paged KV cache.

    ``custom_mask`` / ``packed_custom_mask`` as in :func:`batch_prefill_ragged`,
    with ``kv_len[r]`` request r's paged KV length.  An fp8 ``paged_kv_cache``
    is read with ``k_scale`` / ``v_scale`` as in :func:`single_prefill`."""
    var = variant_from_kwargs(variant)
    check_return_lse(var, return_lse)
    check_mask_choice(custom_mask, packed_custom_mask, causal=var.causal)
    q, cache, qo, pkv = _paged_common(q, paged_kv_cache, qo_indptr, paged_kv_indptr, paged_kv_indices,
                                      paged_kv_last_page_len, kv_layout, var, k_scale, v_scale)
    cm = request_masks(custom_mask, packed_custom_mask, qo.lengths, pkv.kv_lens, causal=var.causal)
    sk = check_sinks(sinks, q.shape[1], var)
    o = np.zeros(q.shape, dtype)
    lse = np.full(q.shape[:2], -np.inf, dtype)
    for r in range(qo.batch_size):
        qs = slice(qo.qo_indptr[r], qo.qo_indptr[r + 1])
        k, v = L.gather_kv(cache, pkv, r, kv_layout)
        o[qs], lse[qs] = attend(q[qs], k, v, *_positions(qs.stop - qs.start, k.shape[0]), var,
                                b=r, dtype=dtype, keep=None if cm is None else cm[r])
    return _finish(*apply_sinks(o, lse, sk), return_lse)


def batch_decode_paged(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                       *, kv_layout: str = "NHD", return_lse: bool = False, dtype=np.float32, sinks=None,
                       k_scale=None, v_scale=None, **variant):
    """One query row per request (``q [batch, Hq, D]``) over a paged KV cache."""
    _no_custom_mask(variant)
    batch = len(L.to_numpy(paged_kv_indptr)) - 1
    qo_indptr = np.arange(batch + 1, dtype=np.int32)
    return batch_prefill_paged(q, paged_kv_cache, qo_indptr, paged_kv_indptr, paged_kv_indices,
                               paged_kv_last_page_len, kv_layout=kv_layout, return_lse=return_lse,
                               dtype=dtype, sinks=sinks, k_scale=k_scale, v_scale=v_scale, **variant)


def block_sparse(q, k, v, bsr: L.BSR, *, kv_layout: str = "NHD", return_lse: bool = False,
                 dtype=np.float32, sinks=None, **variant):
    """Attention restricted to a BSR view: query row i reads key j iff block
    ``(i // B_r, j // B_c)`` is non-zero (``q [M, Hq, D]``, ``k, v [N, Hkv, D]``).
    Variants apply on top (causal is bottom-right aligned over M x N)."""
    var = variant_from_kwargs(variant)
    check_return_lse(var, return_lse)
    check_no_fp8("block_sparse", q=q, k=k, v=v)
    L.check_same_dtype(q=q, k=k, v=v)
    k, v = _contiguous_kv(k, v, kv_layout)
    q = float_input("q", q)
    bsr = L.BSR.check(bsr)
    if bsr.shape != (q.shape[0], k.shape[0]):
        raise L.LayoutError(f"bsr: shape {bsr.shape} does not match (q rows, kv rows) = "
                            f"{(q.shape[0], k.shape[0])}")
    L.check_q(q, k.shape[2])
    L.check_heads(q.shape[1], k.shape[1])
    if var.causal:      # as the dense forms: a causal request has no more queries than keys
        L.check_causal_lengths(np.array([q.shape[0]]), np.array([k.shape[0]]), name="q")
    sk = check_sinks(sinks, q.shape[1], var)
    o, lse = attend(q, k, v, *_positions(q.shape[0], k.shape[0]), var, dtype=dtype,
                    keep=bsr.to_element_mask())
    return _finish(*apply_sinks(o, lse, sk), return_lse)


def split_kv(q, k, v, kv_chunk_indptr, *, kv_layout: str = "NHD", return_lse: bool = False,
             return_partials: bool = False, dtype=np.float32, **variant):
    """FlashDecoding: attend each KV chunk ``[kv_chunk_indptr[c], kv_chunk_indptr[c+1])``
    of one request separately, then merge the partial states in chunk order
    (docs/concepts/state.md).  Sigmoid partial outputs are summed instead.

    With ``return_partials=True`` also returns the partial states
    ``(o [Q, n_chunks, Hq, D], lse [Q, n_chunks, Hq])``.
    """
    var = variant_from_kwargs(variant)
    check_return_lse(var, return_lse)
    check_no_fp8("split_kv", q=q, k=k, v=v)
    k, v = _contiguous_kv(k, v, kv_layout)
    q = float_input("q", q)
    L.check_q(q, k.shape[2])
    L.check_heads(q.shape[1], k.shape[1])
    chunks = L.check_indptr("kv_chunk_indptr", kv_chunk_indptr, total=k.shape[0], total_name="kv length")
    if var.causal:
        L.check_causal_lengths(np.array([q.shape[0]]), np.array([k.shape[0]]), name="q")
    q_pos, kv_pos = _positions(q.shape[0], k.shape[0])
    parts = [attend(q, k[a:z], v[a:z], q_pos, kv_pos[a:z], var, dtype=dtype)
             for a, z in zip(chunks[:-1], chunks[1:])]
    po = np.stack([p.o for p in parts], axis=1) if parts else np.zeros((q.shape[0], 0) + q.shape[1:], dtype)
    pl = np.stack([p.lse for p in parts], axis=1) if parts else np.zeros((q.shape[0], 0, q.shape[1]), dtype)
    if var.use_sigmoid:
        o, lse = po.sum(axis=1), np.full(q.shape[:2], np.nan, dtype)
    else:
        o, lse = merge_states(po, pl)
    out = _finish(o, lse, return_lse)
    if return_partials:
        return (out if isinstance(out, tuple) else (out,)) + ((po, pl),)
    return out


def cascade(q, levels: Sequence[Any], paged_kv_cache, *, kv_layout: str = "NHD",
            return_lse: bool = False, dtype=np.float32, sinks=None, **variant):
    """Multi-level cascade attention over composable formats.

    ``levels[l]`` is a :class:`~nbattn.layout.CascadeLevel` (or a tuple
    ``(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)``):
    its block row g makes the query rows ``qo_indptr[g]:qo_indptr[g+1]`` read the
    level's pages for g.  The last level's rows are the requests.  A request's
    keys are the concatenation, level by level, of the pages its rows read;
    each level yields a state and the states are merged in level order.
    ``sinks`` join once, the final merged state (never a level's).
    """
    var = variant_from_kwargs(variant)
    check_return_lse(var, return_lse)
    check_no_fp8("cascade", q=q, paged_kv_cache=paged_kv_cache)
    L.check_same_dtype(q=q, paged_kv_cache=paged_kv_cache)
    cache = float_input("paged_kv_cache", paged_kv_cache)
    dims = L.cache_dims(cache, kv_layout)
    q = float_input("q", q)
    lv = L.validate_cascade(levels, dims.page_size, dims.num_pages,
                            total_rows=q.shape[0] if q.ndim == 3 else None)
    L.check_q(q, dims.head_dim)
    L.check_heads(q.shape[1], dims.num_kv_heads)
    req_q = lv[-1][0]
    nreq = req_q.batch_size
    group_of, total, offsets = L.cascade_keys(lv)
    if var.causal:
        L.check_causal_lengths(req_q.lengths, total, name=f"levels[{len(lv) - 1}].qo_indptr")
    sk = check_sinks(sinks, q.shape[1], var)
    o = np.zeros(q.shape, dtype)
    lse = np.full(q.shape[:2], -np.inf, dtype)
    for r in range(nreq):
        qs = slice(req_q.qo_indptr[r], req_q.qo_indptr[r + 1])
        q_pos = np.arange(total[r] - (qs.stop - qs.start), total[r], dtype=np.int64)
        states_o, states_l = [], []
        for li, (_, p) in enumerate(lv):
            k, v = L.gather_kv(cache, p, int(group_of[li][r]), kv_layout)
            kv_pos = offsets[li, r] + np.arange(k.shape[0], dtype=np.int64)
            st = attend(q[qs], k, v, q_pos, kv_pos, var, b=r, dtype=dtype)
            states_o.append(st.o)
            states_l.append(st.lse)
        po, pl = np.stack(states_o, axis=1), np.stack(states_l, axis=1)
        if var.use_sigmoid:
            o[qs] = po.sum(axis=1)
            lse[qs] = np.nan
        else:
            o[qs], lse[qs] = merge_states(po, pl)
    return _finish(*apply_sinks(o, lse, sk), return_lse)
