"""A decode call as a validated problem, and how its kernel is launched: the
pieces that both entry paths of :func:`nbattn.cuda.decode.batch_decode_paged`
(the general one in :mod:`nbattn.cuda.decode`, the launch layer of
:mod:`nbattn.cuda.decode_call`) and the decode wrapper
(:mod:`nbattn.cuda.decode_wrapper`) use.

* :class:`DecodeProblem` and its checks (:func:`check_head_dim`, :func:`check_out`);
* :func:`decode_kernel`, the compiled kernel of a
  :class:`~nbattn.cuda.kernels.decode_common.DecodeConfig` (the three builders of
  :mod:`nbattn.cuda.kernels`);
* :func:`launch_for` / :func:`decode_launch`, a launch's ``(kernel, grid, threads,
  args)`` over a work list, and :func:`decode_arg_index`, where its arguments sit;
* :func:`split_rule` and :func:`choose_chunk`, the built-in split heuristic;
* :func:`window_edge` and :func:`first_visible`, where a sliding window lets the
  work list begin.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

from .. import layout as L
from ..variants import Variant
from .blocks.primitives import SIMULATOR
from .host import arrays as A
from .host.driver import sm_count
from .kernels.decode_common import DecodeConfig, WorkList, make_config
from .kernels.decode_smem import build_smem_kernel
from .kernels.decode_tc import build_tc_kernel
from .kernels.decode_warp import build_warp_kernel
from .tuning import DECODE, DecodeTuning

__all__ = ["DecodeProblem", "MAX_HEAD_DIM", "check_head_dim", "check_out", "aligned_16", "KERNELS",
           "decode_kernel", "launches_programmatically", "decode_launch", "launch_for", "decode_arg_index",
           "split_rule", "choose_chunk", "window_edge", "first_visible"]

MAX_HEAD_DIM = 256


@dataclass
class DecodeProblem:
    """A validated decode call: device arrays, sizes, variant, output handles, tuning."""
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
    tuning: DecodeTuning = DECODE
    kv_code: str | None = None    # an fp8 cache ("e4m3" | "e5m2"); sm_scale then holds k_scale too
    v_scale: float = 1.0          # fp8: the output's factor (docs/concepts/layouts.md, "fp8 KV caches")

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    def config(self) -> DecodeConfig:
        return make_config(self.code, self.head_dim, self.group, self.kv_layout, self.variant,
                           self.aligned, self.batch * self.num_kv_heads, self.tuning, self.kv_code)


def check_head_dim(head_dim: int, kv_code: str | None = None) -> None:
    """LayoutError unless head_dim is a multiple of 8 in 8..MAX_HEAD_DIM (of 16 for an
    fp8 cache, ``kv_code``: a 16-byte load holds 16 fp8 values)."""
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise L.LayoutError(f"paged_kv_cache: head_dim must be a multiple of 8 in 8..{MAX_HEAD_DIM} "
                            f"(16-byte vector loads), got {head_dim}")
    if kv_code is not None and head_dim % 16:
        raise L.LayoutError(f"paged_kv_cache: an fp8 cache needs head_dim a multiple of 16 (16-byte vector "
                            f"loads of 16 fp8 values), got {head_dim}")


def check_out(name: str, x: Any, shape: tuple, code: str | None, kind: str) -> None:
    """LayoutError unless the caller's buffer ``x`` (``out`` or ``lse``) has ``shape``, the
    dtype ``code`` (None: float32), and lives where q (of ``kind``) lives, contiguous."""
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


def aligned_16(*devs) -> bool:
    """Whether every device array starts at a 16-byte aligned address (always, in the simulator)."""
    if SIMULATOR:
        return True
    return all(d.__cuda_array_interface__["data"][0] % 16 == 0 for d in devs)


# ---------------------------------------------------------------------------
# The kernel of a configuration, and a launch of it over a work list
# ---------------------------------------------------------------------------

KERNELS: dict = {}      # compiled decode kernels by DecodeConfig


def decode_kernel(cfg: DecodeConfig):
    """The compiled decode kernel for ``cfg`` (cached by ``cfg``, its tuning included;
    on disk too on the GPU)."""
    k = KERNELS.get(cfg)
    if k is None:
        if cfg.path == "warp":
            k = build_warp_kernel(cfg, cfg.nthreads // 32, cfg.unroll, cfg.min_blocks)
        elif cfg.path == "tc":
            k = build_tc_kernel(cfg, cfg.nthreads // 32, cfg.min_blocks)
        else:
            k = build_smem_kernel(cfg)
        KERNELS[cfg] = k
    return k


def launches_programmatically(cfg: DecodeConfig) -> bool:
    """Whether :func:`nbattn.cuda.decode.split_runner` (and the plain call) launch ``cfg``'s
    kernel programmatically: the
    one-CTA-an-SM tensor-core shape of small batches, when ``DecodeTuning.programmatic``
    says so.  With several CTAs an SM a programmatic launch's CTAs take SM slots as the
    previous kernel frees them and start unevenly spread, so other shapes launch plainly."""
    return cfg.tuning.programmatic and cfg.path == "tc" and cfg.min_blocks == 1


def decode_launch(p: DecodeProblem, work: WorkList, partial_o=None, partial_lse=None, prefetch: bool = False):
    """:func:`launch_for` with the problem's own kernel configuration (see there)."""
    return launch_for(p, p.config(), work, partial_o, partial_lse, prefetch)


