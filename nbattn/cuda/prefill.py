"""Batch prefill / append attention as numba.cuda kernels (docs/concepts/layouts.md, masks.md, state.md).

What it computes: exactly :func:`nbattn.reference.batch_prefill_paged`,
``batch_prefill_ragged`` and ``single_prefill`` -- same arguments, same
variants, output in q's dtype plus the base-2 LSE in float32.

Work decomposition (docs/concepts/masks.md).  GQA heads are fused into rows: for one
KV head, fused row ``r`` of a request is query position ``r // group`` and
query head ``kv_head*group + r % group``.  A *work item* is one tile of
``T_q`` consecutive fused rows of one request (or of one cascade group, or one
BSR block row).  A kernel build is a per-row body ``tile(w, ...)`` (a device
function) under one of two entries: :func:`prefill_entry`, grid ``(n_work,
num_kv_heads)`` with one block per work item and KV head (the public
functions), or :func:`persistent_entry`, a fixed grid of C blocks per KV head
each walking its queue of work items (the plan/run wrapper).  Either way
every KV tile a block gathers serves ``T_q`` rows -- all the query heads of
the group at once.

Keys.  A work item walks its keys ``t = 0 .. kv_len-1`` in tiles of ``T_k``.
Where key ``t`` lives is the one thing that differs between forms, chosen when
the kernel is built (``mode``):

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

Per KV tile (both paths): gather K and V into shared memory, scores,
variant (scale, ALiBi, soft-cap, score_mod; causal, window/sinks, mask_mod),
online softmax in fp32 (running max ``m``, sum ``l``, rescale ``alpha``),
accumulate ``P @ V``.  At the end ``o / l`` and ``lse = (m + ln l) / ln 2``;
a row that kept no key gives ``o = 0`` and ``lse = -inf``; sigmoid attention
adds ``sigmoid(s + bias) v`` and has no LSE (NaN).

Two paths build the same tile:

- CUDA cores (:func:`core_tile`, here): plain per-thread loops over shared
  memory; it is the path numba's simulator runs (CI) and the fallback.
- Tensor cores (:func:`nbattn.cuda.kernels.prefill_tc.tensor_core_tile`, GPU only,
  fp16/bf16): 16 fused rows per warp; ``S = Q K^T`` and ``O += P V`` on
  ``mma.sync.m16n8k16`` (:mod:`nbattn.cuda.blocks.mma`), softmax on the accumulator
  fragments with quad shuffles, P fed to the second product straight from
  registers.  head_dim 64/128 take the pipelined kernel (cp.async loads that
  overlap the math, ldmatrix, 64 x 64 tiles); other head dims the plain mma kernel.

Shared building blocks: inputs, outputs and streams (:mod:`nbattn.cuda.host.arrays`;
with torch tensors the kernels launch on torch's current stream unless a
``stream`` is passed), element loads/stores (:func:`nbattn.cuda.blocks.primitives.element_io`;
16-bit data reach the kernels as raw uint16), the variant
(:func:`nbattn.cuda.blocks.variants.variant_device_fns`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import layout as L
from ..variants import Variant, alibi_slopes, check_return_lse, variant_from_kwargs

from numba import cuda, float32, int32  # noqa: E402  (after the shim)

from .host import arrays as A # noqa: E402
from .blocks import mma as _mma # noqa: E402
from .kernels import prefill_tc as TC # noqa: E402
from .kernels import prefill_cc as CC # noqa: E402
from .blocks import nanrule as NR # noqa: E402
from .host.driver import BoundLaunch, Span, StagingRing, handle_of, jit_kernel, torch_stream, launch as launch_kernel  # noqa: E402
from .blocks.primitives import SIMULATOR, device_fn, element_io  # noqa: E402
from .blocks.variants import LOG2E, sigmoid_weight, variant_device_fns  # noqa: E402

__all__ = ["batch_prefill_paged", "batch_prefill_ragged", "single_prefill"]

NO_KEY = -(2 ** 30)        # kv position of a tile slot that holds no key

# ---------------------------------------------------------------------------
# Host side: streams, device arrays, outputs (nbattn.cuda.host.arrays)
# ---------------------------------------------------------------------------


def _default_stream(stream) -> bool:
    """Whether the caller left ``stream`` at its default (torch's current stream is then used)."""
    return stream is None or (isinstance(stream, int) and stream == 0)


def resolve_stream(stream, *arrays: Any):
    """The stream to launch on: the caller's ``stream`` when one is passed, else
    (``stream=0``, the default) torch's current stream when any argument is a
    torch CUDA tensor -- as decode does -- else the default stream."""
    if stream is None or (isinstance(stream, int) and stream == 0):
        return A.launch_stream(*arrays)
    return stream


def device_in(x: Any, name: str, code: str, stream, direct: bool = False):
    """A raw-typed device array over an input (copied from the host, zero-copy on
    the device; strided device arrays are fine: the kernels index with strides).
    With ``direct`` (see :func:`torch_direct`) a torch CUDA tensor is passed on as
    it is: :func:`launch` reads its pointer, shape and strides itself."""
    if direct:
        return x
    return A.to_device(x, name, stream, code, strided=True)


def torch_direct(*arrays: Any) -> bool:
    """Whether a call's arrays (None for an absent ``out=``/``lse=``) are all torch CUDA
    tensors: such a call launches on torch's current stream through a bound launch,
    making no numba array on the way (:func:`launch`)."""
    return all(x is None or (A.is_torch(x) and x.is_cuda) for x in arrays) and arrays[0] is not None


class _Outputs:
    """Output and LSE of one call in the caller's world (:mod:`nbattn.cuda.host.arrays`):
    ``out=``/``lse=`` used in place on the device, copied into on the host.

    Two results differ from :func:`nbattn.cuda.host.arrays.finish` (kept as they
    were): a NumPy bf16 ``q`` (raw ``|V2``) gives float32 values -- NumPy has no
    bf16, and the golden model answers in float32 too -- and a
    ``__cuda_array_interface__`` fp16 ``q`` gives a float16 numba array.
    """

    def __init__(self, like: Any, shape: tuple, code: str, out: Any, lse: Any, want_lse: bool, stream,
                 direct: bool = False):
        if out is not None:
            if tuple(out.shape) != shape or A.dtype_code(out, "out") != code:
                raise L.LayoutError(f"out: must have shape {shape} and q's dtype, got "
                                    f"{tuple(out.shape)} {L.dtype_of(out)}")
        if lse is not None and (tuple(lse.shape) != shape[:2] or L.dtype_of(lse) != "float32"):
            raise L.LayoutError(f"lse: must be float32 with shape {shape[:2]}, got "
                                f"{tuple(lse.shape)} {L.dtype_of(lse)}")
        self.kind, self.code, self.stream, self.want_lse = A.kind_of(like), code, stream, want_lse
        self.out, self.lse = out, lse
        if direct:                                   # torch CUDA tensors, written in place by launch()
            import torch
            A.check_writeable("out", out)
            self.d_out = self.out_user = out if out is not None else torch.empty(shape, dtype=like.dtype,
                                                                                 device=like.device)
            self.d_lse = self.lse_user = lse if lse is not None else torch.empty(shape[:2], dtype=torch.float32,
                                                                                 device=like.device)
            return
        self.out_user, self.d_out = A.output_for("out", out, self.kind, shape, code, stream, like=like,
                                                 strided=True)
        self.lse_user, self.d_lse = A.output_for("lse", lse, self.kind, shape[:2], "f32", stream, like=like,
                                                 strided=True)

    def finish(self):
        o = A.finish_into(self.kind, self.out, self.out_user, self.d_out, self.code, self.stream)
        if self.out is None and self.kind == "numpy" and self.code == "bf16":
            o = (np.ascontiguousarray(o).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif self.out is None and self.kind == "cai" and self.code == "f16":
            o = o.view(np.float16)
        s = A.finish_into(self.kind, self.lse, self.lse_user, self.d_lse, "f32", self.stream)
        return (o, s) if self.want_lse else o


# ---------------------------------------------------------------------------
# Kernel specification and device helpers
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelSpec:
    mode: str           # "paged" | "contig" | "bsr"
    kv_layout: str      # "NHD" | "HND" (for "contig"/"bsr": layout of k, v)
    kind: str           # element type of q/k/v: "f16" | "bf16" | "f32"
    out_kind: str       # element type of out (cascade partial states are "f32")
    head_dim: int
    group: int
    num_qo_heads: int
    variant: Variant
    tensor_cores: bool
    tile_q: int
    tile_k: int
    threads: int



def kv_reader(mode: str, kv_layout: str, load: Callable) -> Callable:
    """Device function ``(src, which, page, slot, head, d)`` reading K (which=0)
    or V (which=1) at element d of a row; ``src`` is the paged cache, or k / v.
    ``load(array, index)`` decides what comes back: one float (``element_io``'s
    ``load_elem``, CUDA-core path) or 4 x uint32 (``mma.load_u32x4``, tensor cores)."""
    if mode == "paged":
        if kv_layout == "NHD":
            @cuda.jit(device=True, inline=True)
            def kv(src, which, page, slot, h, d):
                return load(src, (page, which, slot, h, d))
        else:
            @cuda.jit(device=True, inline=True)
            def kv(src, which, page, slot, h, d):
                return load(src, (page, which, h, slot, d))
    elif kv_layout == "NHD":
        @cuda.jit(device=True, inline=True)
        def kv(src, which, page, slot, h, d):
            return load(src, (slot, h, d))
    else:
        @cuda.jit(device=True, inline=True)
        def kv(src, which, page, slot, h, d):
            return load(src, (h, slot, d))
    return kv


def key_locator(mode: str) -> Callable:
    """Device function ``(kv_indices, kv_ptr, kv_base, t, block, n_keys) -> (page, slot, pos)``:
    where key t of a work item lives and its position (NO_KEY when it does not exist)."""
    if mode == "paged":
        @cuda.jit(device=True, inline=True)
        def locate(kv_indices, kv_ptr, kv_base, t, block, n_keys):
            return kv_indices[kv_ptr + t // block], t % block, t
    elif mode == "contig":
        @cuda.jit(device=True, inline=True)
        def locate(kv_indices, kv_ptr, kv_base, t, block, n_keys):
            return 0, kv_base + t, t
    else:
        @cuda.jit(device=True, inline=True)
        def locate(kv_indices, kv_ptr, kv_base, t, block, n_keys):
            row = kv_indices[kv_ptr + t // block] * block + t % block
            if row >= n_keys:
                return 0, 0, NO_KEY
            return 0, row, row
    return locate


# ---------------------------------------------------------------------------
# The CUDA-core kernel
# ---------------------------------------------------------------------------

def tile_key_range(var: Variant, positional: bool):
    """Device function ``(s_diag, s_qpos, n_rows, kv_begin, kv_end) -> (lo, hi, sink_end)``:
    the keys ``[lo, hi)`` a query tile can see, so tiles wholly above the causal
    diagonal or left of the window are skipped, not masked (issue 4); plus the
    end of the always-visible sink keys.  Causal ends at the last row's
    diagonal, a window starts at the first row's; ``positional`` is False for
    block-sparse views, whose key positions do not grow with t.  Both prefill
    paths (CUDA cores, tensor cores) use it."""
    causal, window, sinks = var.causal, int(var.window_left), int(var.sink_size)

    @cuda.jit(device=True, inline=True)
    def key_range(s_diag, s_qpos, n_rows, kv_begin, kv_end):
        lo = kv_begin
        hi = kv_end
        sink_end = 0
        if positional and (causal or window >= 0):
            d_min = s_diag[0]
            d_max = s_diag[0]
            for r in range(1, n_rows):
                d_min = min(d_min, s_diag[r])
                d_max = max(d_max, s_diag[r])
            if causal:
                hi = min(hi, d_max + 1)
            if window >= 0:
                lo = max(lo, d_min - window)
                # sinks: keys with kv_idx < sink_size, i.e. t < sink_size - kvoff of some row
                for r in range(n_rows if sinks > 0 else 0):
                    sink_end = max(sink_end, sinks - (s_qpos[r] - s_diag[r]))
        return lo, hi, sink_end
    return key_range


def tile_item(spec: KernelSpec):
    """Device function ``(work, wi) -> (qo_start, row0, n_rows, kv_ptr, kv_base,
    kv_begin, kv_end, out_shift)``: row ``wi`` of a work list (:func:`build_work`'s
    columns) as every prefill tile reads it; ``n_rows`` counts the tile's real
    fused rows (at most ``T_q``), ``out_shift`` moves a split tile's rows to its
    partial-state slot."""
    T_q, group = spec.tile_q, spec.group

    @cuda.jit(device=True, inline=True)
    def item(work, wi):
        qo_start, qo_len, row0 = work[wi, 0], work[wi, 1], work[wi, 2]
        n_rows = min(T_q, qo_len * group - row0)
        return qo_start, row0, n_rows, work[wi, 3], work[wi, 4], work[wi, 5], work[wi, 6], work[wi, 7] - qo_start
    return item


def tile_rows(spec: KernelSpec, positional: bool):
    """Device function ``(tid, n_rows, qo_start, row0, row_pos, row_kvoff, row_req,
    kv_begin, kv_end, s_qpos, s_diag, s_req, s_range)`` every prefill tile starts
    with: each fused row's query position, diagonal (``q_idx - kvoff``: the last
    key t a causal row sees) and request go to shared memory -- rows past the
    tile get a diagonal no key reaches -- then thread 0 publishes the tile's key
    range (:func:`tile_key_range`) as ``s_range = (lo, hi, sink_end)``, visible
    after the caller's next barrier."""
    T_q, NT, group = spec.tile_q, spec.threads, spec.group
    key_range = tile_key_range(spec.variant, positional)

    @cuda.jit(device=True, inline=True)
    def stage(tid, n_rows, qo_start, row0, row_pos, row_kvoff, row_req, kv_begin, kv_end,
              s_qpos, s_diag, s_req, s_range):
        for r in range(tid, T_q, NT):
            if r < n_rows:
                qi = qo_start + (row0 + r) // group
                s_qpos[r] = row_pos[qi]
                s_diag[r] = row_pos[qi] - row_kvoff[qi]
                s_req[r] = row_req[qi]
            else:
                s_qpos[r] = 0
                s_diag[r] = 2 ** 30
                s_req[r] = 0
        cuda.syncthreads()
        if tid == 0:
            lo, hi, sink_end = key_range(s_diag, s_qpos, n_rows, kv_begin, kv_end)
            s_range[0] = lo
            s_range[1] = hi
            s_range[2] = sink_end
    return stage


def tile_visible(spec: KernelSpec, positional: bool):
    """Device function ``(r, row_ok, t_local, s_qpos, s_diag, s_req, s_kpos, head0, row0)
    -> bool``: whether fused row ``r`` of the tile sees key ``t_local`` (the key
    exists, the row is not padding and every mask keeps it) -- the mask half of
    :func:`tile_score`."""
    group = spec.group
    _, keep = variant_device_fns(spec.variant)

    @cuda.jit(device=True, inline=True)
    def visible(r, row_ok, t_local, s_qpos, s_diag, s_req, s_kpos, head0, row0):
        pos = s_kpos[t_local]
        if not row_ok or pos == NO_KEY:
            return False
        q_idx = s_qpos[r]
        kv_idx = pos + (q_idx - s_diag[r] if positional else 0)
        return keep(s_req[r], head0 + (row0 + r) % group, q_idx, kv_idx)
    return visible


def tile_score(spec: KernelSpec, positional: bool):
    """Device function ``(x, r, row_ok, t_local, s_qpos, s_diag, s_req, s_kpos, head0,
    row0, slopes)``: the raw dot product ``x`` of the tile's fused row ``r`` and key
    ``t_local`` as a base-2 logit (natural for sigmoid) with the variant applied,
    or -inf where the row does not see the key (:func:`tile_visible`).  The row's
    query head is ``head0 + (row0 + r) % group``: a tile starts at fused row
    ``row0`` of its request, which need not be a multiple of the group.  The
    register-tiled and tensor-core tiles use it."""
    group, var = spec.group, spec.variant
    sigmoid = var.use_sigmoid
    scale = float32(var.scale(spec.head_dim))
    log2e = float32(LOG2E)
    neg_inf = float32(-math.inf)
    transform, _ = variant_device_fns(var)
    visible = tile_visible(spec, positional)

    @cuda.jit(device=True, inline=True)
    def score(x, r, row_ok, t_local, s_qpos, s_diag, s_req, s_kpos, head0, row0, slopes):
        if not visible(r, row_ok, t_local, s_qpos, s_diag, s_req, s_kpos, head0, row0):
            return neg_inf
        q_idx = s_qpos[r]
        kv_idx = s_kpos[t_local] + (q_idx - s_diag[r] if positional else 0)
        h = head0 + (row0 + r) % group
        s = NR.checked(x * scale, transform(x * scale, s_req[r], h, q_idx, kv_idx, slopes[h]))
        if sigmoid:
            return s
        return s * log2e
    return score


def core_tile(spec: KernelSpec):
    """Scalar path: threads stride over the (row, key) and (row, dim) grids of
    a tile in shared memory.  Launch: grid (n_work, num_kv_heads), ``threads``."""
    D, T_q, T_k, NT, group = spec.head_dim, spec.tile_q, spec.tile_k, spec.threads, spec.group
    var = spec.variant
    sigmoid = var.use_sigmoid
    positional = spec.mode != "bsr"       # key positions grow with t: tile ranges can be cut
    stage = tile_rows(spec, positional)
    item = tile_item(spec)
    scale = float32(var.scale(D))
    load, _, _ = element_io(spec.kind)
    _, store, _ = element_io(spec.out_kind)
    kv = kv_reader(spec.mode, spec.kv_layout, load)
    locate = key_locator(spec.mode)
    transform, keep = variant_device_fns(var)
    bias = float32(var.sigmoid_bias)
    neg_inf = float32(-math.inf)
    inv_ln2 = float32(LOG2E)
    store_dtype = float32

    @device_fn
    def tile(w, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
             block, n_keys, out, lse):
        kv_head = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        qo_start, row0, n_rows, kv_ptr, kv_base, kv_begin, kv_end, out_shift = item(work, w)

        s_q = cuda.shared.array((T_q, D), store_dtype)
        s_o = cuda.shared.array((T_q, D), float32)
        s_k = cuda.shared.array((T_k, D), store_dtype)
        s_v = cuda.shared.array((T_k, D), store_dtype)
        s_p = cuda.shared.array((T_q, T_k), float32)
        s_kpos = cuda.shared.array(T_k, int32)
        s_m = cuda.shared.array(T_q, float32)
        s_l = cuda.shared.array(T_q, float32)
        s_alpha = cuda.shared.array(T_q, float32)
        s_qpos = cuda.shared.array(T_q, int32)
        s_diag = cuda.shared.array(T_q, int32)      # q_idx - kvoff: last key t a causal row sees
        s_req = cuda.shared.array(T_q, int32)
        s_range = cuda.shared.array(3, int32)

        # Query tile (fused rows) and its per-row positions.
        for e in range(tid, T_q * D, NT):
            r = e // D
            d = e % D
            s_o[r, d] = 0.0
            if r < n_rows:
                qi = qo_start + (row0 + r) // group
                h = kv_head * group + (row0 + r) % group
                s_q[r, d] = load(q, (qi, h, d))
            else:
                s_q[r, d] = 0.0
        for r in range(tid, T_q, NT):
            s_m[r] = neg_inf
            s_l[r] = 0.0
        # rows' positions, then the key range this tile can see
        stage(tid, n_rows, qo_start, row0, row_pos, row_kvoff, row_req, kv_begin, kv_end,
              s_qpos, s_diag, s_req, s_range)
        cuda.syncthreads()
        lo = s_range[0]
        hi = s_range[1]
        sink_end = s_range[2]

        for t0 in range(kv_begin, hi, T_k):
            if t0 + T_k <= lo and t0 >= sink_end:
                continue   # entirely left of the window and holds no sink
            # Gather the KV tile once for all T_q rows.
            for e in range(tid, T_k * D, NT):
                j = e // D
                d = e % D
                t = t0 + j
                if t < hi:
                    page, slot, pos = locate(kv_indices, kv_ptr, kv_base, t, block, n_keys)
                    if pos != NO_KEY:
                        xv = kv(v_src, 1, page, slot, kv_head, d)
                        if math.isfinite(xv):
                            s_k[j, d] = kv(k_src, 0, page, slot, kv_head, d)
                            s_v[j, d] = xv
                        else:       # the NaN rule: a non-finite V poisons the key's score instead
                            s_k[j, d] = math.nan
                            s_v[j, d] = 0.0
                    else:
                        s_k[j, d] = 0.0
                        s_v[j, d] = 0.0
                    if d == 0:
                        s_kpos[j] = pos
                else:
                    s_k[j, d] = 0.0
                    s_v[j, d] = 0.0
                    if d == 0:
                        s_kpos[j] = NO_KEY
            cuda.syncthreads()

            # Scores with the variant applied; dropped keys become -inf.
            for e in range(tid, T_q * T_k, NT):
                r = e // T_k
                j = e % T_k
                s = neg_inf
                if r < n_rows and s_kpos[j] != NO_KEY:
                    q_idx = s_qpos[r]
                    kv_idx = s_kpos[j] + (q_idx - s_diag[r] if positional else 0)
                    h = kv_head * group + (row0 + r) % group
                    b = s_req[r]
                    if keep(b, h, q_idx, kv_idx):
                        acc = float32(0.0)
                        for d in range(D):
                            acc += float32(s_q[r, d]) * float32(s_k[j, d])
                        s = NR.checked(acc * scale, transform(acc * scale, b, h, q_idx, kv_idx, slopes[h]))
                s_p[r, j] = s
            cuda.syncthreads()

            # Online softmax, one thread per row: new max, rescale factor, weights.
            for r in range(tid, T_q, NT):
                if sigmoid:
                    for j in range(T_k):
                        s = s_p[r, j]
                        s_p[r, j] = sigmoid_weight(s, bias) if s != neg_inf else float32(0.0)
                    s_alpha[r] = 1.0
                else:
                    m_old = s_m[r]
                    m_new = m_old
                    for j in range(T_k):
                        m_new = NR.max_nan(m_new, s_p[r, j])
                    if m_new == neg_inf:
                        alpha = float32(1.0)
                        for j in range(T_k):
                            s_p[r, j] = 0.0
                    else:
                        alpha = math.exp(m_old - m_new)
                        total = float32(0.0)
                        for j in range(T_k):
                            p = math.exp(s_p[r, j] - m_new)
                            s_p[r, j] = p
                            total += p
                        s_l[r] = s_l[r] * alpha + total
                        s_m[r] = m_new
                    s_alpha[r] = alpha
            cuda.syncthreads()

            # O = alpha * O + P @ V.
            for e in range(tid, T_q * D, NT):
                r = e // D
                d = e % D
                acc = s_o[r, d] * s_alpha[r]
                for j in range(T_k):
                    acc += s_p[r, j] * float32(s_v[j, d])
                s_o[r, d] = acc
            cuda.syncthreads()

        # Normalize and write; a row that kept no key writes 0 and -inf.
        for e in range(tid, n_rows * D, NT):
            r = e // D
            d = e % D
            qi = qo_start + (row0 + r) // group
            h = kv_head * group + (row0 + r) % group
            o = s_o[r, d]
            if not sigmoid:
                l_r = s_l[r]
                if s_m[r] != s_m[r] or l_r != l_r:      # a visible key was non-finite
                    o = math.nan
                elif s_m[r] == neg_inf:                 # no visible key (a flag, not l > 0)
                    o = float32(0.0)
                else:
                    o = o / l_r
            store(out, (qi + out_shift, h, d), o)
        for r in range(tid, n_rows, NT):
            qi = qo_start + (row0 + r) // group
            h = kv_head * group + (row0 + r) % group
            if sigmoid:
                lse[qi + out_shift, h] = math.nan
            elif s_m[r] != s_m[r] or s_l[r] != s_l[r]:
                lse[qi + out_shift, h] = math.nan
            elif s_m[r] == neg_inf:
                lse[qi + out_shift, h] = neg_inf
            else:
                lse[qi + out_shift, h] = (s_m[r] + math.log(s_l[r])) * inv_ln2

    return tile


def _jit_entry(kernel, bounds):
    return jit_kernel(kernel) if bounds is None else jit_kernel(kernel, launch_bounds=bounds)


def prefill_entry(tile, bounds=None):
    """The ``__global__`` function around a kernel build's per-row body
    ``tile(w, ...)``: one work row per CTA, ``grid = (rows, num_kv_heads)``;
    ``bounds`` = (threads, CTAs per SM) launch bounds, or None."""
    def kernel(q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
               block, n_keys, out, lse):
        tile(cuda.blockIdx.x, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req,
             slopes, block, n_keys, out, lse)
    return _jit_entry(kernel, bounds)


def persistent_entry(tile, bounds=None):
    """A fixed grid of C CTAs per KV head walking work queues (docs/concepts/scheduler.md).

    ``grid = (C, num_kv_heads)``; CTA ``c`` runs rows ``cta_indptr[c] :
    cta_indptr[c+1]`` of ``work`` in order, so the launch does not depend on
    the plan.  (The body's static shared memory is allocated once per kernel;
    a second body for the other output kind would double it past 48 KB, so the
    plan/run wrapper launches this once per output kind.)"""
    def kernel(q, k_src, v_src, kv_indices, work, cta_indptr, row_pos, row_kvoff, row_req,
               slopes, block, n_keys, out, lse):
        c = cuda.blockIdx.x
        for w in range(cta_indptr[c], cta_indptr[c + 1]):
            tile(w, q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
                 block, n_keys, out, lse)
            cuda.syncthreads()          # the next row overwrites the shared tiles
    return _jit_entry(kernel, bounds)


_KERNELS: dict = {}


def get_tile(spec: KernelSpec):
    """The per-row body of a kernel build (device function), cached by spec."""
    key = ("tile", spec)
    tile = _KERNELS.get(key)
    if tile is None:
        if spec.tensor_cores:
            tile = TC.tensor_core_tile(spec)
        elif CC.covers(spec):       # register-tiled CUDA-core tile (nbattn.cuda.kernels.prefill_cc)
            tile = CC.cuda_core_tile(spec)
        else:
            tile = core_tile(spec)
        _KERNELS[key] = tile
    return tile


def get_kernel(spec: KernelSpec):
    """Compiled-kernel cache keyed by the spec (a Variant with user functions hashes by identity)."""
    kern = _KERNELS.get(spec)
    if kern is None:
        kern = prefill_entry(get_tile(spec), CC.launch_bounds(spec))
        kern.dynamic_smem = CC.dynamic_smem(spec)
        _KERNELS[spec] = kern
    return kern


def get_persistent_kernel(spec: KernelSpec):
    """:func:`persistent_entry` of a spec, cached."""
    key = ("persistent", spec)
    kern = _KERNELS.get(key)
    if kern is None:
        kern = persistent_entry(get_tile(spec), CC.launch_bounds(spec))
        kern.dynamic_smem = CC.dynamic_smem(spec)
        _KERNELS[key] = kern
    return kern


# ---------------------------------------------------------------------------
# Tile choice and launch
# ---------------------------------------------------------------------------

def kernel_tiles(head_dim: int, kind: str, tensor_cores: bool) -> tuple[int, int, int]:
    """(T_q, T_k, threads) of a prefill kernel build (the scheduler's tile heuristic
    is :func:`nbattn.sched.choose_tiles`).  The simulator gets small tiles (each thread is a
    Python thread); the scalar CUDA-core fallback fits its shared memory in 48 KB."""
    if tensor_cores:
        return TC.tensor_core_tiles(head_dim)
    cc = CC.cuda_core_tiles(head_dim, kind)
    if cc is not None:
        return cc
    if SIMULATOR:
        return 16, 16, 32
    budget = 48 * 1024 - 512
    for tq, tk in ((64, 32), (32, 32), (32, 16), (16, 16), (16, 8), (8, 8)):
        need = 4 * (2 * tq * head_dim + 2 * tk * head_dim + tq * tk)
        if need <= budget:
            return tq, tk, 128
    raise L.LayoutError(f"q: head_dim {head_dim} too large for the CUDA-core path")


def tensor_cores_usable(kind: str, head_dim: int, variant: Variant) -> bool:
    return (_mma.AVAILABLE and kind in ("f16", "bf16") and head_dim % 16 == 0
            and head_dim <= 256)


def build_work(qo_starts, qo_lens, kv_ptrs, kv_bases, kv_lens, group: int, tile_q: int,
               kv_chunk: int | None = None, out_starts=None, chunk_stride: int = 0) -> np.ndarray:
    """The work list: one row per (request-or-group, query tile, KV chunk).

    Columns: qo_start, qo_len, first fused row, kv_ptr, kv_base, kv_begin,
    kv_end, out_row0.  Keys ``kv_begin <= t < kv_end`` of the request are
    attended; chunk c (of ``kv_chunk`` keys) writes its rows from
    ``out_starts + c*chunk_stride`` (a partial state to merge later).  Empty
    requests get no work.
    """
    qo_starts, qo_lens = np.asarray(qo_starts, np.int64), np.asarray(qo_lens, np.int64)
    kv_lens = np.asarray(kv_lens, np.int64)
    out_starts = qo_starts if out_starts is None else np.asarray(out_starts, np.int64)
    kv_ptrs, kv_bases = np.asarray(kv_ptrs, np.int64), np.asarray(kv_bases, np.int64)
    # request i gets n_chunks[i] x n_tiles[i] rows, chunk-major; no loop over requests
    n_tiles = -(-qo_lens * group // tile_q)
    n_chunks = np.maximum(1, -(-kv_lens // kv_chunk)) if kv_chunk else np.ones_like(kv_lens)
    per_req = n_chunks * n_tiles
    req = np.repeat(np.arange(len(qo_lens)), per_req)
    local = np.arange(req.size) - np.repeat(np.cumsum(per_req) - per_req, per_req)
    chunk, tile = local // n_tiles[req], local % n_tiles[req]
    begin = chunk * kv_chunk if kv_chunk else np.zeros_like(chunk)
    end = np.minimum(kv_lens[req], begin + kv_chunk) if kv_chunk else kv_lens[req]
    rows = np.stack([qo_starts[req], qo_lens[req], tile * tile_q, kv_ptrs[req], kv_bases[req], begin, end,
                     out_starts[req] + chunk * chunk_stride], axis=1)
    return rows.astype(np.int32).reshape(-1, 8)


NAN_ROW = 128          # floats: 256 NaN half-words, a K row of head_dim <= 256


def nan_row_at(num_qo_heads: int) -> int:
    """Index in a prefill kernel's ``slopes`` where the NaN row starts (16-byte aligned)."""
    return (num_qo_heads + 3) // 4 * 4


def tile_slopes(num_qo_heads: int, alibi: bool) -> np.ndarray:
    """The ``slopes`` argument of every prefill kernel: ALiBi slopes (zeros when off)
    for the query heads, then from :func:`nan_row_at` a row of NaN that the pipelined
    tensor-core tile reads as K of a key whose V is not finite (the NaN rule; see
    :mod:`nbattn.cuda.blocks.nanrule`)."""
    at = nan_row_at(num_qo_heads)
    out = np.full(at + NAN_ROW, np.nan, np.float32)
    out[:num_qo_heads] = alibi_slopes(num_qo_heads) if alibi else 0.0
    return out


def launch(spec: KernelSpec, q, k_src, v_src, kv_indices: np.ndarray, work: np.ndarray,
           row_pos: np.ndarray, row_kvoff: np.ndarray, row_req: np.ndarray,
           block: int, n_keys: int, num_kv_heads: int, out, lse, stream=0):
    """Launch one prefill kernel over a work list (the shared entry of prefill,
    block-sparse and cascade)."""
    if len(work) == 0:
        return
    kernel = get_kernel(spec)
    work = longest_first(spec, work, row_pos, row_kvoff)
    slopes = tile_slopes(spec.num_qo_heads, spec.variant.has_alibi)
    idx = kv_indices if len(kv_indices) else np.zeros(1, np.int32)
    host_meta = (idx, work, row_pos, row_kvoff, row_req)
    grid = (len(work), num_kv_heads)
    dev, codes = (q, k_src, v_src, out, lse), (spec.kind,) * 3 + (spec.out_kind, "f32")
    if (_RECORDING is None and out is not None and lse is not None
            and all(isinstance(x, np.ndarray) for x in host_meta)):
        _launch_staged(kernel, grid, spec.threads, stream, dev, [*host_meta, slopes], block, n_keys, codes)
        return
    stream = _numba_stream(stream)
    q, k_src, v_src, out, lse = _raw_views(dev, codes, stream)
    meta = [A.device_meta(x, x, stream) for x in host_meta]
    args = (q, k_src, v_src, *meta, cuda.to_device(slopes, stream=stream), np.int32(block), np.int32(n_keys),
            out, lse)
    enqueue(kernel, grid, spec.threads, stream, args)


_BOUND: dict = {}              # bound launches by call shape, oldest first
BOUND_MOST = 64                # call shapes kept
_RING = StagingRing()


_ARG_NAMES = ("q", "k", "v", "out", "lse")


def _raw_views(dev, codes, stream) -> tuple:
    """The kernel's raw-typed numba views of torch CUDA tensors among ``dev`` (others as they are)."""
    return tuple(A.to_device(x, n, stream, c, strided=True) if x is not None and A.is_torch(x) else x
                 for x, n, c in zip(dev, _ARG_NAMES, codes))


def _numba_stream(stream):
    """A numba stream for numba's launch: a torch stream handle (see :func:`torch_direct`)
    wrapped, anything else as it is."""
    return cuda.external_stream(stream) if isinstance(stream, int) and stream else stream


def _shape_key(a) -> tuple:
    if A.is_torch(a):
        return (tuple(a.shape), a.stride(), a.dtype)
    return (tuple(a.shape), tuple(a.strides), a.dtype.str)


def _launch_staged(kernel, grid, threads, stream, dev, meta: list, block: int, n_keys: int,
                   codes: tuple) -> None:
    """:func:`launch` with host metadata: the five int32 arrays and the slopes are
    packed into one staging slot and sent with one asynchronous copy, and the
    kernel goes through a launch bound once per call shape (the shapes, strides
    and dtypes of q, k, v, out and lse; the last :data:`BOUND_MOST` shapes are
    kept), with only pointers, the metadata's sizes, scalars and the grid
    patched (:class:`nbattn.cuda.host.driver.BoundLaunch`)."""
    h = handle_of(stream)
    with _RING.lock:                                  # see StagingRing.lock
        slot, spans = _RING.stage(meta, h)
        key = (kernel, threads, tuple(_shape_key(a) for a in dev))
        bl = _BOUND.get(key)
        if bl is None:
            q, k_src, v_src, out, lse = _raw_views(dev, codes, _numba_stream(stream))
            bl = _BOUND[key] = BoundLaunch(kernel, grid, threads,
                                           (q, k_src, v_src, *[sp.view() for sp in spans], np.int32(block),
                                            np.int32(n_keys), out, lse),
                                           convert={i: Span.view for i in range(3, 9)})
            while len(_BOUND) > BOUND_MOST:
                _BOUND.pop(next(iter(_BOUND)))               # the oldest call shape
        for i, a in zip((0, 1, 2, 11, 12), dev):
            bl.set(i, a)
        for i, sp, m in zip(range(3, 9), spans, meta):       # the metadata's sizes change per call
            bl.set(i, sp, m.size, m.shape[0])
        bl.set_scalar(9, int(block))
        bl.set_scalar(10, int(n_keys))
        bl.set_grid(grid)
        bl(h)
        slot.done(h)


# Benchmarks switch the order off to time build_work's own order.
LONGEST_FIRST = True


def longest_first(spec: KernelSpec, work: np.ndarray, row_pos, row_kvoff) -> np.ndarray:
    """Causal work rows in launch order, most keys first (stable).

    CTAs start in ``blockIdx.x`` order, and :func:`build_work` lists a causal
    request's query tiles shortest first, so the longest tiles would start
    last and run alone at the end of the grid; starting them first is the LPT
    rule of docs/concepts/scheduler.md.  Rows are independent, so the order changes no
    result.  Other masks keep the list's order."""
    if not (LONGEST_FIRST and spec.variant.causal) or spec.mode == "bsr" or len(work) < 2:
        return work
    if not (isinstance(row_pos, np.ndarray) and isinstance(row_kvoff, np.ndarray)):
        return work
    qo_start, qo_len, row0 = (work[:, i].astype(np.int64) for i in range(3))
    last_q = qo_start + np.minimum(qo_len - 1, (row0 + spec.tile_q - 1) // spec.group)
    last_key = row_pos[last_q].astype(np.int64) - row_kvoff[last_q] + 1     # keys the tile's last row sees
    keys = np.clip(np.minimum(work[:, 6], last_key) - work[:, 5], 0, None)
    return work[np.argsort(-keys, kind="stable")]


_RECORDING: list | None = None


def enqueue(kernel, grid, threads, stream, args) -> None:
    """Launch now -- or, inside :func:`recording`, keep the launch to replay:
    benchmarks time the kernels apart from the host-side planning."""
    if _RECORDING is not None:
        _RECORDING.append((kernel, grid, threads, args))
    else:
        launch_kernel(kernel, grid, threads, stream, args)


class recording:
    """``with recording() as rec: fn(...)`` records fn's launches (host work,
    metadata uploads and output allocation happen once); ``rec.replay(stream)``
    runs exactly those launches again."""

    def __enter__(self):
        global _RECORDING
        self.launches = _RECORDING = []
        return self

    def __exit__(self, *exc):
        global _RECORDING
        _RECORDING = None

    def replay(self, stream=0) -> None:
        for kernel, grid, threads, args in self.launches:
            launch_kernel(kernel, grid, threads, stream, args)


def make_spec(mode: str, kv_layout: str, kind: str, head_dim: int, num_qo_heads: int,
              num_kv_heads: int, variant: Variant, tensor_cores: bool | None = None,
              out_kind: str | None = None) -> KernelSpec:
    use_tc = tensor_cores_usable(kind, head_dim, variant) if tensor_cores is None else bool(tensor_cores)
    if use_tc and not tensor_cores_usable(kind, head_dim, variant):
        raise ValueError("tensor_cores: needs a GPU, fp16/bf16 and head_dim a multiple of 16 up to 256")
    tq, tk, nt = kernel_tiles(head_dim, kind, use_tc)
    return KernelSpec(mode, kv_layout, kind, out_kind or kind, int(head_dim), num_qo_heads // num_kv_heads,
                      int(num_qo_heads), variant, use_tc, tq, tk, nt)


def _check_kind_match(**tensors):
    kinds = {k: A.dtype_code(v, k) for k, v in tensors.items()}
    if len(set(kinds.values())) > 1:
        listing = ", ".join(f"{k}={v}" for k, v in kinds.items())
        raise L.LayoutError(f"{list(kinds)[-1]}: dtype must match the other inputs, got {listing}")
    return next(iter(kinds.values()))


def request_rows(qo: L.RaggedQ, kv_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per query row: position (bottom-right aligned), key offset 0, request index."""
    lens = qo.lengths.astype(np.int64)
    req = np.repeat(np.arange(qo.batch_size), lens)
    local = np.arange(qo.total) - np.repeat(qo.qo_indptr[:-1].astype(np.int64), lens)
    pos = np.asarray(kv_lens, np.int64)[req] - lens[req] + local
    return pos.astype(np.int32), np.zeros(qo.total, np.int32), req.astype(np.int32)


# ---------------------------------------------------------------------------
# Public forms
# ---------------------------------------------------------------------------

def batch_prefill_paged(q, paged_kv_cache, qo_indptr, paged_kv_indptr, paged_kv_indices,
                        paged_kv_last_page_len, *, kv_layout: str = "NHD", return_lse: bool = False,
                        out=None, lse=None, tensor_cores: bool | None = None, stream=0, **variant):
    """Batch prefill/append over a paged KV cache (golden:
    :func:`nbattn.reference.batch_prefill_paged`).  ``tensor_cores`` forces a
    path (default: tensor cores on a GPU for fp16/bf16)."""
    var = variant_from_kwargs(variant)
    check_return_lse(var, return_lse)
    L.check_same_device(q=q, paged_kv_cache=paged_kv_cache)
    kind = _check_kind_match(q=q, paged_kv_cache=paged_kv_cache)
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
    spec = make_spec("paged", kv_layout, kind, dims.head_dim, shape[1], dims.num_kv_heads, var, tensor_cores)
    direct = torch_direct(q, paged_kv_cache, out, lse) and _default_stream(stream)
    stream = torch_stream(q.device.index) if direct else resolve_stream(stream, q, paged_kv_cache, out, lse)
    outs = _Outputs(q, shape, kind, out, lse, return_lse, stream, direct)
    work = build_work(qo.qo_indptr[:-1], qo.lengths, pkv.paged_kv_indptr[:-1],
                      np.zeros(qo.batch_size, np.int32), kv_lens, spec.group, spec.tile_q)
    cache = device_in(paged_kv_cache, "paged_kv_cache", kind, stream, direct)
    launch(spec, device_in(q, "q", kind, stream, direct), cache, cache, pkv.paged_kv_indices, work,
           *request_rows(qo, kv_lens), dims.page_size, 0, dims.num_kv_heads, outs.d_out, outs.d_lse, stream)
    return outs.finish()


def _contig_dims(k, v, kv_layout: str) -> tuple[int, int, int]:
    """(kv_rows, num_kv_heads, head_dim) of contiguous k / v."""
    L.check_kv_layout(kv_layout)
    ks, vs = tuple(int(s) for s in k.shape), tuple(int(s) for s in v.shape)
    if len(ks) != 3 or ks != vs:
        raise L.LayoutError(f"v: k and v must both be 3-D with equal shapes, got {ks} and {vs}")
    n, h, d = ks if kv_layout == "NHD" else (ks[1], ks[0], ks[2])
    return n, h, d


def batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, *, kv_layout: str = "NHD",
                         return_lse: bool = False, out=None, lse=None,
                         tensor_cores: bool | None = None, stream=0, **variant):
    """Ragged Q over ragged contiguous KV (golden: :func:`nbattn.reference.batch_prefill_ragged`)."""
    var = variant_from_kwargs(variant)
    check_return_lse(var, return_lse)
    L.check_same_device(q=q, k=k, v=v)
    kind = _check_kind_match(q=q, k=k, v=v)
    n_kv, hkv, d = _contig_dims(k, v, kv_layout)
    qo = L.RaggedQ.validate(qo_indptr, total_rows=q.shape[0] if len(q.shape) == 3 else None)
    kvp = L.RaggedQ.validate(kv_indptr, total_rows=n_kv, name="kv_indptr")
    if kvp.batch_size != qo.batch_size:
        raise L.LayoutError(f"kv_indptr: has {kvp.batch_size} requests, qo_indptr has {qo.batch_size}")
    shape = L.check_q(q, d, rows=qo.total)
    L.check_heads(shape[1], hkv)
    if var.causal:
        L.check_causal_lengths(qo.lengths, kvp.lengths)
    spec = make_spec("contig", kv_layout, kind, d, shape[1], hkv, var, tensor_cores)
    direct = torch_direct(q, k, v, out, lse) and _default_stream(stream)
    stream = torch_stream(q.device.index) if direct else resolve_stream(stream, q, k, v, out, lse)
    outs = _Outputs(q, shape, kind, out, lse, return_lse, stream, direct)
    work = build_work(qo.qo_indptr[:-1], qo.lengths, np.zeros(qo.batch_size, np.int32),
                      kvp.qo_indptr[:-1], kvp.lengths, spec.group, spec.tile_q)
    launch(spec, device_in(q, "q", kind, stream, direct), device_in(k, "k", kind, stream, direct),
           device_in(v, "v", kind, stream, direct), np.zeros(1, np.int32), work,
           *request_rows(qo, kvp.lengths), 1, n_kv, hkv, outs.d_out, outs.d_lse, stream)
    return outs.finish()


def single_prefill(q, k, v, *, kv_layout: str = "NHD", return_lse: bool = False, out=None, lse=None,
                   tensor_cores: bool | None = None, stream=0, **variant):
    """One request over contiguous KV (golden: :func:`nbattn.reference.single_prefill`)."""
    n_kv = _contig_dims(k, v, kv_layout)[0]
    if len(q.shape) != 3:
        L.check_q(q, int(k.shape[-1]))
    nq = int(q.shape[0])
    var = variant_from_kwargs(dict(variant))
    if var.causal:
        L.check_causal_lengths(np.array([nq]), np.array([n_kv]), name="q")
    return batch_prefill_ragged(q, k, v, np.array([0, nq], np.int32), np.array([0, n_kv], np.int32),
                                kv_layout=kv_layout, return_lse=return_lse, out=out, lse=lse,
                                tensor_cores=tensor_cores, stream=stream, **variant)

