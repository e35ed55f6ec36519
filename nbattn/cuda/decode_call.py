"""The plain ``batch_decode_paged`` call on the launch layer.

For device inputs (torch CUDA tensors, numba device arrays) a call does, in
order: the variant from a cache of keyword sets; the page table validated with
vectorized NumPy (:meth:`nbattn.layout.PagedKV.validate`); the work list and
reduction map of :func:`nbattn.cuda.decode.split_work`, computed without a
loop over requests; every int32 array of the call packed into one staging
array and sent with one asynchronous copy; outputs allocated; and the decode
and merge kernels launched through launches bound once per kernel
configuration (:class:`nbattn.cuda._driver.BoundLaunch`), with only pointers,
sizes and the grid patched.  The staging array and its device copy come from
a ring (:class:`nbattn.cuda._driver.StagingRing`), so a call never waits for
the kernels of the call before it.  Host inputs take :func:`nbattn.cuda.decode.prepare_decode`.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from .. import layout as L
from ..variants import check_return_lse, variant_from_kwargs
from . import _arrays as A
from . import decode as DEC
from ._driver import BoundLaunch, Span, StagingRing, data_ptr, sm_count, stream_handle
from .merge import FEW_FORM, FEW_PARTIALS, MergeMap, merge_partials_launch
from .primitives import SIMULATOR

__all__ = ["fast_decode", "split_work_arrays"]

_VARIANTS: dict = {}
_BOUND: dict = {}
_RING = StagingRing()


def _variant(kwargs: dict):
    try:
        key = tuple(sorted(kwargs.items()))
        hit = _VARIANTS.get(key)
    except TypeError:                      # an unhashable keyword value: no cache
        return variant_from_kwargs(dict(kwargs))
    if hit is None:
        hit = _VARIANTS[key] = variant_from_kwargs(dict(kwargs))
    return hit


def split_work_arrays(kv_lens: np.ndarray, chunk: int | None):
    """:func:`nbattn.cuda.decode.split_work` without a loop over requests (same arrays)."""
    lens = np.asarray(kv_lens, np.int64)
    B = lens.size
    if chunk is None or not (lens > chunk).any():           # no request splits: one item each
        i32 = np.int32
        return (np.arange(B + 1, dtype=i32), np.arange(B, dtype=i32), np.zeros(B, i32), lens.astype(i32),
                np.full(B, -1, i32), np.zeros(1, i32), np.zeros(0, i32), np.zeros(0, i32), 0)
    n_items = np.where(lens > chunk, -(-lens // chunk), 1)
    split = n_items > 1
    req = np.repeat(np.arange(B), n_items)
    first = np.cumsum(n_items) - n_items
    j = np.arange(req.size) - first[req]
    c = np.int64(chunk)
    ks = np.where(split[req], j * c, 0)
    ke = np.where(split[req], np.minimum(lens[req], ks + c), lens[req])
    n_split_items = np.where(split, n_items, 0)
    slot_base = np.cumsum(n_split_items) - n_split_items
    slot = np.where(split[req], slot_base[req] + j, -1)
    m_row = np.flatnonzero(split)
    m_indptr = np.concatenate([[0], np.cumsum(n_items[split])])
    m_slots = np.arange(int(n_split_items.sum()))
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return (np.arange(req.size + 1, dtype=np.int32), i32(req), i32(ks), i32(ke), i32(slot),
            i32(m_indptr), i32(m_row), i32(m_slots), int(m_slots.size))


def _choose_chunk(cfg, batch: int, num_qo_heads: int, kv_lens: np.ndarray) -> int | None:
    """:func:`nbattn.cuda.decode.choose_chunk` for a configuration and lengths."""
    ctas = batch * (num_qo_heads // cfg.heads_per_cta)
    slots = (cfg.min_blocks if cfg.path in ("warp", "tc") else 4) * sm_count()
    longest = int(kv_lens.max()) if batch else 0
    if ctas >= slots or longest == 0:
        return None
    splits = max(1, slots // max(ctas, 1))
    grain = 16 if cfg.path == "tc" else cfg.tile_tokens
    floor = (4 if cfg.path == "tc" else 8) * cfg.tile_tokens
    chunk = max(floor, -(-longest // splits))
    chunk = -(-chunk // grain) * grain
    return None if chunk >= longest else chunk


def _alloc(like, kind: str, shape: tuple, code: str):
    if kind == "torch":
        import torch
        dt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[code]
        return torch.empty(shape, dtype=dt, device=like.device)
    return cuda.device_array(shape, A.RAW[code])


def fast_decode(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *,
                kv_layout: str, return_lse: bool, out, lse, variant: dict) -> Any:
    """The call for device ``q`` and cache (see module doc); ``NotImplemented`` when
    the inputs are of another kind (the caller then takes the general path)."""
    kind = A.kind_of(q)
    if kind not in ("torch", "numba") or A.kind_of(paged_kv_cache) != kind:
        return NotImplemented
    if (out is not None and A.kind_of(out) != kind) or (lse is not None and A.kind_of(lse) != kind):
        return NotImplemented
    var = _variant(variant)
    check_return_lse(var, return_lse)
    code = A.dtype_code(q, "q")
    if A.dtype_code(paged_kv_cache, "paged_kv_cache") != code:
        raise L.LayoutError(f"paged_kv_cache: dtype must match q, got q={L.dtype_of(q)}, "
                            f"paged_kv_cache={L.dtype_of(paged_kv_cache)}")
    if kind == "torch":
        if q.device != paged_kv_cache.device:
            raise L.LayoutError(f"paged_kv_cache: must be on q's device ({q.device}), got {paged_kv_cache.device}")
        meta = [m.cpu() if getattr(m, "is_cuda", False) else m           # device metadata: one copy to the host
                for m in (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)]
    else:
        meta = [m.copy_to_host() if hasattr(m, "copy_to_host") else m
                for m in (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)]
    pkv, dims = L.PagedKV.from_cache(paged_kv_cache, *meta, kv_layout)
    DEC._check_head_dim(dims.head_dim)
    shape = L.check_q(q, dims.head_dim, rows=pkv.batch_size)
    group = L.check_heads(shape[1], dims.num_kv_heads)
    for name, x, want, c in (("out", out, shape, code), ("lse", lse, shape[:2], None)):
        if x is not None:
            DEC._check_out(name, x, want, c, kind)
    A.check_contiguous(q, "q")
    A.check_contiguous(paged_kv_cache, "paged_kv_cache")
    if not SIMULATOR and (data_ptr(q) | data_ptr(paged_kv_cache)) % 16:
        return NotImplemented                       # unaligned: the general path picks an unaligned build

    # -- all checks passed: work list, one upload, outputs, launches --
    B, hq, D = shape
    kv_lens = pkv.kv_lens
    cfg = DEC.make_config(code, D, group, kv_layout, var, True, B * dims.num_kv_heads)
    chunk = _choose_chunk(cfg, B, hq, kv_lens)
    (cta, req, ks, ke, slot, m_indptr, m_row, m_slots, n_slots) = split_work_arrays(kv_lens, chunk)
    parts = (pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len, cta, req, ks, ke, slot,
             m_indptr, m_row, m_slots)
    stream = stream_handle(q) if kind == "torch" else 0
    with _RING.lock:                                  # see StagingRing.lock
        stage, spans = _RING.stage(parts, stream)
        o_dev = out if out is not None else _alloc(q, kind, shape, code)
        l_dev = lse if lse is not None else _alloc(q, kind, shape[:2], "f32")
        if n_slots:
            po = _alloc(q, kind, (n_slots, hq, D), "f32")
            pl = _alloc(q, kind, (n_slots, hq), "f32")
        else:                                           # nothing is split: the kernel writes no partial
            po = pl = _unused(q, kind)

        pdl = DEC.DECODE_PROGRAMMATIC and cfg.path == "tc" and cfg.min_blocks == 1
        dec, ix = _bound_decode(cfg, kv_layout, var, q, paged_kv_cache, spans, o_dev, l_dev, po, pl, dims, pdl)
        n_items = int(req.size)
        n_hb = hq // cfg.heads_per_cta
        dec.set_grid(n_items * n_hb if cfg.path in ("warp", "tc") else (n_items, n_hb))
        words = ELEM_WORDS[code]
        dec.set(ix["q"], q)
        dec.set(ix["kv"], paged_kv_cache, int(np.prod(paged_kv_cache.shape)) // words)
        for name, sp in zip(("kv_indptr", "kv_indices", "kv_last", "cta_indptr", "request", "kv_start", "kv_end",
                             "out_slot"), spans):
            dec.set(ix[name], sp, max(sp.n, 1))
        dec.set(ix["out"], o_dev)
        dec.set(ix["lse"], l_dev)
        dec.set(ix["partial_o"], po)
        dec.set(ix["partial_lse"], pl)
        dec.set(ix["slopes"], _slopes(hq, var.has_alibi))
        dec.set_scalar(ix["sm_scale"], var.scale(D))
        dec.set_scalar(ix["sigmoid_bias"], var.sigmoid_bias)
        dec(stream)
        if n_slots:
            most = int(np.diff(m_indptr).max())
            merge = _bound_merge(code, D, hq, var.use_sigmoid, most, po, pl, spans[8:], o_dev, l_dev)
            merge.set_grid((int(m_row.size), hq))
            for i, sp in zip((2, 3, 4), spans[8:]):
                merge.set(i, sp, max(sp.n, 1))
            merge.set(0, po, po_size := int(np.prod(po.shape)))
            merge.set(1, pl, po_size // D)
            merge.set(5, o_dev)
            merge.set(6, l_dev)
            merge(stream)
        stage.done(stream)                               # the slot is reused once these kernels are done
    if kind == "numba" and code == "f16" and out is None:
        o_dev = o_dev.view(np.float16)
    return (o_dev, l_dev) if return_lse else o_dev


ELEM_WORDS = {"f16": 2, "bf16": 2, "f32": 1}
_UNUSED: dict = {}


def _unused(like, kind: str):
    """A one-float device array per device, bound where no partial state is written."""
    key = (kind, str(getattr(like, "device", "")))
    hit = _UNUSED.get(key)
    if hit is None:
        hit = _UNUSED[key] = _alloc(like, kind, (1,), "f32")
    return hit


def _conv(code: str, name: str, words: bool):
    def conv(x):
        if isinstance(x, Span):
            return x.view()
        d = A.to_device(x, name, 0, code)
        return A.words(d) if words else A.flat(d)
    return conv


def _bound_decode(cfg, kv_layout, var, q, cache, spans, o_dev, l_dev, po, pl, dims, pdl):
    hq = int(q.shape[1])
    key = ("decode", cfg, kv_layout, pdl, dims.page_size, dims.num_kv_heads, hq)
    hit = _BOUND.get(key)
    if hit is not None:
        return hit
    code, D = cfg.code, cfg.head_dim
    B = int(q.shape[0])
    views = [sp.view() for sp in spans]
    prob = DEC.DecodeProblem(code, "numba", 0, var, var.scale(D), B, hq, dims.num_kv_heads, D, dims.page_size,
                             kv_layout, np.zeros(B, np.int32), A.words(A.to_device(q, "q", 0, code)),
                             A.words(A.to_device(cache, "paged_kv_cache", 0, code)), *views[:3],
                             _slopes(hq, var.has_alibi), None, A.to_device(o_dev, "out", 0, code), None,
                             A.to_device(l_dev, "lse", 0, "f32"), True)
    work = DEC.WorkList(*views[3:8])
    kern, grid, threads, args = DEC._launch_for(prob, cfg, work, A.to_device(po, "po", 0, "f32"),
                                                A.to_device(pl, "pl", 0, "f32"), prefetch=pdl)
    ix = DEC.decode_arg_index(cfg)
    conv = {ix["q"]: _conv(code, "q", True), ix["kv"]: _conv(code, "paged_kv_cache", True),
            ix["out"]: _conv(code, "out", False), ix["lse"]: _conv("f32", "lse", False),
            ix["partial_o"]: _conv("f32", "po", False), ix["partial_lse"]: _conv("f32", "pl", False)}
    for name in ("kv_indptr", "kv_indices", "kv_last", "cta_indptr", "request", "kv_start", "kv_end", "out_slot"):
        conv[ix[name]] = _conv("f32", name, False)
    hit = _BOUND[key] = (BoundLaunch(kern, grid, threads, args, convert=conv, programmatic=pdl), ix)
    return hit


_SLOPES: dict = {}


def _slopes(hq: int, alibi: bool):
    """ALiBi slopes on the device (zeros when off), one array per head count."""
    key = (hq, alibi)
    hit = _SLOPES.get(key)
    if hit is None:
        hit = _SLOPES[key] = cuda.to_device(DEC.alibi_slopes(hq) if alibi else np.zeros(hq, np.float32))
    return hit


def _bound_merge(code, D, hq, sigmoid, most, po, pl, mspans, o_dev, l_dev):
    vec = 4 if D % 4 == 0 else 1
    few = FEW_FORM and most <= FEW_PARTIALS
    key = ("merge", code, D, hq, sigmoid, vec, (1 << max(1, most - 1).bit_length()) if few else -1)
    hit = _BOUND.get(key)
    if hit is not None:
        return hit
    mmap = MergeMap(*[sp.view() for sp in mspans])
    k, g, t, a = merge_partials_launch(A.to_device(po, "po", 0, "f32"), A.to_device(pl, "pl", 0, "f32"), mmap,
                                       A.to_device(o_dev, "out", 0, code), A.to_device(l_dev, "lse", 0, "f32"),
                                       code=code, use_sigmoid=sigmoid, max_partials=most)
    conv = {0: _conv("f32", "po", False), 1: _conv("f32", "pl", False), 2: _conv("f32", "m", False),
            3: _conv("f32", "m", False), 4: _conv("f32", "m", False), 5: _conv(code, "out", False),
            6: _conv("f32", "lse", False)}
    bl = _BOUND[key] = BoundLaunch(k, g, t, a, convert=conv)
    return bl
