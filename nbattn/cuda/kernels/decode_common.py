"""What the three decode kernels share: the build configuration, the work list,
and the device functions every decode kernel calls.

* :class:`DecodeConfig` is one kernel build (dtype, head_dim, heads per CTA,
  layout, variant, block shape, path) and the :class:`~nbattn.cuda.tuning.DecodeTuning`
  it was chosen with; :func:`make_config` chooses it for a problem.
* :class:`WorkList` is the device form of a work list (the contract is in the
  module doc of :mod:`nbattn.cuda.decode`).
* :func:`work_item`, :func:`page_slot`, :func:`head_block`, :func:`make_kv_addressing`
  and :func:`make_state_writer` are the device pieces: reading a work item, finding a
  key's page slot, a 1-D grid's CTA and heads, the word offsets of a K/V row, and
  folding a CTA's per-stream states into the row it writes.

The kernels themselves: :mod:`.decode_smem` (the teaching kernel),
:mod:`.decode_warp` and :mod:`.decode_tc` (fast paths).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from numba import cuda, float32, int64, uint32

from ...variants import Variant
from ..blocks import nanrule as NR
from ..blocks.mma import grid_dependency_wait
from ..blocks.primitives import ELEMS_PER_WORD, SIMULATOR, device_fn, exp2f
from ..blocks.rope import rope_supported
from ..blocks.variants import kernel_variant_key
from ..host.driver import compute_capability, sm_count
from ..tuning import DECODE, DecodeTuning

__all__ = ["WorkList", "DecodeConfig", "heads_per_cta", "make_config", "warp_eligible", "warp_heads_per_cta",
           "warp_geometry", "tc_eligible", "page_slot", "work_item", "head_block", "make_kv_addressing",
           "make_state_writer", "NEG_INF"]

NEG_INF = float32(-math.inf)


class WorkList(NamedTuple):
    """Device int32 arrays of a work list (module doc of :mod:`nbattn.cuda.decode`)."""
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
    path: str = "smem"  # "smem" | "warp" | "tc" (module doc of nbattn.cuda.decode)
    unroll: int = 1     # warp path: tokens per row per step
    min_blocks: int = 4  # warp and tc paths: CTAs per SM the launch bounds ask for (caps registers)
    tuning: DecodeTuning = DECODE   # what the choice above was made with (kernels read it too)
    kv_code: str | None = None      # "e4m3" | "e5m2": an fp8 cache (q keeps ``code``); None: K/V are ``code``

    @property
    def kv(self) -> str:
        """The dtype code of the K/V cache."""
        return self.kv_code or self.code

    @property
    def words_per_row(self) -> int:
        """32-bit words of one K (or V) row of one head."""
        return self.head_dim // ELEMS_PER_WORD[self.kv]

    @property
    def q_words_per_row(self) -> int:
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


def warp_eligible(code: str, head_dim: int, aligned: bool) -> bool:
    """A token's row must be a power-of-two number of 16-byte chunks within one warp."""
    nx = head_dim // (4 * ELEMS_PER_WORD[code])
    return aligned and head_dim % (4 * ELEMS_PER_WORD[code]) == 0 and 1 <= nx <= 32 and nx & (nx - 1) == 0


def warp_heads_per_cta(group: int, max_heads: int, lanes: int) -> int:
    """Largest divisor of the group <= max_heads and <= the lanes of a token: q and
    the accumulator of every head live in registers (2 * HG * VEC floats per
    lane), and each head's score ends in its own subset of the token's lanes."""
    for hg in range(min(group, max_heads, lanes), 0, -1):
        if group % hg == 0:
            return hg
    return 1


def warp_geometry(code: str, head_dim: int, heads: int, nwarps: int, unroll: int):
    """``(NX, TW, R, step_tokens)`` of the warp path: lanes per token, tokens per warp,
    rows per CTA, tokens a CTA consumes per step."""
    vec = 4 * ELEMS_PER_WORD[code]
    nx = head_dim // vec
    tw = 32 // nx
    return nx, tw, nwarps * tw, nwarps * tw * unroll


