"""The plain ``batch_decode_paged`` call on the launch layer.

For device inputs (torch CUDA tensors, numba device arrays) a call does, in
order: the variant from a cache of keyword sets; the page table checked by one
compiled function (:func:`nbattn.cuda.host.hostwork.page_table_ok`; on a fault
:meth:`nbattn.layout.PagedKV.validate` raises the rule's message); the shape
checks; then, in one staging slot of a ring
(:class:`nbattn.cuda.host.staging.StagingRing`), the page table, the work list and
the reduction map written by one more compiled function
(:func:`nbattn.cuda.host.hostwork.decode_work`, the rules of
:func:`nbattn.cuda.decode_problem.choose_chunk` and :func:`nbattn.cuda.decode.split_work`)
and sent with one asynchronous copy; outputs allocated; and the decode and
merge kernels launched through launches bound once per kernel configuration
(:class:`nbattn.cuda.host.driver.BoundLaunch`), with only pointers, sizes and the
grid patched.  A slot is reused only once the kernels that read it are done,
so a call never waits for the call before it.  Host inputs take
:func:`nbattn.cuda.decode.prepare_decode`.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda

from .. import layout as L
from ..variants import alibi_slopes, check_return_lse
from . import decode_problem as DP
from .blocks.primitives import SIMULATOR
from .blocks.variants import cached_variant
from .fp8 import kv_fp8, is_fp8
from .host import arrays as A
from .host import hostwork as HW
from .host.driver import BoundLaunch, data_ptr, stream_handle
from .host.staging import Span, StagingRing
from .kernels.decode_common import WorkList, make_config
from .merge import MergeMap, merge_partials_launch
from .tuning import DECODE, DecodeTuning

__all__ = ["fast_decode"]

_BOUND: dict = {}
_RING = StagingRing()


def _alloc(like, kind: str, shape: tuple, code: str):
    if kind == "torch":
        import torch
        dt = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[code]
        return torch.empty(shape, dtype=dt, device=like.device)
    return cuda.device_array(shape, A.RAW[code])


class _Call:
    """What the checks of a plain call decided for one input signature (:func:`_signature`):
    everything but the page table, which is checked on every call."""
    __slots__ = ("kind", "var", "fp8", "ks", "vs", "code", "dims", "shape", "cfg", "rule", "pdl", "n_hb",
                 "kv_words", "slopes", "sm_scale", "bound", "merges")


_CALLS: dict = {}


def _signature(q, cache, kind, kv_layout, return_lse, variant, tuning, k_scale, v_scale):
    """What a plain call's checks depend on besides the page table: types, dtypes,
    shapes, devices and contiguity (strides for numba arrays) of q and the cache, and
    the other arguments.  None (no remembering) for scales that are not plain
    numbers (a tensor may change in place), unhashable variant values, or user
    ``score_mod`` / ``mask_mod`` functions (:func:`nbattn.cuda.blocks.variants.frozen_user_fn`)."""
    if not (k_scale is None or type(k_scale) in (float, int)) or not (
            v_scale is None or type(v_scale) in (float, int)):
        return None
    given = variant.get("variant")
    if (variant.get("score_mod") is not None or variant.get("mask_mod") is not None or given is not None
            and (given.score_mod is not None or given.mask_mod is not None)):
        return None                    # user functions: the values they read are checked on every call
    try:
        if kind == "torch":
            key = (type(q), q.dtype, q.shape, q.device, q.is_contiguous(), type(cache), cache.dtype,
                   cache.shape, cache.device, cache.is_contiguous())
        else:
            key = (type(q), q.dtype, q.shape, q.strides, type(cache), cache.dtype, cache.shape, cache.strides)
        key += (kv_layout, return_lse, tuning, k_scale, v_scale, tuple(sorted(variant.items())))
        hash(key)
    except TypeError:
        return None
    return key


def _host_meta(kind, indptr, indices, last):
    """The page table on the host (device metadata: one copy each)."""
    if kind == "torch":
        return [m.cpu() if getattr(m, "is_cuda", False) else m for m in (indptr, indices, last)]
    return [m.copy_to_host() if hasattr(m, "copy_to_host") else m for m in (indptr, indices, last)]


def _checked_call(q, cache, meta, kind, kv_layout, return_lse, out, lse, variant, tuning, k_scale, v_scale):
    """Every check of a plain call, in the order of the general path (nothing launched or
    changed on error); a :class:`_Call`, or NotImplemented for inputs the general path takes."""
    var = cached_variant(variant)
    check_return_lse(var, return_lse)
    fp8, ks, vs = None, 1.0, 1.0
    if k_scale is not None or v_scale is not None or is_fp8(cache) or is_fp8(q):
        fp8, ks, vs = kv_fp8(q, k_scale, v_scale, paged_kv_cache=cache)
    code = A.dtype_code(q, "q")
    if fp8 is None and A.dtype_code(cache, "paged_kv_cache") != code:
        raise L.LayoutError(f"paged_kv_cache: dtype must match q, got q={L.dtype_of(q)}, "
                            f"paged_kv_cache={L.dtype_of(cache)}")
    if kind == "torch" and q.device != cache.device:
        raise L.LayoutError(f"paged_kv_cache: must be on q's device ({q.device}), got {cache.device}")
    dims = L.cache_dims(cache, kv_layout)
    pkv = HW.page_table(*meta, dims.page_size, dims.num_pages)
    B = pkv.batch_size
    DP.check_head_dim(dims.head_dim, fp8)
    shape = L.check_q(q, dims.head_dim, rows=B)
    group = L.check_heads(shape[1], dims.num_kv_heads)
    for name, x, want, c in (("out", out, shape, code), ("lse", lse, shape[:2], None)):
        if x is not None:
            DP.check_out(name, x, want, c, kind)
    A.check_contiguous(q, "q")
    A.check_contiguous(cache, "paged_kv_cache")
    c = _Call()
    c.kind, c.var, c.fp8, c.ks, c.vs, c.code, c.dims, c.shape = kind, var, fp8, ks, vs, code, dims, shape
    hq, D = shape[1], shape[2]
    c.cfg = make_config(code, D, group, kv_layout, var, True, B * dims.num_kv_heads, tuning, fp8)
    c.rule = (*DP.split_rule(c.cfg, B, hq), DP.window_edge(var))     # decode_work's rule and window
    c.pdl = DP.launches_programmatically(c.cfg)
    c.n_hb = hq // c.cfg.heads_per_cta
    c.kv_words = math.prod(cache.shape) // ELEM_WORDS[fp8 or code]
    c.slopes = _slopes(hq, var.has_alibi)
    c.sm_scale = var.scale(D) * ks              # fp8: k_scale joins the score scale
    c.bound, c.merges = None, {}
    return c


def fast_decode(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *,
                kv_layout: str, return_lse: bool, out, lse, variant: dict, tuning: DecodeTuning = DECODE,
                k_scale=None, v_scale=None) -> Any:
    """The call for device ``q`` and cache (see module doc) under ``tuning`` (checked by
    the caller), the cache possibly fp8 with ``k_scale`` / ``v_scale`` (:mod:`nbattn.cuda.fp8`);
    ``NotImplemented`` when the inputs are of another kind (the caller then takes the
    general path).

    A call whose inputs have a signature seen before (:func:`_signature`; ``out`` and
    ``lse`` not given) reuses what its checks decided and checks only the page table."""
    kind = A.kind_of(q)
    if kind not in ("torch", "numba") or A.kind_of(paged_kv_cache) != kind:
        return NotImplemented
    if (out is not None and A.kind_of(out) != kind) or (lse is not None and A.kind_of(lse) != kind):
        return NotImplemented
    meta = _host_meta(kind, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
    key = None
    if out is None and lse is None:
        key = _signature(q, paged_kv_cache, kind, kv_layout, return_lse, variant, tuning, k_scale, v_scale)
    call = _CALLS.get(key) if key is not None else None
    if call is None:
        call = _checked_call(q, paged_kv_cache, meta, kind, kv_layout, return_lse, out, lse, variant, tuning,
                             k_scale, v_scale)
        if key is not None:
            if len(_CALLS) > 256:
                _CALLS.clear()
            _CALLS[key] = call
    if not SIMULATOR and (data_ptr(q) | data_ptr(paged_kv_cache)) % 16:
        return NotImplemented                       # unaligned: the general path picks an unaligned build
    tables = HW.int32_tables(*meta)
    dims, shape, cfg = call.dims, call.shape, call.cfg
    B, hq, D, code = len(tables[0]) - 1, shape[1], shape[2], call.code

    # -- work list and metadata in one staging slot, one upload, outputs, launches --
    stream = stream_handle(q) if kind == "torch" else 0
    with _RING.lock:                                  # see StagingRing.lock
        stage = _RING.take(tables[1].size + 8 * (B + 1) + 64)
        info = HW.decode_call_work(*tables, dims.page_size, dims.num_pages, *call.rule, stage.host.host)
        if info[0] < 0 or B != shape[0]:          # a page-table fault, or another batch: the named message
            HW.page_table(*meta, dims.page_size, dims.num_pages)
            L.check_q(q, dims.head_dim, rows=B)
            raise AssertionError("nbattn: hostwork.decode_call_work and the checks disagree")
        if info[0] > stage.host.host.size:            # a split list longer than the slot: a larger one
            stage = _RING.take(int(info[0]))
            info = HW.decode_call_work(*tables, dims.page_size, dims.num_pages, *call.rule, stage.host.host)
        words, n_items, n_slots, n_merge, most = info[:5].tolist()
        offs, lens = info[6:17].tolist(), info[17:28].tolist()
        np.copyto(stage.host.host[offs[1]:offs[1] + lens[1]], tables[1])     # the page ids (a memcpy)
        stage.send(words, stream)
        o_dev = out if out is not None else _alloc(q, kind, shape, code)
        l_dev = lse if lse is not None else (_alloc(q, kind, shape[:2], "f32") if return_lse
                                             else _scratch(q, kind, shape[:2]))
        po, pl = _partials(q, kind, n_slots, hq, D)
        if call.bound is None or SIMULATOR:
            parts = [Span(stage.dev, stage.dev_ptr, o, n) for o, n in zip(offs, lens)]
        else:                                         # a GPU launch bound before takes addresses
            parts = [stage.dev_ptr + 4 * o for o in offs]
        if call.bound is None:
            call.bound = _bound_decode(cfg, kv_layout, call.var, q, paged_kv_cache, parts, o_dev, l_dev, po, pl,
                                       dims, call.pdl)
        dec, ix = call.bound
        dec.set_grid(n_items * call.n_hb if cfg.path in ("warp", "tc") else (n_items, call.n_hb))
        dec.set(ix["q"], q)
        dec.set(ix["kv"], paged_kv_cache, call.kv_words)
        for name, part, n in zip(HW.DECODE_PARTS[:8], parts, lens):
            dec.set(ix[name], part, max(n, 1))
        dec.set(ix["out"], o_dev)
        dec.set(ix["lse"], l_dev)
        dec.set(ix["partial_o"], po)
        dec.set(ix["partial_lse"], pl)
        dec.set(ix["slopes"], call.slopes)
        dec.set_scalar(ix["sm_scale"], call.sm_scale)
        if call.fp8 is not None:
            dec.set_scalar(ix["v_scale"], call.vs)
        dec.set_scalar(ix["sigmoid_bias"], call.var.sigmoid_bias)
        dec(stream)
        if n_slots:
            merge = call.merges.get(most)
            if merge is None:
                merge = call.merges[most] = _bound_merge(code, D, hq, call.var.use_sigmoid, most, po, pl,
                                                         [Span(stage.dev, stage.dev_ptr, o, n) for o, n in
                                                          zip(offs[8:], lens[8:])], o_dev, l_dev, cfg.tuning.merge)
            merge.set_grid((n_merge, hq))
            for i, part, n in zip((2, 3, 4), parts[8:], lens[8:]):
                merge.set(i, part, max(n, 1))
            merge.set(0, po, po_size := n_slots * hq * D)
            merge.set(1, pl, po_size // D)
            merge.set(5, o_dev)
            merge.set(6, l_dev)
            merge(stream)
        stage.done(stream)                               # the slot is reused once these kernels are done
    if kind == "numba" and code == "f16" and out is None:
        o_dev = o_dev.view(np.float16)
    return (o_dev, l_dev) if return_lse else o_dev


_SCRATCH: dict = {}


def _scratch(like, kind: str, shape: tuple):
    """An LSE the caller does not get: one buffer per device and shape, reused (the
    kernels write it and nothing reads it)."""
    key = (kind, str(getattr(like, "device", "")), shape)
    hit = _SCRATCH.get(key)
    if hit is None:
        hit = _SCRATCH[key] = _alloc(like, kind, shape, "f32")
    return hit


def _partials(like, kind: str, n_slots: int, hq: int, D: int):
    """(partial_o, partial_lse) of a split call; with torch one allocation holds both.
    Nothing split: a one-float array bound where no partial state is written."""
    if not n_slots:
        po = _unused(like, kind)
        return po, po
    if kind == "torch" and not SIMULATOR:
        import torch
        buf = torch.empty(n_slots * hq * (D + 1), dtype=torch.float32, device=like.device)
        return buf[:n_slots * hq * D].view(n_slots, hq, D), buf[n_slots * hq * D:].view(n_slots, hq)
    return _alloc(like, kind, (n_slots, hq, D), "f32"), _alloc(like, kind, (n_slots, hq), "f32")


ELEM_WORDS = {"f16": 2, "bf16": 2, "f32": 1, "e4m3": 4, "e5m2": 4}     # elements a 32-bit word
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
    prob = DP.DecodeProblem(code, "numba", 0, var, var.scale(D), B, hq, dims.num_kv_heads, D, dims.page_size,
                            kv_layout, np.zeros(B, np.int32), A.words(A.to_device(q, "q", 0, code)),
                            A.words(A.to_device(cache, "paged_kv_cache", 0, cfg.kv)), *views[:3],
                            _slopes(hq, var.has_alibi), None, A.to_device(o_dev, "out", 0, code), None,
                            A.to_device(l_dev, "lse", 0, "f32"), True, cfg.tuning)
    work = WorkList(*views[3:8])
    kern, grid, threads, args = DP.launch_for(prob, cfg, work, A.to_device(po, "po", 0, "f32"),
                                              A.to_device(pl, "pl", 0, "f32"), prefetch=pdl)
    ix = DP.decode_arg_index(cfg)
    conv = {ix["q"]: _conv(code, "q", True), ix["kv"]: _conv(cfg.kv, "paged_kv_cache", True),
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
        hit = _SLOPES[key] = cuda.to_device(alibi_slopes(hq) if alibi else np.zeros(hq, np.float32))
    return hit


def _bound_merge(code, D, hq, sigmoid, most, po, pl, mspans, o_dev, l_dev, tuning):
    vec = 4 if D % 4 == 0 else 1
    few = tuning.few_form and most <= tuning.few_partials
    key = ("merge", code, D, hq, sigmoid, vec, (1 << max(1, most - 1).bit_length()) if few else -1, tuning)
    hit = _BOUND.get(key)
    if hit is not None:
        return hit
    mmap = MergeMap(*[sp.view() for sp in mspans])
    k, g, t, a = merge_partials_launch(A.to_device(po, "po", 0, "f32"), A.to_device(pl, "pl", 0, "f32"), mmap,
                                       A.to_device(o_dev, "out", 0, code), A.to_device(l_dev, "lse", 0, "f32"),
                                       code=code, use_sigmoid=sigmoid, max_partials=most, tuning=tuning)
    conv = {0: _conv("f32", "po", False), 1: _conv("f32", "pl", False), 2: _conv("f32", "m", False),
            3: _conv("f32", "m", False), 4: _conv("f32", "m", False), 5: _conv(code, "out", False),
            6: _conv("f32", "lse", False)}
    bl = _BOUND[key] = BoundLaunch(k, g, t, a, convert=conv)
    return bl
