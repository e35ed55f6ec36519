"""Merging attention states on the GPU (docs/concepts/state.md).

A state over a key set is ``(o, lse)``: the normalized output and the base-2
log-sum-exp.  Merging two disjoint sets weighs each output by its share of the
total exponent mass, normalized *before* combining so nothing overflows:

    m = max(lse_a, lse_b); a = 2^(lse_a - m); b = 2^(lse_b - m)
    o = a/(a+b) * o_a + b/(a+b) * o_b;   lse = m + log2(a + b)

Two empty states (lse = -inf) give an empty state (o = 0, lse = -inf), never
NaN.  A fold is always left to right in the order given -- no atomics -- so the
same inputs give bitwise the same output.  Sigmoid attention has no LSE: its
partial outputs simply add.

This module validates, moves and launches; the kernels are in
:mod:`nbattn.cuda.kernels.merge` (the teaching fold, read it first) and
:mod:`nbattn.cuda.kernels.merge_split` (the split-KV merges).  The split-KV
contraction (:func:`run_merge_partials`) folds many partials per row in two
passes with independent loads; when the caller knows that no merge has more
than ``MergeTuning.few_partials`` partials (split decode, cascade) and
``MergeTuning.few_form`` is on, a one-round form takes over, which split
decode launches programmatically (``MergeTuning.few_programmatic``).

Public (same signatures as :mod:`nbattn.reference`):
    merge_state(v_a, s_a, v_b, s_b) -> AttentionState(o, lse)
    merge_states(v, s)              -> AttentionState(o, lse)     v [rows, n, H, D]
    merge_state_in_place(v, s, v_other, s_other, mask=None) -> None

Internal entry point for split-KV runs (decode, the cascade, the plan/run wrappers):
    MergeMap(merge_indptr, merge_row, merge_slots)   device int32 arrays (CSR)
    run_merge_partials(partial_o, partial_lse, merge_map, out, lse, *, code,
                       use_sigmoid=False, max_partials=None, stream=0, tuning=None)
        out[merge_row[m], h, :] / lse[merge_row[m], h] <- fold over slots
        merge_slots[merge_indptr[m]:merge_indptr[m+1]] of partial_o[slot, h, :]
        (float32 [slots, H, D]) and partial_lse[slot, h] (float32 [slots, H]);
        ``out`` is raw-typed (uint16 for 16-bit floats) [rows, H, D]; ``tuning`` a
        :class:`~nbattn.cuda.tuning.MergeTuning` (None: ``tuning.MERGE``).
    merge_partials_launch(...same arguments, no stream...) -> (kernel, grid, threads, args)
        or None: what run_merge_partials launches, for callers that queue launches
        (nbattn.cuda.prefill.enqueue records them for replay).
    run_merge_tiles(num_merges, merge_indptr, merge_request, merge_qo_tile, merge_slots,
                    qo_indptr, partial_o, partial_lse, out, lse, *, code, head_dim,
                    num_qo_heads, num_kv_heads, group, tile_q, slot_rows, num_ctas,
                    use_sigmoid=False, stream=0)
        the fixed-grid form the prefill wrapper uses (CUDA-graph capturable): grid
        (num_ctas, num_kv_heads) whatever the plan, merge count read on the device
        from ``num_merges[0]``; a merge is one query tile of fused rows (see
        :func:`~nbattn.cuda.kernels.merge_split.tile_merge_kernel`).
    merge_weights                 the device function (la, lb) -> (wa, wb, lse)
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numba import cuda

from ..layout import LayoutError, dtype_of, to_numpy
from ..reference.state import AttentionState
from .blocks.primitives import SIMULATOR
from .blocks.softmax import merge_weights
from .host import arrays as A
from .host.driver import launch_programmatic
from .kernels.merge import KERNELS, fold_kernel, pair_kernel, pair_threads
from .kernels.merge_split import (FEW_CAP, TILE_ROWS_MAX, few_partials_kernel, partials_kernel, partials_threads,
                                  tile_merge_kernel, tile_threads)
from .tuning import MERGE, MergeTuning, check_tuning

__all__ = ["merge_state", "merge_states", "merge_state_in_place", "MergeMap", "run_merge_partials",
           "merge_partials_launch", "merge_tiles_launch", "run_merge_tiles", "tile_merge_kernel", "merge_weights",
           "KERNELS", "TILE_ROWS_MAX"]


class MergeMap(NamedTuple):
    """Reduction map (CSR over merged outputs), device int32 arrays."""
    merge_indptr: Any
    merge_row: Any
    merge_slots: Any


def _partial_vec(po, head_dim: int) -> int:
    """Floats a thread loads at once from the partial outputs: 4 (one 16-byte load) when
    rows are whole vectors and the buffer is 16-byte aligned, else 1."""
    return 4 if head_dim % 4 == 0 and (SIMULATOR or po.__cuda_array_interface__["data"][0] % 16 == 0) else 1


def merge_partials_launch(partial_o, partial_lse, merge_map: MergeMap, out, lse, *, code: str,
                          use_sigmoid: bool = False, max_partials: int | None = None,
                          tuning: MergeTuning | None = None):
    """``(kernel, grid, threads, args)`` of :func:`run_merge_partials`; None when
    there is nothing to merge.  ``max_partials`` (the most partials any merge
    has, when the caller knows it) picks the one-round form for up to
    ``tuning.few_partials`` when ``tuning.few_form`` is on (``tuning``: a
    :class:`~nbattn.cuda.tuning.MergeTuning`, default ``MERGE``)."""
    tuning = check_tuning(tuning, MergeTuning, MERGE)
    if tuning.few_partials > FEW_CAP:
        raise ValueError(f"tuning.few_partials: the one-round merge takes at most {FEW_CAP} partials, "
                         f"got {tuning.few_partials}")
    m = int(merge_map.merge_row.shape[0])
    if m == 0:
        return None
    num_heads, head_dim = int(partial_o.shape[1]), int(partial_o.shape[2])
    po = A.flat(partial_o)
    vec = _partial_vec(po, head_dim)
    if tuning.few_form and max_partials is not None and max_partials <= tuning.few_partials:
        cap = 1 << max(1, int(max_partials) - 1).bit_length()     # builds for 2, 4, ..., 64
        streams = 1 if cap <= 2 else (2 if cap <= 4 else (4 if cap <= 32 else 8))
        k = few_partials_kernel(code, head_dim, bool(use_sigmoid), vec, streams, cap,
                                tuning.few_programmatic)
        nb = 32 * streams
    else:
        nb = partials_threads(int(partial_o.shape[0]) / m)
        k = partials_kernel(code, head_dim, bool(use_sigmoid), vec, nb)
    return k, (m, num_heads), nb, (
        po, A.flat(partial_lse), merge_map.merge_indptr, merge_map.merge_row,
        merge_map.merge_slots, A.flat(out), A.flat(lse), num_heads)


def merge_partials_fixed_launch(num_merges, partial_o, partial_lse, merge_map: MergeMap, out, lse, *,
                                code: str, num_ctas: int, use_sigmoid: bool = False):
    """``(kernel, grid, threads, args)`` of the split-KV contraction on a fixed grid of
    ``num_ctas`` CTAs per head (:func:`~nbattn.cuda.kernels.merge_split.partials_kernel`
    with ``fixed_grid``): the merge count ``num_merges[0]`` is read on the device, so
    one bound launch serves every plan.  One warp a CTA; ``out`` at ``args[6]``,
    ``lse`` at ``args[7]``."""
    num_heads, head_dim = int(partial_o.shape[1]), int(partial_o.shape[2])
    po = A.flat(partial_o)
    vec = _partial_vec(po, head_dim)
    nb = partials_threads(1.0)
    k = partials_kernel(code, head_dim, bool(use_sigmoid), vec, nb, fixed_grid=True)
    return k, (int(num_ctas), num_heads), nb, (
        num_merges, po, A.flat(partial_lse), merge_map.merge_indptr, merge_map.merge_row,
        merge_map.merge_slots, A.flat(out), A.flat(lse), num_heads)


def run_merge_partials(partial_o, partial_lse, merge_map: MergeMap, out, lse, *, code: str,
                       use_sigmoid: bool = False, max_partials: int | None = None, stream=0,
                       tuning: MergeTuning | None = None) -> None:
    """Fold partial slots into final rows (see module doc). Asynchronous on ``stream``."""
    launch = merge_partials_launch(partial_o, partial_lse, merge_map, out, lse, code=code,
                                   use_sigmoid=use_sigmoid, max_partials=max_partials, tuning=tuning)
    if launch is not None:
        kernel, grid, threads, args = launch
        if not (getattr(kernel, "programmatic", False)
                and launch_programmatic(kernel, grid, threads, stream, args)):
            kernel[grid, threads, stream](*args)


def merge_tiles_launch(num_merges, merge_indptr, merge_request, merge_qo_tile, merge_slots, qo_indptr,
                       partial_o, partial_lse, out, lse, *, code: str, head_dim: int, num_qo_heads: int,
                       num_kv_heads: int, group: int, tile_q: int, slot_rows: int, num_ctas: int,
                       use_sigmoid: bool = False):
    """``(kernel, grid, threads, args)`` of
    :func:`~nbattn.cuda.kernels.merge_split.tile_merge_kernel` on its fixed grid
    (see module doc); every array is a flat device array (``out`` raw-typed, at
    ``args[8]``; ``lse`` at ``args[9]``)."""
    if tile_q > TILE_ROWS_MAX:
        raise ValueError(f"tile_q: at most {TILE_ROWS_MAX} rows per merged tile, got {tile_q}")
    k = tile_merge_kernel(code, head_dim, bool(use_sigmoid))
    return k, (num_ctas, num_kv_heads), tile_threads(), (
        num_merges, merge_indptr, merge_request, merge_qo_tile, merge_slots, qo_indptr, partial_o,
        partial_lse, out, lse, num_qo_heads, group, tile_q, slot_rows)


def run_merge_tiles(*args, stream=0, **kw) -> None:
    """Launch :func:`merge_tiles_launch`'s kernel, asynchronously on ``stream``."""
    k, grid, threads, a = merge_tiles_launch(*args, **kw)
    k[grid, threads, stream](*a)