def tc_eligible(code: str, head_dim: int, aligned: bool, variant, kv_code: str | None = None) -> bool:
    """The tensor-core path takes fp16/bf16, head_dim 32..128 in steps of 32 (256
    spills: ptxas, sm_90) and softmax (not sigmoid) variants, on a GPU.  An fp8
    cache (``kv_code``) needs head_dim 64 or 128 (a lane's 16-byte load holds 16 of
    its dims, so a token's four lanes cover 64) and a GPU that converts fp8 to fp16
    in one instruction (compute capability 8.9 or later); the warp path reads the
    others."""
    if SIMULATOR or not aligned or code not in ("f16", "bf16") or head_dim % 32 or head_dim > 128:
        return False
    if variant.use_sigmoid:
        return False
    if kv_code is None:
        return True
    cc = compute_capability()
    return head_dim % 64 == 0 and cc is not None and cc >= (8, 9)


def _use_warp(code: str, head_dim: int, aligned: bool, tuning: DecodeTuning) -> bool:
    if tuning.path == "smem" or not warp_eligible(code, head_dim, aligned):
        return False
    return tuning.path == "warp" or not SIMULATOR


def _use_tc(code: str, head_dim: int, group: int, aligned: bool, variant: Variant, tuning: DecodeTuning,
            kv_code: str | None = None) -> bool:
    if tuning.path not in ("auto", "tc") or not tc_eligible(code, head_dim, aligned, variant, kv_code):
        return False
    return tuning.path == "tc" or (tuning.tc_min_group > 0 and group >= tuning.tc_min_group)


_configs: dict = {}


def make_config(code: str, head_dim: int, group: int, kv_layout: str, variant: Variant,
                aligned: bool = True, batch_kv_heads: int | None = None,
                tuning: DecodeTuning | None = None, kv_code: str | None = None) -> DecodeConfig:
    """The kernel build for a problem under ``tuning`` (default
    :data:`~nbattn.cuda.tuning.DECODE`); ``batch_kv_heads`` (batch x KV heads, when
    known) picks the tensor-core CTA shape for small batches; ``kv_code`` (``"e4m3"``
    / ``"e5m2"``) an fp8 cache, which takes the tensor-core path where
    :func:`tc_eligible` allows it and the warp path otherwise, there with
    ``DecodeTuning.fp8_warp_max_heads`` heads a CTA.  Memoized (a call's hot path
    asks for it)."""
    tuning = DECODE if tuning is None else tuning
    key = (code, head_dim, group, kv_layout, variant, aligned, batch_kv_heads, tuning, kv_code)
    try:
        return _configs[key]
    except KeyError:
        cfg = _configs[key] = _make_config(code, head_dim, group, kv_layout, variant, aligned, batch_kv_heads,
                                           tuning, kv_code)
        return cfg
    except TypeError:                      # an unhashable variant field
        return _make_config(code, head_dim, group, kv_layout, variant, aligned, batch_kv_heads, tuning, kv_code)


