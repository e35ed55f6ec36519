"""Batch decode over a paged KV cache (docs/concepts/layouts.md, masks.md, state.md, performance.md): one query row per
request reads its whole KV history.  Memory-bound, so the design is about
reading each K/V byte once: a CTA owns one (work item, KV head) pair, gathers
each KV tile from its scattered pages into shared memory with 16-byte loads and
uses it for every query head of the GQA group (``group`` heads fused).

Work items (FlashDecoding split-KV, and the scheduler's interface)
------------------------------------------------------------------
The kernel runs a *work list* in CSR form over CTAs: CTA ``c`` runs items
``cta_indptr[c]:cta_indptr[c+1]``; item ``i`` attends request ``request[i]``'s
keys ``kv_start[i]:kv_end[i]`` and writes either the final output
(``out_slot[i] == -1``) or a partial state (normalized fp32 output + base-2
LSE) into slot ``out_slot[i]`` of ``partial_o [slots, num_qo_heads, head_dim]``
/ ``partial_lse [slots, num_qo_heads]``.  :mod:`nbattn.cuda.merge` then
contracts partial slots in the order a reduction map gives.  Positions stay the
request's: the query sits at ``kv_len - 1`` and key j at ``j`` whatever chunk
it falls in, so masks and ALiBi are chunk-independent.

Launch shape
------------
grid ``(num_ctas, num_qo_heads // heads_per_cta)`` (the warp path below
flattens it to 1-D); ``blockIdx.y`` picks a block of ``HG`` query heads of one
KV head (``HG`` = the group, or a divisor of it <= 8).  Block ``NT = NX * NY`` threads: lane ``tx`` of a row owns one
16-byte chunk of head_dim (``VEC`` elements), ``ty`` picks tokens
``ty, ty+NY, ...`` of a tile of ``T = NY * TPT`` tokens.

Per tile: (1) gather K and V into shared memory; (2) each thread dots its
chunk of every head's q (kept in registers) with its tokens' K chunk, partial
sums go to shared memory; (3) one thread per (head, token) adds the partials,
applies scale, variant transform and mask; (4) online softmax in base 2
(running max per head, rescale factor); (5) each thread accumulates
``p * V`` for its tokens and chunk in registers.  At the end the NY partial
accumulators are added through shared memory and the state is written.

Three paths
-----------
The kernel above (``path="smem"``) is the simulator's path and the fallback.
On a GPU, :mod:`nbattn.cuda.kernels.decode_warp` (``path="warp"``) runs the same work
list with no block barrier in its main loop; it is picked whenever the head
dimension maps onto a warp (16-byte chunks, power-of-two lanes per token) and
the arrays are 16-byte aligned.  For GQA groups of at least ``TC_MIN_GROUP``
heads, fp16/bf16 and head_dim 32..128 (softmax variants), the same module's
tensor-core kernel (``path="tc"``, ``mma.sync`` with the group's heads as one
operand) replaces the per-head CUDA-core math, which nears the FMA/issue
limits there.  ``DECODE_PATH`` (``auto`` | ``warp`` | ``smem`` | ``tc``)
overrides the choice; forcing ``warp`` under the simulator runs it with emulated shuffles
(tests); ``tc`` exists on a GPU only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np
from numba import cuda, float32, int64

from .. import layout as L
from ..variants import Variant, alibi_slopes, check_return_lse, variant_from_kwargs
from .host import arrays as A
from .blocks.primitives import (ELEMS_PER_WORD, SHARED_ALIGN, SIMULATOR, device_fn, element_io, exp2f,
                         ld_v4, load_v4, st_v4)
from .host.driver import jit_kernel, launch_programmatic, sm_count
from .kernels import decode_warp as WARP
from .blocks import nanrule as NR
from .blocks.variants import LOG2E, kernel_variant_key, variant_device_fns

__all__ = ["batch_decode_paged", "single_decode", "DecodeProblem", "WorkList", "prepare_decode", "run_decode_work",
           "decode_launch", "decode_arg_index", "split_work", "split_rule", "split_runner", "decode_kernel", "DecodeConfig", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
NEG_INF = float32(-math.inf)
SMEM_BUDGET = 46 * 1024   # static shared memory stays under the 48 KB default
DECODE_PATH = "auto"      # auto | warp | smem | tc
# heads per CTA on the warp path (q + acc registers).  4 is measured (H200: group 4 at
# 0.88 of copy bandwidth; group 8 as two CTAs per KV head at 0.50).  8 (one CTA per
# KV head for group 8: 168 registers, 3 CTAs/SM, unroll 2) is not measured yet.
WARP_MAX_HEADS = 4
WARP_WARPS = 1 if SIMULATOR else 4   # warps per CTA on the warp path
WARP_UNROLL = 0           # tokens per row per step on the warp path (0: by heads per CTA)
# tensor-core path (decode_warp.build_tc_kernel): groups >= TC_MIN_GROUP take it on a GPU
# (0: never, unless DECODE_PATH = "tc").  H200, fp16, d128, batch 64, KV 4k/16k/32k: group 8
# 0.97-1.02 of copy bandwidth (warp path 0.49-0.50), group 4 0.91-0.95 (warp path 0.92-0.93).
TC_MIN_GROUP = 4
# CTA shape (warps, CTAs per SM for the launch bounds), by heads per CTA: 168 registers a
# thread (ptxas, sm_90) allow 12 warps an SM.  Blocks of up to 4 heads (batch 64 x 8 KV heads
# = 512 CTAs) take 6 warps x 2 CTAs: 264 slots, ~2 full waves rather than 1.3 of 396 slots;
# blocks of 8 heads (256 CTAs: one wave either way) measured faster as 4 warps x 3 (0.97 vs
# 0.83 at 4k).  (make_config)
# Small batches (the unsplit grid fills at most half the SMs, e.g. batch 1 x 32k) split
# into one wave of TC_SPLIT_SHAPE = (warps a CTA, CTAs an SM) instead: fewer, longer CTAs
# pay the per-CTA start (work list, page table, first K/V loads in a chain) fewer times.
# Batch 1 x 32k, fp16, d128: 38.5 us at group 4 (benchmarks/results/decode_b1.json).
TC_SPLIT_SHAPE = (8, 1)
# split_runner launches that one-CTA-per-SM shape with programmatic stream serialization
# (run_decode_work's ``programmatic``; FlashInfer calls it enable_pdl): its CTAs start
# while the previous call's merge ends.  Other shapes launch plainly: with several CTAs per
# SM, the next call's CTAs take SM slots as this call's free them and start unevenly
# spread.  Both measurements are in benchmarks/EXPERIMENTS.md.
DECODE_PROGRAMMATIC = not SIMULATOR


class WorkList(NamedTuple):
    """Device int32 arrays of a work list (see module doc)."""
    cta_indptr: Any
    request: Any
    kv_start: Any
    kv_end: Any
    out_slot: Any


@dataclass(frozen=True)
class DecodeConfig:
    code: str           # "f16" | "bf16" | "f32"
    head_dim: int
    heads_per_cta: int  # HG
    kv_layout: str
    variant: Variant    # kernel_variant_key(...)
    nthreads: int
    tile_tokens: int
    aligned: bool       # 16-byte aligned q / cache: vector global loads
    path: str = "smem"  # "smem" | "warp" | "tc" (see module doc)
    unroll: int = 1     # warp path: tokens per row per step
    min_blocks: int = 4  # warp path: CTAs per SM the launch bounds ask for (caps registers)

    @property
    def words_per_row(self) -> int:
        return self.head_dim // ELEMS_PER_WORD[self.code]

    @property
    def lanes(self) -> int:
        return self.words_per_row // 4


def heads_per_cta(group: int) -> int:
    """Largest divisor of the group that is <= 8 (registers hold 2*HG*VEC floats)."""
    for hg in range(min(group, 8), 0, -1):
        if group % hg == 0:
            return hg
    return 1


def _use_warp(code: str, head_dim: int, aligned: bool) -> bool:
    if DECODE_PATH == "smem":
        return False
    if not WARP.warp_eligible(code, head_dim, aligned):
        return False
    return DECODE_PATH == "warp" or not SIMULATOR


def _use_tc(code: str, head_dim: int, group: int, aligned: bool, variant: Variant) -> bool:
    if DECODE_PATH not in ("auto", "tc") or not WARP.tc_eligible(code, head_dim, aligned, variant):
        return False
    return DECODE_PATH == "tc" or (TC_MIN_GROUP > 0 and group >= TC_MIN_GROUP)


_configs: dict = {}


def make_config(code: str, head_dim: int, group: int, kv_layout: str, variant: Variant,
                aligned: bool = True, batch_kv_heads: int | None = None) -> DecodeConfig:
    """The kernel build for a problem; ``batch_kv_heads`` (batch x KV heads, when
    known) picks the tensor-core CTA shape for small batches.  Memoized (a call's
    hot path asks for it)."""
    key = (code, head_dim, group, kv_layout, variant, aligned, batch_kv_heads, DECODE_PATH, WARP_MAX_HEADS,
           WARP_WARPS, WARP_UNROLL, TC_SPLIT_SHAPE, TC_MIN_GROUP, SMEM_BUDGET)
    try:
        return _configs[key]
    except KeyError:
        cfg = _configs[key] = _make_config(code, head_dim, group, kv_layout, variant, aligned, batch_kv_heads)
        return cfg
    except TypeError:                      # an unhashable variant field
        return _make_config(code, head_dim, group, kv_layout, variant, aligned, batch_kv_heads)


def _make_config(code: str, head_dim: int, group: int, kv_layout: str, variant: Variant,
                 aligned: bool, batch_kv_heads: int | None) -> DecodeConfig:
    if _use_tc(code, head_dim, group, aligned, variant):
        hg = heads_per_cta(group)
        nw, mb = (4, 3) if hg > 4 else (6, 2)
        if batch_kv_heads is not None and 2 * batch_kv_heads * (group // hg) <= sm_count():
            nw, mb = TC_SPLIT_SHAPE
        return DecodeConfig(code, head_dim, hg, kv_layout, kernel_variant_key(variant), 32 * nw, 16 * nw,
                            aligned, "tc", 1, mb)
    if _use_warp(code, head_dim, aligned):
        hg = WARP.warp_heads_per_cta(group, WARP_MAX_HEADS, WARP.warp_geometry(code, head_dim, 1, 1, 1)[0])
        nw = WARP_WARPS
        # tokens in flight per row: as many as the register cap holds without spills
        # (ptxas, sm_90, 128 registers: HG = 4 fits 3, fewer heads fit 4; HG = 8 needs
        # 168 registers, i.e. 3 CTAs per SM, and fits 2)
        min_blocks = 3 if hg > 4 else 4
        unroll = 2 if SIMULATOR else (WARP_UNROLL or (2 if hg > 4 else 3 if hg >= 3 else 4))
        _, _, _, step = WARP.warp_geometry(code, head_dim, hg, nw, unroll)
        return DecodeConfig(code, head_dim, hg, kv_layout, kernel_variant_key(variant), 32 * nw, step,
                            aligned, "warp", unroll, min_blocks)
    hg = heads_per_cta(group)
    w = head_dim // ELEMS_PER_WORD[code]
    nx = w // 4
    if SIMULATOR:
        ny = 4              # each simulated thread is a Python thread: keep blocks tiny
        t = 8
    else:
        ny = max(1, 128 // nx)
        t = ny
        for cand in (64, 32, 16, 8, 4, 2, 1):
            if cand % ny and cand > ny:
                continue
            cand = max(cand, ny)
            smem = 4 * (2 * cand * w + max(hg * cand * nx, ny * head_dim) + hg * cand + 2 * hg)
            if smem <= SMEM_BUDGET and (hg <= 2 or cand <= 32):
                t = cand
                break
    return DecodeConfig(code, head_dim, hg, kv_layout, kernel_variant_key(variant), nx * ny, t,
                        aligned)


# ---------------------------------------------------------------------------
# The kernel factory
# ---------------------------------------------------------------------------

_kernels: dict = {}


def decode_kernel(cfg: DecodeConfig):
    """The compiled decode kernel for ``cfg`` (cached; on disk too on the GPU)."""
    k = _kernels.get(cfg)
    if k is None:
        if cfg.path == "warp":
            k = WARP.build_warp_kernel(cfg, cfg.nthreads // 32, cfg.unroll, cfg.min_blocks)
        elif cfg.path == "tc":
            k = WARP.build_tc_kernel(cfg, cfg.nthreads // 32, cfg.min_blocks)
        else:
            k = _build(cfg)
        _kernels[cfg] = k
    return k


def _build(cfg: DecodeConfig):
    D = cfg.head_dim
    HG = cfg.heads_per_cta
    W = cfg.words_per_row
    NX = cfg.lanes
    NT = cfg.nthreads
    NY = NT // NX
    T = cfg.tile_tokens
    TPT = T // NY
    VEC = 4 * ELEMS_PER_WORD[cfg.code]
    RED = max(HG * T * NX, NY * D)
    TILE_WORDS, P_LEN, HG_VEC = T * W, HG * T, HG * VEC   # shared/local array sizes
    NHD = cfg.kv_layout == "NHD"
    SIGMOID = cfg.variant.use_sigmoid
    ALIGNED = cfg.aligned
    _, store_elem, unpack4 = element_io(cfg.code)
    transform, keep = variant_device_fns(cfg.variant)
    poison = NR.poison_kv(cfg.code)

    @device_fn
    def read4(arr, i):   # 16-byte global load when the base pointers allow it
        if ALIGNED:
            return load_v4(arr, i)
        return arr[i], arr[i + 1], arr[i + 2], arr[i + 3]

    def kernel(q_w, kv_w, kv_indptr, kv_indices, kv_last, page_size, num_kv_heads, num_qo_heads,
               cta_indptr, w_request, w_kv_start, w_kv_end, w_out_slot,
               out, lse, part_o, part_lse, slopes, sm_scale, sigmoid_bias):
        k_s = cuda.shared.array(TILE_WORDS, np.uint32, alignment=SHARED_ALIGN)
        v_s = cuda.shared.array(TILE_WORDS, np.uint32, alignment=SHARED_ALIGN)
        red = cuda.shared.array(RED, np.float32)
        p_s = cuda.shared.array(P_LEN, np.float32)
        m_s = cuda.shared.array(HG, np.float32)
        f_s = cuda.shared.array(HG, np.float32)
        qv = cuda.local.array(HG_VEC, np.float32)
        acc = cuda.local.array(HG_VEC, np.float32)
        lacc = cuda.local.array(HG, np.float32)
        xf = cuda.local.array(VEC, np.float32)

        tid = cuda.threadIdx.x
        tx = tid % NX
        ty = tid // NX
        h0 = cuda.blockIdx.y * HG
        group = num_qo_heads // num_kv_heads
        kvh = h0 // group
        ps = int64(page_size)
        hkv = int64(num_kv_heads)

        for item in range(cta_indptr[cuda.blockIdx.x], cta_indptr[cuda.blockIdx.x + 1]):
            r, kv_start, kv_end, slot, page_base, q_idx = WARP.work_item(
                item, w_request, w_kv_start, w_kv_end, w_out_slot, kv_indptr, kv_last, page_size)

            # q chunk of every head of the block, in registers
            for g in range(HG):
                w0, w1, w2, w3 = read4(q_w, (int64(r) * num_qo_heads + h0 + g) * W + tx * 4)
                unpack4(w0, w1, w2, w3, qv, g * VEC)
                lacc[g] = 0.0
                for e in range(VEC):
                    acc[g * VEC + e] = 0.0
            for g in range(tid, HG, NT):
                m_s[g] = NEG_INF

            for tile in range(kv_start, kv_end, T):
                # (1) gather this tile's K and V rows from their pages
                for i in range(TPT):
                    t = ty + i * NY
                    pos = tile + t
                    k0 = k1 = k2 = k3 = v0 = v1 = v2 = v3 = np.uint32(0)
                    if pos < kv_end:
                        # unsigned 32-bit division: far cheaper than numba's int64 floor division
                        page_idx = np.uint32(pos) // np.uint32(page_size)
                        within = int64(np.uint32(pos) - page_idx * np.uint32(page_size))
                        page = int64(kv_indices[page_base + int64(page_idx)])
                        if NHD:
                            row_k = ((page * 2 * ps + within) * hkv + kvh) * W
                            row_v = (((page * 2 + 1) * ps + within) * hkv + kvh) * W
                        else:
                            row_k = ((page * 2 * hkv + kvh) * ps + within) * W
                            row_v = (((page * 2 + 1) * hkv + kvh) * ps + within) * W
                        k0, k1, k2, k3 = read4(kv_w, row_k + tx * 4)
                        v0, v1, v2, v3 = read4(kv_w, row_v + tx * 4)
                        k0, k1, k2, k3, v0, v1, v2, v3 = poison(k0, k1, k2, k3, v0, v1, v2, v3)
                    st_v4(k_s, t * W + tx * 4, k0, k1, k2, k3)
                    st_v4(v_s, t * W + tx * 4, v0, v1, v2, v3)
                cuda.syncthreads()

                # (2) partial dot products: my chunk of q . my chunk of k
                for i in range(TPT):
                    t = ty + i * NY
                    w0, w1, w2, w3 = ld_v4(k_s, t * W + tx * 4)
                    unpack4(w0, w1, w2, w3, xf, 0)
                    for g in range(HG):
                        dot = float32(0.0)
                        for e in range(VEC):
                            dot += qv[g * VEC + e] * xf[e]
                        red[(g * T + t) * NX + tx] = dot

                cuda.syncthreads()
                # (3) full scores, variant, mask
                for j in range(tid, HG * T, NT):
                    g = j // T
                    t = j - g * T
                    s = float32(0.0)
                    for x in range(NX):
                        s += red[j * NX + x]
                    pos = tile + t
                    h = h0 + g
                    raw = s * sm_scale
                    s = NR.checked(raw, transform(raw, r, h, q_idx, pos, slopes[h]))
                    ok = pos < kv_end and keep(r, h, q_idx, pos)
                    if SIGMOID:
                        p_s[j] = float32(1.0) / (float32(1.0) + math.exp(-(s + sigmoid_bias))) if ok else 0.0
                    else:
                        p_s[j] = s * float32(LOG2E) if ok else NEG_INF
                cuda.syncthreads()

                # (4) online softmax: new running max per head, rescale factor
                if not SIGMOID:
                    for g in range(tid, HG, NT):
                        m_old = m_s[g]
                        m_new = m_old
                        for t in range(T):
                            m_new = NR.max_nan(m_new, p_s[g * T + t])
                        f_s[g] = float32(1.0) if m_new == NEG_INF else exp2f(m_old - m_new)
                        m_s[g] = m_new
                    cuda.syncthreads()
                    for j in range(tid, HG * T, NT):
                        m = m_s[j // T]
                        p_s[j] = float32(0.0) if m == NEG_INF else exp2f(p_s[j] - m)
                    cuda.syncthreads()
                    for g in range(HG):
                        f = f_s[g]
                        lacc[g] *= f
                        for e in range(VEC):
                            acc[g * VEC + e] *= f

                # (5) accumulate p * V for my tokens and chunk
                for i in range(TPT):
                    t = ty + i * NY
                    w0, w1, w2, w3 = ld_v4(v_s, t * W + tx * 4)
                    unpack4(w0, w1, w2, w3, xf, 0)
                    for g in range(HG):
                        p = p_s[g * T + t]
                        lacc[g] += p
                        for e in range(VEC):
                            acc[g * VEC + e] += p * xf[e]
                cuda.syncthreads()   # the next tile overwrites k_s, v_s, p_s

            # add the NY partial accumulators of each head and write the state
            for g in range(HG):
                for e in range(VEC):
                    red[ty * D + tx * VEC + e] = acc[g * VEC + e]
                if tx == 0:
                    p_s[ty] = lacc[g]
                cuda.syncthreads()
                h = h0 + g
                l = float32(0.0)
                for y in range(NY):
                    l += p_s[y]
                if SIGMOID:
                    inv_l = float32(1.0)
                    row_lse = float32(math.nan)
                elif m_s[g] != m_s[g] or l != l:     # a visible key was non-finite
                    inv_l = NR.NAN_F32
                    row_lse = NR.NAN_F32
                elif m_s[g] == NEG_INF:              # no visible key (a flag, not l > 0)
                    inv_l = float32(0.0)
                    row_lse = NEG_INF
                else:
                    inv_l = float32(1.0) / l
                    row_lse = m_s[g] + math.log2(l)
                for d in range(tid, D, NT):
                    o = float32(0.0)
                    for y in range(NY):
                        o += red[y * D + d]
                    o *= inv_l
                    if slot < 0:
                        store_elem(out, (int64(r) * num_qo_heads + h) * D + d, o)
                    else:
                        part_o[(int64(slot) * num_qo_heads + h) * D + d] = o
                if tid == 0:
                    if slot < 0:
                        lse[int64(r) * num_qo_heads + h] = row_lse
                    else:
                        part_lse[int64(slot) * num_qo_heads + h] = row_lse
                cuda.syncthreads()

    return jit_kernel(kernel)


# ---------------------------------------------------------------------------
# Validation and device arrays: everything checked before any launch
# ---------------------------------------------------------------------------

@dataclass
class DecodeProblem:
    """A validated decode call: device arrays, sizes, variant, output handles."""
    code: str
    kind: str
    stream: Any
    variant: Variant
    sm_scale: float
    batch: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    kv_layout: str
    kv_lens: np.ndarray       # host int32
    q_w: Any
    kv_w: Any
    kv_indptr: Any
    kv_indices: Any
    kv_last: Any
    slopes: Any
    out_user: Any
    out_dev: Any
    lse_user: Any
    lse_dev: Any
    aligned: bool

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    def config(self) -> DecodeConfig:
        return make_config(self.code, self.head_dim, self.group, self.kv_layout, self.variant,
                           self.aligned, self.batch * self.num_kv_heads)


def _check_head_dim(head_dim: int) -> None:
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise L.LayoutError(f"paged_kv_cache: head_dim must be a multiple of 8 in 8..{MAX_HEAD_DIM} "
                            f"(16-byte vector loads), got {head_dim}")


def _check_out(name: str, x: Any, shape: tuple, code: str | None, kind: str) -> None:
    got = tuple(int(s) for s in x.shape)
    if got != shape:
        raise L.LayoutError(f"{name}: must have shape {shape}, got {got}")
    if code is not None and A.dtype_code(x, name) != code:
        raise L.LayoutError(f"{name}: dtype must match q ({code}), got {A.dtype_code(x, name)}")
    if code is None and L.dtype_of(x) != "float32":
        raise L.LayoutError(f"{name}: must be float32, got {L.dtype_of(x)}")
    if A.is_device_kind(kind) != A.is_device_kind(A.kind_of(x)):
        raise L.LayoutError(f"{name}: must live where q lives ({kind}), got {A.kind_of(x)}")
    if A.is_device_kind(kind):
        A.check_contiguous(x, name)


def _aligned(*devs) -> bool:
    if SIMULATOR:
        return True
    return all(d.__cuda_array_interface__["data"][0] % 16 == 0 for d in devs)


def prepare_decode(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                   *, kv_layout="NHD", return_lse=False, out=None, lse=None, **variant) -> DecodeProblem:
    """Validate every argument (nothing is launched or modified on error) and
    bring the arrays to the device."""
    var = variant_from_kwargs(dict(variant))
    check_return_lse(var, return_lse)
    L.check_kv_layout(kv_layout)
    code = A.dtype_code(q, "q")
    kv_code = A.dtype_code(paged_kv_cache, "paged_kv_cache")
    if kv_code != code:
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
    _check_head_dim(dims.head_dim)
    L.check_q(q, dims.head_dim, rows=pkv.batch_size)
    L.check_heads(int(q.shape[1]), dims.num_kv_heads)
    if var.causal:
        L.check_causal_lengths(np.ones(pkv.batch_size, np.int64), pkv.kv_lens, name="q")
    shape = tuple(int(s) for s in q.shape)
    if out is not None:
        _check_out("out", out, shape, code, kind)
    if lse is not None:
        _check_out("lse", lse, shape[:2], None, kind)
    if A.is_device_kind(kind):
        A.check_contiguous(q, "q")
        A.check_contiguous(paged_kv_cache, "paged_kv_cache")

    # -- all checks passed: device arrays (zero-copy for device inputs) --
    stream = A.launch_stream(q, paged_kv_cache, out, lse)
    q_dev = A.to_device(q, "q", stream, code)
    kv_dev = A.to_device(paged_kv_cache, "paged_kv_cache", stream, code)
    meta = [A.device_meta(x, host[n], stream) for n, x in (("paged_kv_indptr", paged_kv_indptr),
                                                           ("paged_kv_indices", paged_kv_indices),
                                                           ("paged_kv_last_page_len", paged_kv_last_page_len))]
    out_user, out_dev = A.output_for("out", out, kind, shape, code, stream, like=q)
    lse_user, lse_dev = A.output_for("lse", lse, kind, shape[:2], "f32", stream, like=q)
    slopes = alibi_slopes(shape[1]) if var.has_alibi else np.zeros(shape[1], np.float32)
    q_w, kv_w = A.words(q_dev), A.words(kv_dev)
    return DecodeProblem(code, kind, stream, var, var.scale(dims.head_dim), pkv.batch_size, shape[1],
                         dims.num_kv_heads, dims.head_dim, dims.page_size, kv_layout,
                         pkv.kv_lens.astype(np.int32), q_w, kv_w, *meta,
                         cuda.to_device(slopes, stream=stream), out_user, out_dev, lse_user, lse_dev,
                         _aligned(q_dev, kv_dev))


# ---------------------------------------------------------------------------
# Work lists: the unsplit list, FlashDecoding chunks, and running them
# ---------------------------------------------------------------------------

def split_work(kv_lens: np.ndarray, kv_chunk_size: int | None):
    """Host work list and reduction map for fixed-size KV chunks.

    One CTA per item.  A request longer than ``kv_chunk_size`` becomes
    ``ceil(len / chunk)`` items writing consecutive partial slots in KV order;
    shorter ones (and empty ones) write their final output directly.
    Returns ``(cta_indptr, request, kv_start, kv_end, out_slot,
    merge_indptr, merge_row, merge_slots, num_slots)`` as int32 NumPy arrays
    (and an int).
    """
    req, ks, ke, slot = [], [], [], []
    m_indptr, m_row, m_slots = [0], [], []
    n_slots = 0
    for r, n in enumerate(np.asarray(kv_lens, np.int64)):
        if kv_chunk_size is None or n <= kv_chunk_size:
            req.append(r); ks.append(0); ke.append(int(n)); slot.append(-1)
            continue
        starts = range(0, int(n), int(kv_chunk_size))
        for a in starts:
            req.append(r); ks.append(a); ke.append(min(int(n), a + int(kv_chunk_size)))
            slot.append(n_slots); m_slots.append(n_slots); n_slots += 1
        m_row.append(r)
        m_indptr.append(len(m_slots))
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return (np.arange(len(req) + 1, dtype=np.int32), i32(req), i32(ks), i32(ke), i32(slot),
            i32(m_indptr), i32(m_row), i32(m_slots), n_slots)


def choose_chunk(p: DecodeProblem) -> int | None:
    """Built-in split heuristic: split only when the unsplit grid leaves CTA slots
    of the GPU empty (slots = SMs x the CTAs per SM the kernel's registers
    allow), into at most one wave of CTAs -- a second, partial wave costs as
    much as a full one -- and into chunks of at least a few tiles; None means
    no split."""
    ctas, slots, grain, floor = split_rule(p.config(), p.batch, p.num_qo_heads)
    longest = int(p.kv_lens.max()) if p.batch else 0
    if ctas >= slots or longest == 0:
        return None
    splits = max(1, slots // max(ctas, 1))
    chunk = max(floor, -(-longest // splits))
    chunk = -(-chunk // grain) * grain
    return None if chunk >= longest else chunk


def split_rule(cfg: DecodeConfig, batch: int, num_qo_heads: int) -> tuple[int, int, int, int]:
    """The numbers :func:`choose_chunk` decides with: (CTAs of the unsplit grid, CTA
    slots of the GPU, the chunk's grain, the smallest chunk)."""
    ctas = batch * (num_qo_heads // cfg.heads_per_cta)
    slots = (cfg.min_blocks if cfg.path in ("warp", "tc") else 4) * sm_count()
    # tensor-core CTAs take their warps' 16-token tiles in turn: any multiple of 16 works
    grain = 16 if cfg.path == "tc" else cfg.tile_tokens
    floor = (4 if cfg.path == "tc" else 8) * cfg.tile_tokens
    return ctas, slots, grain, floor


def decode_launch(p: DecodeProblem, work: WorkList, partial_o=None, partial_lse=None, prefetch: bool = False):
    """:func:`_launch_for` with the problem's own kernel configuration (see there)."""
    return _launch_for(p, p.config(), work, partial_o, partial_lse, prefetch)


def _launch_for(p: DecodeProblem, cfg: DecodeConfig, work: WorkList, partial_o=None, partial_lse=None,
                prefetch: bool = False):
    """``(kernel, grid, threads, args)`` of the decode kernel over a work list (device
    int32 arrays); None for an empty list.

    ``partial_o [slots, num_qo_heads, head_dim]`` / ``partial_lse [slots,
    num_qo_heads]`` (float32 device arrays) receive items with ``out_slot >= 0``;
    items with ``-1`` write ``p.out_dev`` / ``p.lse_dev``.  Grid ``(len(work.cta_indptr)-1,
    num_qo_heads // heads_per_cta)`` (flattened to 1-D on the warp path).  ``prefetch``: the
    small-batch tensor-core shape prefetches its first K/V into L2 before its programmatic
    dependency wait (``decode_warp.PREFETCH_STEPS``; only worth it in a programmatic launch)."""
    num_ctas = int(work.cta_indptr.shape[0]) - 1
    if num_ctas <= 0:
        return None
    if partial_o is None:
        partial_o = cuda.device_array(1, np.float32, stream=p.stream)
        partial_lse = cuda.device_array(1, np.float32, stream=p.stream)
    n_hb = p.num_qo_heads // cfg.heads_per_cta
    tail = (A.flat(p.out_dev), A.flat(p.lse_dev), A.flat(partial_o), A.flat(partial_lse),
            p.slopes, np.float32(p.sm_scale), np.float32(p.variant.sigmoid_bias))
    if cfg.path in ("warp", "tc"):
        ps = p.page_size
        shift = ps.bit_length() - 1 if ps & (ps - 1) == 0 else -1
        return decode_kernel(cfg), num_ctas * n_hb, cfg.nthreads, (
            p.q_w, p.kv_w, p.kv_indptr, p.kv_indices, p.kv_last, ps, shift, p.num_kv_heads,
            p.num_qo_heads, n_hb, np.int64(bool(prefetch)), *work, *tail)
    return decode_kernel(cfg), (num_ctas, n_hb), cfg.nthreads, (
        p.q_w, p.kv_w, p.kv_indptr, p.kv_indices, p.kv_last, p.page_size, p.num_kv_heads,
        p.num_qo_heads, *work, *tail)


def decode_arg_index(cfg: DecodeConfig) -> dict:
    """Where :func:`decode_launch`'s arguments sit in its ``args``, by name (what a
    :class:`nbattn.cuda.host.driver.BoundLaunch` patches per call)."""
    first = 11 if cfg.path in ("warp", "tc") else 8          # the work list's first array
    names = ("q", "kv", "kv_indptr", "kv_indices", "kv_last")
    idx = dict(zip(names, range(5)))
    idx.update(cta_indptr=first, request=first + 1, kv_start=first + 2, kv_end=first + 3,
               out_slot=first + 4, out=first + 5, lse=first + 6, partial_o=first + 7,
               partial_lse=first + 8, slopes=first + 9, sm_scale=first + 10, sigmoid_bias=first + 11)
    return idx


def run_decode_work(p: DecodeProblem, work: WorkList, partial_o=None, partial_lse=None,
                    programmatic: bool = False) -> None:
    """Launch :func:`decode_launch`'s kernel, asynchronously on ``p.stream``.

    ``programmatic=True`` launches with programmatic stream serialization (FlashInfer's
    ``enable_pdl``): the CTAs may start while the stream's previous kernel ends and read
    the work list meanwhile (``decode_warp.work_item`` waits after it), so the work list
    must not be written by a kernel just before (``split_runner`` uploads its own once).
    """
    launch = decode_launch(p, work, partial_o, partial_lse, prefetch=programmatic)
    if launch is None:
        return
    kern, grid, threads, args = launch
    if not (programmatic and launch_programmatic(kern, grid, threads, p.stream, args)):
        kern[grid, threads, p.stream](*args)


def _upload(stream, *arrays):
    return [cuda.to_device(np.ascontiguousarray(a, dtype=np.int32), stream=stream) for a in arrays]


def split_runner(p: DecodeProblem, kv_chunk_size: int | None) -> Callable[[], None]:
    """Upload the work list of fixed-size KV chunks (None: unsplit) and the
    partial buffers once; the returned function launches the decode and, for
    split requests, the merge of their partials in KV order, on ``p.stream`` as
    it is when called (so it can be captured in a CUDA graph and replayed).  The
    merge of up to 64 partials a row is launched programmatically: it starts
    while the decode kernel runs and waits for the partials on the device.  So is
    the decode kernel in its small-batch shape (``DECODE_PROGRAMMATIC``): its
    CTAs start while the previous kernel on the stream (a previous step's merge,
    say) ends, and read this work list before they wait for it."""
    from .merge import MergeMap, run_merge_partials

    (cta_indptr, req, ks, ke, slot, m_indptr, m_row, m_slots, n_slots) = split_work(
        p.kv_lens, kv_chunk_size)
    work = WorkList(*_upload(p.stream, cta_indptr, req, ks, ke, slot))
    # allocated here, not per launch: a launch inside a CUDA-graph capture must not allocate
    po = cuda.device_array((max(n_slots, 1), p.num_qo_heads, p.head_dim), np.float32, stream=p.stream)
    pl = cuda.device_array((max(n_slots, 1), p.num_qo_heads), np.float32, stream=p.stream)
    cfg = p.config()
    pdl = DECODE_PROGRAMMATIC and cfg.path == "tc" and cfg.min_blocks == 1
    if n_slots == 0:
        return lambda: run_decode_work(p, work, po, pl, pdl)
    mmap = MergeMap(*_upload(p.stream, m_indptr, m_row, m_slots))
    most = int(np.diff(m_indptr).max())

    def run() -> None:
        run_decode_work(p, work, po, pl, pdl)
        run_merge_partials(po, pl, mmap, p.out_dev, p.lse_dev, code=p.code,
                           use_sigmoid=p.variant.use_sigmoid, max_partials=most, stream=p.stream)
    return run


def run_split(p: DecodeProblem, kv_chunk_size: int | None) -> None:
    """Decode with fixed-size KV chunks (None: unsplit), merging partials in KV order."""
    split_runner(p, kv_chunk_size)()


def finish_decode(p: DecodeProblem, return_lse: bool, out=None, lse=None):
    """Copy host results back (host kinds) or hand back the device objects."""
    return A.finish_results(p.kind, p.code, p.stream, out, p.out_user, p.out_dev, lse, p.lse_user,
                            p.lse_dev, return_lse)


def batch_decode_paged(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                       *, kv_layout="NHD", return_lse=False, out=None, lse=None, **variant):
    """One query row per request over a paged KV cache; same arguments as
    :func:`nbattn.reference.batch_decode_paged` plus optional ``out=``/``lse=``.

    Returns ``o [batch, num_qo_heads, head_dim]`` in q's dtype (and the base-2
    ``lse [batch, num_qo_heads]`` float32 with ``return_lse=True``), of q's kind.
    Splits long requests into KV chunks when the batch alone cannot fill the GPU.
    Device inputs take the launch layer (:mod:`nbattn.cuda.decode_call`): the page
    table is validated and uploaded once per call and the kernels are launched
    through launches bound once per configuration.
    """
    from .decode_call import fast_decode

    res = fast_decode(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                      kv_layout=kv_layout, return_lse=return_lse, out=out, lse=lse, variant=variant)
    if res is not NotImplemented:
        return res
    p = prepare_decode(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                       kv_layout=kv_layout, return_lse=return_lse, out=out, lse=lse, **variant)
    run_split(p, choose_chunk(p))
    return finish_decode(p, return_lse, out, lse)


def single_decode(q, k, v, *, kv_layout: str = "NHD", return_lse: bool = False, out=None, lse=None,
                  **variant):
    """One query token over contiguous KV (golden: :func:`nbattn.reference.single_decode`):
    ``q [num_qo_heads, head_dim]``, ``k, v [kv_len, num_kv_heads, head_dim]`` (NHD).

    A one-row prefill over the contiguous keys, so no page table is built and
    no KV is copied; returns ``o [num_qo_heads, head_dim]`` (and ``lse``).
    """
    from .prefill import single_prefill

    if len(q.shape) != 2:
        raise L.LayoutError(f"q: must have shape [num_qo_heads, head_dim], got {tuple(q.shape)}")
    row = lambda x: None if x is None else x.reshape((1,) + tuple(x.shape))  # noqa: E731
    res = single_prefill(row(q), k, v, kv_layout=kv_layout, return_lse=return_lse, out=row(out),
                         lse=row(lse), **variant)
    if return_lse:
        o, s = res
        return o.reshape(tuple(o.shape[1:])), s.reshape(tuple(s.shape[1:]))
    return res.reshape(tuple(res.shape[1:]))