# ---------------------------------------------------------------------------
# Public wrappers: validate, move, launch, return
# ---------------------------------------------------------------------------

def _shape(x) -> tuple:
    return tuple(int(s) for s in x.shape)


def _check_lse_dtype(name: str, s: Any) -> None:
    if dtype_of(s) != "float32":
        raise LayoutError(f"{name}: LSE must be float32, got {dtype_of(s)}")


def _kinds(**arrays) -> str:
    kinds = {n: A.kind_of(x) for n, x in arrays.items() if x is not None}
    dev = {n: A.is_device_kind(k) for n, k in kinds.items()}
    if len(set(dev.values())) > 1:
        listing = ", ".join(f"{n} {'device' if d else 'host'}" for n, d in dev.items())
        raise LayoutError(f"{list(kinds)[-1]}: all arrays must be on one device, got {listing}")
    return next(iter(kinds.values()))


def _empty_check(head_dim: int, name: str) -> None:
    if head_dim < 1:
        raise LayoutError(f"{name}: head_dim must be >= 1")


def _array_arg(name: str, x) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise LayoutError(f"{name}: must be an array or tensor (NumPy, torch, numba device), "
                          f"got {type(x).__name__}")


def _check_pair(names: tuple[str, str, str, str], v, s, v2, s2) -> str:
    """Dtype code of two states ``(v, s)``, ``(v2, s2)`` that must agree in shape
    and type; ``names`` are the arguments' names for the error messages."""
    nv, ns, nv2, ns2 = names
    for n, x in zip(names, (v, s, v2, s2)):
        _array_arg(n, x)
    if _shape(v) != _shape(v2) or _shape(s) != _shape(s2) or _shape(v)[:-1] != _shape(s):
        raise LayoutError(f"{nv2}: shapes must match, got {nv} {_shape(v)}, {ns} {_shape(s)}, "
                          f"{nv2} {_shape(v2)}, {ns2} {_shape(s2)}")
    code = A.dtype_code(v, nv)
    if A.dtype_code(v2, nv2) != code:
        raise LayoutError(f"{nv2}: dtype must match {nv}, got {dtype_of(v)} and {dtype_of(v2)}")
    _check_lse_dtype(ns, s)
    _check_lse_dtype(ns2, s2)
    return code