def _make_config(code: str, head_dim: int, group: int, kv_layout: str, variant: Variant,
                 aligned: bool, batch_kv_heads: int | None, tuning: DecodeTuning,
                 kv_code: str | None = None) -> DecodeConfig:
    key = kernel_variant_key(variant)
    kv = kv_code or code
    rope = variant.has_rope          # RoPE turns q and K in the warp and teaching kernels (blocks/rope.py)
    if rope and not rope_supported(head_dim, 4 * ELEMS_PER_WORD[kv]):
        raise ValueError(f"pos_encoding_mode: 'ROPE_LLAMA' on the decode kernels needs head_dim / 2 to be a "
                         f"multiple of {4 * ELEMS_PER_WORD[kv]} (the elements of a 16-byte chunk), got "
                         f"head_dim {head_dim}")
    if not rope and _use_tc(code, head_dim, group, aligned, variant, tuning, kv_code):
        hg = heads_per_cta(group)
        # (warps a CTA, CTAs an SM) by the CTA's heads (DecodeTuning.tc_shape / tc_shape_wide)
        nw, mb = tuning.tc_shape_wide if hg > 4 else tuning.tc_shape
        if batch_kv_heads is not None and 2 * batch_kv_heads * (group // hg) <= sm_count():
            nw, mb = tuning.tc_split_shape      # the unsplit grid fills at most half the SMs
        return DecodeConfig(code, head_dim, hg, kv_layout, key, 32 * nw, 16 * nw, aligned, "tc", 1, mb, tuning,
                            kv_code)
    if _use_warp(kv, head_dim, aligned, tuning):
        most = tuning.fp8_warp_max_heads if kv_code else tuning.warp_max_heads
        hg = warp_heads_per_cta(group, most, warp_geometry(kv, head_dim, 1, 1, 1)[0])
        nw = tuning.warp_warps
        # tokens in flight per row: as many as the register cap holds without spills
        # (ptxas, sm_90, 128 registers: HG = 4 fits 3, fewer heads fit 4; HG = 8 needs
        # 168 registers, i.e. 3 CTAs per SM, and fits 2)
        min_blocks = tuning.warp_min_blocks or (3 if hg > 4 else 4)
        # fp8: a lane holds 16 dims (VEC = 16), so q and acc take twice the registers of
        # fp16 per head; 2 heads and 2 tokens in flight fit 128 registers (an estimate)
        auto = (2 if hg >= 2 else 4) if kv_code else (2 if hg > 4 else 3 if hg >= 3 else 4)
        unroll = 2 if SIMULATOR else (tuning.warp_unroll or auto)
        _, _, _, step = warp_geometry(kv, head_dim, hg, nw, unroll)
        return DecodeConfig(code, head_dim, hg, kv_layout, key, 32 * nw, step, aligned, "warp", unroll,
                            min_blocks, tuning, kv_code)
    hg = heads_per_cta(group)
    w = head_dim // ELEMS_PER_WORD[kv]
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
            if smem <= tuning.smem_budget and (hg <= 2 or cand <= 32):
                t = cand
                break
    return DecodeConfig(code, head_dim, hg, kv_layout, key, nx * ny, t, aligned, tuning=tuning, kv_code=kv_code)


# ---------------------------------------------------------------------------
# Device pieces of every decode kernel
# ---------------------------------------------------------------------------

@device_fn
def page_slot(pos, page_size, ps_shift):
    """(page index, slot in the page) of a request's key position; power-of-two
    pages (``ps_shift >= 0``, the common case) avoid an integer division per token."""
    if ps_shift >= 0:
        pi = uint32(pos) >> uint32(ps_shift)
        return pi, uint32(pos) & uint32(page_size - 1)
    pi = uint32(pos) // uint32(page_size)
    return pi, uint32(pos) - pi * uint32(page_size)


@device_fn
def work_item(item, w_request, w_kv_start, w_kv_end, w_out_slot, kv_indptr, kv_last, page_size):
    """Work item ``item`` of a decode work list (module doc of :mod:`nbattn.cuda.decode`):
    ``(request, kv_start, kv_end, out_slot, first page index, query position)``; the
    query sits at its request's last key, whatever chunk the item covers.

    The work list is the launcher's own, uploaded before the kernels that may run
    ahead of this one (``decode.split_runner``): it is read before the programmatic
    dependency wait, everything of the caller's (page table, q, K/V, outputs) after
    it, through the request id the wait's zero is added to."""
    r = w_request[item]
    kv_start, kv_end, slot = w_kv_start[item], w_kv_end[item], w_out_slot[item]
    r += grid_dependency_wait()
    page_base = int64(kv_indptr[r])
    n_pages = kv_indptr[r + 1] - kv_indptr[r]
    kv_len = (n_pages - 1) * page_size + kv_last[r] if n_pages > 0 else 0
    return r, kv_start, kv_end, slot, page_base, kv_len - 1


@device_fn
def head_block(n_head_blocks, hg, num_qo_heads, num_kv_heads, mine):
    """``(cta, h0, h_mine, kvh)`` of this CTA of a 1-D grid (the warp and tensor-core
    paths): its CTA in the work list, the first of its ``hg`` query heads, the head of
    this thread's row ``mine`` (padding rows past ``hg`` borrow the last head) and the
    heads' KV head.  The head blocks of one work-list CTA are adjacent in launch order."""
    cta = cuda.blockIdx.x // n_head_blocks
    h0 = (cuda.blockIdx.x - cta * n_head_blocks) * hg
    h_mine = h0 + min(mine, hg - 1)
    return cta, h0, h_mine, h0 // (num_qo_heads // num_kv_heads)


def make_kv_addressing(W: int, nhd: bool):
    """Device function ``(page_size, num_kv_heads, kvh, chunk) -> (v_off, page_words,
    slot_words, my_off)`` for rows of ``W`` 32-bit words: the K row of slot ``s`` of
    page ``p`` starts, for this lane's 16-byte chunk ``chunk`` of the row, at word
    ``p * page_words + s * slot_words + my_off`` and its V row ``v_off`` words later
    (both layouts)."""

    @device_fn
    def kv_addressing(page_size, num_kv_heads, kvh, chunk):
        ps = int64(page_size)
        hkv = int64(num_kv_heads)
        v_off = ps * hkv * W               # V half of a page, both layouts
        page_words = 2 * v_off
        if nhd:
            slot_words = uint32(num_kv_heads * W)
            my_off = int64(kvh) * W + chunk * 4
        else:
            slot_words = uint32(W)
            my_off = int64(kvh) * ps * W + chunk * 4
        return v_off, page_words, slot_words, my_off
    return kv_addressing


def make_state_writer(HG: int, D: int, NT: int, ROWS: int, STRIDE: int, sigmoid: bool, store_elem):
    """Device function ``(tid, r, slot, h0, num_qo_heads, st_acc, st_m, st_l, out, lse,
    part_o, part_lse)``, the end of a work item in the warp and tensor-core kernels:
    the ``ROWS`` streams of a CTA leave their states in shared memory (stream ``y``,
    head ``g`` at ``y * STRIDE + g``: accumulator ``st_acc[.. * D + dim]``, max
    ``st_m``, mass ``st_l``); once the block has met, fold them with the merge rule of
    docs/concepts/state.md (sigmoid states just add), write the final row (``slot <
    0``) or the partial state of slot ``slot``, and meet again (the next item
    overwrites the states)."""

    @device_fn
    def write_states(tid, r, slot, h0, num_qo_heads, st_acc, st_m, st_l, out, lse, part_o, part_lse):
        cuda.syncthreads()
        for i in range(tid, HG * D, NT):
            g = i // D
            dd = i - g * D
            h = h0 + g
            o = float32(0.0)
            row_lse = float32(math.nan)
            if sigmoid:
                for y in range(ROWS):
                    o += st_acc[(y * STRIDE + g) * D + dd]
            else:
                # M = max_y m_y;  l = sum_y 2^(m_y - M) l_y;  o = sum_y 2^(m_y - M) acc_y / l;
                # lse = M + log2(l)   (M = -inf: no stream saw a key, o = 0)
                mm = NEG_INF
                for y in range(ROWS):
                    mm = NR.max_nan(mm, st_m[y * STRIDE + g])
                row_lse = NEG_INF
                if mm != NEG_INF:
                    tot = float32(0.0)
                    for y in range(ROWS):
                        wy = exp2f(st_m[y * STRIDE + g] - mm)
                        tot += wy * st_l[y * STRIDE + g]
                        o += wy * st_acc[(y * STRIDE + g) * D + dd]
                    o = o / tot
                    row_lse = mm + math.log2(tot)
            if slot < 0:
                store_elem(out, (int64(r) * num_qo_heads + h) * D + dd, o)
                if dd == 0:
                    lse[int64(r) * num_qo_heads + h] = row_lse
            else:
                part_o[(int64(slot) * num_qo_heads + h) * D + dd] = o
                if dd == 0:
                    part_lse[int64(slot) * num_qo_heads + h] = row_lse
        cuda.syncthreads()
    return write_states