def launch_for(p: DecodeProblem, cfg: DecodeConfig, work: WorkList, partial_o=None, partial_lse=None,
               prefetch: bool = False):
    """``(kernel, grid, threads, args)`` of the decode kernel over a work list (device
    int32 arrays); None for an empty list.

    ``partial_o [slots, num_qo_heads, head_dim]`` / ``partial_lse [slots,
    num_qo_heads]`` (float32 device arrays) receive items with ``out_slot >= 0``;
    items with ``-1`` write ``p.out_dev`` / ``p.lse_dev``.  Grid ``(len(work.cta_indptr)-1,
    num_qo_heads // heads_per_cta)`` (flattened to 1-D on the warp path).  ``prefetch``: the
    small-batch tensor-core shape prefetches its first K/V into L2 before its programmatic
    dependency wait (``DecodeTuning.prefetch_steps``; only worth it in a programmatic launch)."""
    num_ctas = int(work.cta_indptr.shape[0]) - 1
    if num_ctas <= 0:
        return None
    if partial_o is None:
        partial_o = cuda.device_array(1, np.float32, stream=p.stream)
        partial_lse = cuda.device_array(1, np.float32, stream=p.stream)
    n_hb = p.num_qo_heads // cfg.heads_per_cta
    tail = (A.flat(p.out_dev), A.flat(p.lse_dev), A.flat(partial_o), A.flat(partial_lse),
            p.slopes, np.float32(p.sm_scale), np.float32(p.variant.sigmoid_bias), np.float32(p.v_scale))
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
               partial_lse=first + 8, slopes=first + 9, sm_scale=first + 10, sigmoid_bias=first + 11,
               v_scale=first + 12)
    return idx


# ---------------------------------------------------------------------------
# The built-in split heuristic
# ---------------------------------------------------------------------------

def choose_chunk(p: DecodeProblem) -> int | None:
    """Built-in split heuristic: split only when the unsplit grid leaves CTA slots
    of the GPU empty (slots = SMs x the CTAs per SM the kernel's registers
    allow), into at most one wave of CTAs -- a second, partial wave costs as
    much as a full one -- and into chunks of at least a few tiles; None means
    no split."""
    ctas, slots, grain, floor = split_rule(p.config(), p.batch, p.num_qo_heads)
    seen = p.kv_lens - first_visible(p.kv_lens, window_edge(p.variant), grain)
    longest = int(seen.max()) if p.batch else 0
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


# ---------------------------------------------------------------------------
# Keys no query can see, as data
# ---------------------------------------------------------------------------

def window_edge(variant: Variant) -> int:
    """How many keys before the query a decode query can see, or -1 when it may see
    any key: ``window_left`` for a sliding window without StreamingLLM sink tokens
    (those keep the first keys visible too)."""
    return int(variant.window_left) if variant.window_left >= 0 and variant.sink_size == 0 else -1


def first_visible(kv_lens: np.ndarray, edge: int, align: int) -> np.ndarray:
    """The key each request's work begins at: ``kv_len - 1 - edge`` (a decode query
    sits at its request's last key, and the window hides every key further back),
    rounded down to ``align`` so that chunks stay aligned as the kernels' tiles
    need; 0 for every request when ``edge`` is -1.

    The work list then never visits the pages in front of the window (what
    FlexAttention's ``BlockMask`` does for blocks that no query sees); the kernels
    still mask the keys between the rounded start and the window's edge.
    Exact: a hidden key is skipped by the NaN rule, never weighted by 0."""
    lens = np.asarray(kv_lens, np.int64)
    if edge < 0:
        return np.zeros(lens.shape, np.int64)
    return np.maximum(lens - 1 - edge, 0) // align * align