def merge_state(v_a, s_a, v_b, s_b) -> AttentionState:
    """Merge the states of two disjoint key sets: ``v [..., D]``, ``s [...]`` (base 2)."""
    code = _check_pair(("v_a", "s_a", "v_b", "s_b"), v_a, s_a, v_b, s_b)
    kind = _kinds(v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b)
    D = _shape(v_a)[-1]
    _empty_check(D, "v_a")
    stream = A.launch_stream(v_a, s_a, v_b, s_b)
    da, db = A.to_device(v_a, "v_a", stream, code), A.to_device(v_b, "v_b", stream, code)
    la, lb = A.to_device(s_a, "s_a", stream, "f32"), A.to_device(s_b, "s_b", stream, "f32")
    o_user, o_dev = A.new_output(kind, _shape(v_a), code, stream, like=v_a)
    l_user, l_dev = A.new_output(kind, _shape(s_a), "f32", stream, like=v_a)
    rows = int(np.prod(_shape(s_a)))
    if rows:
        dummy = cuda.device_array(1, np.uint8, stream=stream)
        pair_kernel(code, D)[rows, pair_threads(D), stream](
            A.flat(da), A.flat(la), A.flat(db), A.flat(lb), A.flat(o_dev), A.flat(l_dev), dummy, False)
    return AttentionState(A.finish(kind, o_user, o_dev, code, stream),
                          A.finish(kind, l_user, l_dev, "f32", stream))


def merge_states(v, s) -> AttentionState:
    """Merge ``num_states`` states per row in axis-1 order:
    ``v [rows, num_states, num_heads, head_dim]``, ``s [rows, num_states, num_heads]``."""
    _array_arg("v", v)
    _array_arg("s", s)
    sv, ss = _shape(v), _shape(s)
    if len(sv) != 4 or ss != sv[:3]:
        raise LayoutError(f"v: must be [rows, num_states, num_heads, head_dim] with s "
                          f"[rows, num_states, num_heads], got {sv} and {ss}")
    code = A.dtype_code(v, "v")
    _check_lse_dtype("s", s)
    kind = _kinds(v=v, s=s)
    rows, n, H, D = sv
    _empty_check(D, "v")
    stream = A.launch_stream(v, s)
    dv, ds = A.to_device(v, "v", stream, code), A.to_device(s, "s", stream, "f32")
    o_user, o_dev = A.new_output(kind, (rows, H, D), code, stream, like=v)
    l_user, l_dev = A.new_output(kind, (rows, H), "f32", stream, like=v)
    if rows and H:
        fold_kernel(code, D)[(rows, H), pair_threads(D), stream](
            A.flat(dv), A.flat(ds), n, H, A.flat(o_dev), A.flat(l_dev))
    return AttentionState(A.finish(kind, o_user, o_dev, code, stream),
                          A.finish(kind, l_user, l_dev, "f32", stream))


def merge_state_in_place(v, s, v_other, s_other, mask=None) -> None:
    """``(v, s) <- merge((v, s), (v_other, s_other))``; rows where the boolean
    ``mask [rows]`` (over the first axis of s) is False are left unchanged."""
    code = _check_pair(("v", "s", "v_other", "s_other"), v, s, v_other, s_other)
    A.check_writeable("v", v)
    A.check_writeable("s", s)
    rows = int(np.prod(_shape(s)))
    lead = _shape(s)[0] if _shape(s) else 1
    if mask is not None and _shape(mask) != (lead,):
        raise LayoutError(f"mask: must be a boolean [rows] with rows = {lead} (the first axis of s), "
                          f"got shape {_shape(mask)}")
    kind = _kinds(v=v, s=s, v_other=v_other, s_other=s_other)   # mask may live on the host
    D = _shape(v)[-1]
    _empty_check(D, "v")
    if A.is_device_kind(kind):
        A.check_contiguous(v, "v")
        A.check_contiguous(s, "s")
    stream = A.launch_stream(v, s, v_other, s_other)
    dv, ds = A.to_device(v, "v", stream, code), A.to_device(s, "s", stream, "f32")
    do, dso = A.to_device(v_other, "v_other", stream, code), A.to_device(s_other, "s_other", stream, "f32")
    if mask is None:
        dmask, use = cuda.device_array(1, np.uint8, stream=stream), False
    else:
        per_row = np.repeat(np.asarray(to_numpy(mask)).astype(np.uint8), rows // max(lead, 1))
        dmask, use = cuda.to_device(np.ascontiguousarray(per_row), stream=stream), True
    if rows:
        pair_kernel(code, D)[rows, pair_threads(D), stream](
            A.flat(dv), A.flat(ds), A.flat(do), A.flat(dso), A.flat(dv), A.flat(ds), dmask, use)
    if not A.is_device_kind(kind):  # host arrays: write the result back into them
        A.copy_into_host(v, dv.copy_to_host(stream=stream).view(A.NP_DTYPE[code]))
        A.copy_into_host(s, ds.copy_to_host(stream=stream))
