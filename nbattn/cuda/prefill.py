"""Batch prefill / append attention as numba.cuda kernels (SPEC sections 1-3).

What it computes: exactly :func:`nbattn.reference.batch_prefill_paged`,
``batch_prefill_ragged`` and ``single_prefill`` -- same arguments, same
variants, output in q's dtype plus the base-2 LSE in float32.

Work decomposition (SPEC section 2).  GQA heads are fused into rows: for one
KV head, fused row ``r`` of a request is query position ``r // group`` and
query head ``kv_head*group + r % group``.  A *work item* is one tile of
``T_q`` consecutive fused rows of one request (or of one cascade group, or one
BSR block row).  The grid is ``(n_work, num_kv_heads)``; one block per work
item and KV head, so every KV tile it gathers serves ``T_q`` rows -- all the
query heads of the group at once.

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

- CUDA cores (:func:`_core_kernel`): plain per-thread loops over shared
  memory; it is the path numba's simulator runs (CI) and the fallback.
- Tensor cores (:func:`_tc_kernel`, GPU only, fp16/bf16): 4 warps x 16 fused
  rows; ``S = Q K^T`` and ``O += P V`` on ``mma.sync.m16n8k16``
  (:mod:`nbattn.cuda.mma`), softmax on the accumulator fragments with quad
  shuffles, P fed to the second product straight from registers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import _compat
from .. import layout as L
from ..variants import variant_from_kwargs as parse_variant
from ..variants import Variant, alibi_slopes

from numba import cuda, float32, int32, int64, uint32  # noqa: E402  (after the shim)

from . import mma as _mma  # noqa: E402

__all__ = ["batch_prefill_paged", "batch_prefill_ragged", "single_prefill"]

LOG2E = 1.4426950408889634
NO_KEY = -(2 ** 30)        # kv position of a tile slot that holds no key
MODES = ("paged", "contig", "bsr")

# ---------------------------------------------------------------------------
# Host side: device arrays, dtypes, outputs
# ---------------------------------------------------------------------------


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def dtype_kind(x: Any) -> str:
    """'f16', 'bf16' or 'f32' of a float tensor (bf16 may arrive as raw 2-byte void)."""
    name = L.dtype_of(x)
    if name in ("float16", "half"):
        return "f16"
    if name in ("bfloat16", "|V2", "V2", "void16"):
        return "bf16"
    if name == "float32":
        return "f32"
    raise L.LayoutError(f"q: must be float16, bfloat16 or float32, got {name}")


def on_device(x: Any) -> bool:
    """Whether x already lives on the GPU (torch cuda tensor, numba device array, CAI object)."""
    if _is_torch(x):
        return x.device.type == "cuda"
    return hasattr(x, "copy_to_host") or hasattr(x, "__cuda_array_interface__")


def to_device(x: Any):
    """A numba device array for a NumPy array, torch tensor, numba device
    array or ``__cuda_array_interface__`` object (bf16 as its uint16 bits)."""
    if _is_torch(x):
        import torch
        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
        if x.device.type != "cuda":
            return cuda.to_device(x.detach().numpy().view(np.uint16) if x.dtype == torch.int16 else x.detach().numpy())
        return cuda.as_cuda_array(x.detach())
    if hasattr(x, "copy_to_host"):
        arr = x
    elif hasattr(x, "__cuda_array_interface__"):
        arr = cuda.as_cuda_array(x)
    else:
        arr = cuda.to_device(np.ascontiguousarray(np.asarray(x)))
    if arr.dtype.kind == "V" and arr.dtype.itemsize == 2:
        arr = arr.view(np.uint16)
    return arr


def _meta(x: np.ndarray):
    return cuda.to_device(np.ascontiguousarray(x, dtype=np.int32))


class _Outputs:
    """Output and LSE buffers in the caller's world (NumPy, torch or numba)."""

    def __init__(self, like: Any, shape: tuple, kind: str, out: Any, lse: Any, want_lse: bool):
        self.like, self.shape, self.kind = like, shape, kind
        self.host = not on_device(like)
        self.out_user, self.lse_user = out, lse
        if out is not None:
            if tuple(out.shape) != shape or dtype_kind(out) != kind:
                raise L.LayoutError(f"out: must have shape {shape} and q's dtype, got "
                                    f"{tuple(out.shape)} {L.dtype_of(out)}")
        if lse is not None and (tuple(lse.shape) != shape[:2] or L.dtype_of(lse) != "float32"):
            raise L.LayoutError(f"lse: must be float32 with shape {shape[:2]}, got "
                                f"{tuple(lse.shape)} {L.dtype_of(lse)}")
        np_dtype = {"f16": np.float16, "bf16": np.uint16, "f32": np.float32}[kind]
        self.d_out = to_device(out) if (out is not None and not self.host) else cuda.device_array(shape, np_dtype)
        self.d_lse = to_device(lse) if (lse is not None and not self.host) else cuda.device_array(shape[:2], np.float32)
        self.want_lse = want_lse

    def finish(self):
        o, s = self._wrap(self.d_out, self.out_user, True), self._wrap(self.d_lse, self.lse_user, False)
        return (o, s) if self.want_lse else o

    def _wrap(self, d, user, is_out):
        if user is not None and not self.host:
            return user
        if self.host:
            h = d.copy_to_host()
            if is_out and self.kind == "bf16":
                h = (h.astype(np.uint32) << 16).view(np.float32)
                if _is_torch(self.like):
                    import torch
                    h = torch.from_numpy(h).to(torch.bfloat16)
            elif _is_torch(self.like):
                import torch
                h = torch.from_numpy(h)
            if user is not None:
                user[...] = h
                return user
            return h
        if _is_torch(self.like):
            import torch
            t = torch.as_tensor(d, device=self.like.device)
            return t.view(torch.bfloat16) if (is_out and self.kind == "bf16") else t
        return d


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


def _element_reader(kind: str) -> Callable:
    """Device function: one stored element as float32."""
    if kind == "bf16":
        to_f32 = _mma.u32_as_f32

        @cuda.jit(device=True, inline=True)
        def read(x):
            return to_f32(uint32(x & 0xFFFF) << uint32(16))
    else:
        @cuda.jit(device=True, inline=True)
        def read(x):
            return float32(x)
    return read


def _element_writer(kind: str) -> Callable:
    """Device function: float32 to the stored element type (bf16 rounds to nearest even)."""
    if kind == "bf16":
        to_u32 = _mma.f32_as_u32

        @cuda.jit(device=True, inline=True)
        def write(x):
            bits = to_u32(x)
            if x != x:
                return uint32(0x7FC0)
            return (bits + uint32(0x7FFF) + ((bits >> uint32(16)) & uint32(1))) >> uint32(16)
    elif kind == "f16":
        @cuda.jit(device=True, inline=True)
        def write(x):
            return x
    else:
        @cuda.jit(device=True, inline=True)
        def write(x):
            return x
    return write


def _kv_reader(mode: str, kv_layout: str, read: Callable) -> Callable:
    """Device function ``(src, which, page, slot, head, d) -> float32`` for one
    K (which=0) or V (which=1) element; ``src`` is the paged cache, or k / v."""
    if mode == "paged":
        if kv_layout == "NHD":
            @cuda.jit(device=True, inline=True)
            def kv(src, which, page, slot, h, d):
                return read(src[page, which, slot, h, d])
        else:
            @cuda.jit(device=True, inline=True)
            def kv(src, which, page, slot, h, d):
                return read(src[page, which, h, slot, d])
    elif kv_layout == "NHD":
        @cuda.jit(device=True, inline=True)
        def kv(src, which, page, slot, h, d):
            return read(src[slot, h, d])
    else:
        @cuda.jit(device=True, inline=True)
        def kv(src, which, page, slot, h, d):
            return read(src[h, slot, d])
    return kv


def _key_locator(mode: str) -> Callable:
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


def _variant_functions(var: Variant) -> tuple[Callable, Callable, Callable]:
    """Device functions of a Variant, with FlexAttention's argument order.

    ``logits(s, b, h, q_idx, kv_idx, slope)``: ALiBi, soft-cap, score_mod on an
    already-scaled score; ``keep(b, h, q_idx, kv_idx)``: causal, window with
    sinks, mask_mod; ``prob(s)``: sigmoid attention's weight.
    """
    alibi = var.has_alibi
    cap = float32(var.logits_soft_cap or 0.0)
    has_cap = var.has_soft_cap
    causal, window, sinks = var.causal, int(var.window_left), int(var.sink_size)
    bias = float32(var.sigmoid_bias)

    if var.score_mod is not None:
        user_score = cuda.jit(device=True)(var.score_mod)
    else:
        @cuda.jit(device=True, inline=True)
        def user_score(s, b, h, q_idx, kv_idx):
            return s

    if var.mask_mod is not None:
        user_mask = cuda.jit(device=True)(var.mask_mod)
    else:
        @cuda.jit(device=True, inline=True)
        def user_mask(b, h, q_idx, kv_idx):
            return True

    @cuda.jit(device=True, inline=True)
    def logits(s, b, h, q_idx, kv_idx, slope):
        if alibi:
            s = s - slope * float32(q_idx - kv_idx)
        if has_cap:
            s = cap * math.tanh(s / cap)
        return float32(user_score(s, b, h, q_idx, kv_idx))

    @cuda.jit(device=True, inline=True)
    def keep(b, h, q_idx, kv_idx):
        if causal and kv_idx > q_idx:
            return False
        if window >= 0 and q_idx - kv_idx > window and not kv_idx < sinks:
            return False
        return bool(user_mask(b, h, q_idx, kv_idx))

    @cuda.jit(device=True, inline=True)
    def prob(s):
        return float32(1.0) / (float32(1.0) + math.exp(-(s + bias)))

    return logits, keep, prob


# ---------------------------------------------------------------------------
# The CUDA-core kernel
# ---------------------------------------------------------------------------

def _core_kernel(spec: KernelSpec):
    """Scalar path: threads stride over the (row, key) and (row, dim) grids of
    a tile in shared memory.  Launch: grid (n_work, num_kv_heads), ``threads``."""
    D, T_q, T_k, NT, group = spec.head_dim, spec.tile_q, spec.tile_k, spec.threads, spec.group
    var = spec.variant
    sigmoid = var.use_sigmoid
    causal, window, sinks = var.causal, int(var.window_left), int(var.sink_size)
    positional = spec.mode != "bsr"       # key positions grow with t: tile ranges can be cut
    scale = float32(var.scale(D))
    read = _element_reader(spec.kind)
    write = _element_writer(spec.out_kind)
    kv = _kv_reader(spec.mode, spec.kv_layout, read)
    locate = _key_locator(spec.mode)
    logits, keep, prob = _variant_functions(var)
    neg_inf = float32(-math.inf)
    inv_ln2 = float32(LOG2E)
    store_dtype = float32

    @cuda.jit
    def kernel(q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
               block, n_keys, out, lse):
        w = cuda.blockIdx.x
        kv_head = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        qo_start, qo_len, row0 = work[w, 0], work[w, 1], work[w, 2]
        kv_ptr, kv_base, kv_begin, kv_end = work[w, 3], work[w, 4], work[w, 5], work[w, 6]
        out_shift = work[w, 7] - qo_start       # partial states land in their own rows
        n_rows = min(T_q, qo_len * group - row0)

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
                s_q[r, d] = read(q[qi, h, d])
            else:
                s_q[r, d] = 0.0
        for r in range(tid, T_q, NT):
            s_m[r] = neg_inf
            s_l[r] = 0.0
            if r < n_rows:
                qi = qo_start + (row0 + r) // group
                s_qpos[r] = row_pos[qi]
                s_diag[r] = row_pos[qi] - row_kvoff[qi]
                s_req[r] = row_req[qi]
        cuda.syncthreads()

        # Key range this tile can see: causal ends at the last row's diagonal,
        # a window starts at the first row's.
        if tid == 0:
            lo = kv_begin
            hi = kv_end
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
            sink_end = 0
            if positional and window >= 0 and sinks > 0:
                for r in range(n_rows):
                    sink_end = max(sink_end, sinks - (s_qpos[r] - s_diag[r]))
            s_range[0] = lo
            s_range[1] = hi
            s_range[2] = sink_end
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
                        s_k[j, d] = kv(k_src, 0, page, slot, kv_head, d)
                        s_v[j, d] = kv(v_src, 1, page, slot, kv_head, d)
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
                        s = logits(acc * scale, b, h, q_idx, kv_idx, slopes[h])
                s_p[r, j] = s
            cuda.syncthreads()

            # Online softmax, one thread per row: new max, rescale factor, weights.
            for r in range(tid, T_q, NT):
                if sigmoid:
                    for j in range(T_k):
                        s = s_p[r, j]
                        s_p[r, j] = prob(s) if s != neg_inf else float32(0.0)
                    s_alpha[r] = 1.0
                else:
                    m_old = s_m[r]
                    m_new = m_old
                    for j in range(T_k):
                        m_new = max(m_new, s_p[r, j])
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
                o = o / l_r if l_r > 0 else float32(0.0)
            out[qi + out_shift, h, d] = write(o)
        for r in range(tid, n_rows, NT):
            qi = qo_start + (row0 + r) // group
            h = kv_head * group + (row0 + r) % group
            if sigmoid:
                lse[qi + out_shift, h] = math.nan
            elif s_l[r] > 0:
                lse[qi + out_shift, h] = (s_m[r] + math.log(s_l[r])) * inv_ln2
            else:
                lse[qi + out_shift, h] = neg_inf

    return kernel


_KERNELS: dict = {}


def get_kernel(spec: KernelSpec):
    """Compiled-kernel cache keyed by the spec (a Variant with user functions hashes by identity)."""
    kern = _KERNELS.get(spec)
    if kern is None:
        kern = _tc_kernel(spec) if spec.tensor_cores else _core_kernel(spec)
        _KERNELS[spec] = kern
    return kern


def _tc_kernel(spec: KernelSpec):
    return tensor_core_kernel(spec)


# ---------------------------------------------------------------------------
# Tile choice and launch
# ---------------------------------------------------------------------------

def choose_tiles(head_dim: int, kind: str, tensor_cores: bool) -> tuple[int, int, int]:
    """(T_q, T_k, threads).  The simulator gets small tiles (each thread is a
    Python thread); the CUDA-core GPU path fits its shared memory in 48 KB."""
    if tensor_cores:
        return tensor_core_tiles(head_dim)
    if _compat.simulator_enabled():
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
    rows = []
    for i in range(len(qo_lens)):
        fused = int(qo_lens[i]) * group
        n_chunks = 1 if not kv_chunk else max(1, -(-int(kv_lens[i]) // kv_chunk))
        for c in range(n_chunks):
            begin = 0 if not kv_chunk else c * kv_chunk
            end = int(kv_lens[i]) if not kv_chunk else min(int(kv_lens[i]), begin + kv_chunk)
            for row0 in range(0, fused, tile_q):
                rows.append((qo_starts[i], qo_lens[i], row0, kv_ptrs[i], kv_bases[i], begin, end,
                             out_starts[i] + c * chunk_stride))
    return np.asarray(rows, dtype=np.int32).reshape(-1, 8)


def launch(spec: KernelSpec, q, k_src, v_src, kv_indices: np.ndarray, work: np.ndarray,
           row_pos: np.ndarray, row_kvoff: np.ndarray, row_req: np.ndarray,
           block: int, n_keys: int, num_kv_heads: int, out, lse, stream=0):
    """Launch one prefill kernel over a work list (the shared entry of prefill,
    block-sparse and cascade)."""
    if len(work) == 0:
        return
    kernel = get_kernel(spec)
    slopes = alibi_slopes(spec.num_qo_heads) if spec.variant.has_alibi else np.zeros(spec.num_qo_heads, np.float32)
    idx = kv_indices if len(kv_indices) else np.zeros(1, np.int32)
    args = (q, k_src, v_src, _meta(idx), _meta(work), _meta(row_pos), _meta(row_kvoff), _meta(row_req),
            cuda.to_device(slopes), np.int32(block), np.int32(n_keys), out, lse)
    enqueue(kernel, (len(work), num_kv_heads), spec.threads, stream, args)


_RECORDING: list | None = None


def enqueue(kernel, grid, threads, stream, args) -> None:
    """Launch now -- or, inside :func:`recording`, keep the launch to replay:
    benchmarks time the kernels apart from the host-side planning."""
    if _RECORDING is not None:
        _RECORDING.append((kernel, grid, threads, args))
    else:
        kernel[grid, threads, stream](*args)


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
            kernel[grid, threads, stream](*args)


def make_spec(mode: str, kv_layout: str, kind: str, head_dim: int, num_qo_heads: int,
              num_kv_heads: int, variant: Variant, tensor_cores: bool | None = None,
              out_kind: str | None = None) -> KernelSpec:
    use_tc = tensor_cores_usable(kind, head_dim, variant) if tensor_cores is None else bool(tensor_cores)
    if use_tc and not tensor_cores_usable(kind, head_dim, variant):
        raise ValueError("tensor_cores: needs a GPU, fp16/bf16 and head_dim a multiple of 16 up to 256")
    tq, tk, nt = choose_tiles(head_dim, kind, use_tc)
    return KernelSpec(mode, kv_layout, kind, out_kind or kind, int(head_dim), num_qo_heads // num_kv_heads,
                      int(num_qo_heads), variant, use_tc, tq, tk, nt)


def _check_kind_match(**tensors):
    kinds = {k: dtype_kind(v) for k, v in tensors.items()}
    if len(set(kinds.values())) > 1:
        listing = ", ".join(f"{k}={v}" for k, v in kinds.items())
        raise L.LayoutError(f"{list(kinds)[-1]}: dtype must match the other inputs, got {listing}")
    return next(iter(kinds.values()))


def _check_lse(var: Variant, return_lse: bool):
    if return_lse and var.use_sigmoid:
        raise ValueError("return_lse: sigmoid attention has no log-sum-exp (its partial outputs add)")


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
    var = parse_variant(variant)
    _check_lse(var, return_lse)
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
    outs = _Outputs(q, shape, kind, out, lse, return_lse)
    work = build_work(qo.qo_indptr[:-1], qo.lengths, pkv.paged_kv_indptr[:-1],
                      np.zeros(qo.batch_size, np.int32), kv_lens, spec.group, spec.tile_q)
    cache = to_device(paged_kv_cache)
    launch(spec, to_device(q), cache, cache, pkv.paged_kv_indices, work, *request_rows(qo, kv_lens),
           dims.page_size, 0, dims.num_kv_heads, outs.d_out, outs.d_lse, stream)
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
    var = parse_variant(variant)
    _check_lse(var, return_lse)
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
    outs = _Outputs(q, shape, kind, out, lse, return_lse)
    work = build_work(qo.qo_indptr[:-1], qo.lengths, np.zeros(qo.batch_size, np.int32),
                      kvp.qo_indptr[:-1], kvp.lengths, spec.group, spec.tile_q)
    launch(spec, to_device(q), to_device(k), to_device(v), np.zeros(1, np.int32), work,
           *request_rows(qo, kvp.lengths), 1, n_kv, hkv, outs.d_out, outs.d_lse, stream)
    return outs.finish()


def single_prefill(q, k, v, *, kv_layout: str = "NHD", return_lse: bool = False, out=None, lse=None,
                   tensor_cores: bool | None = None, stream=0, **variant):
    """One request over contiguous KV (golden: :func:`nbattn.reference.single_prefill`)."""
    n_kv = _contig_dims(k, v, kv_layout)[0]
    if len(q.shape) != 3:
        L.check_q(q, int(k.shape[-1]))
    nq = int(q.shape[0])
    var = parse_variant(dict(variant))
    if var.causal:
        L.check_causal_lengths(np.array([nq]), np.array([n_kv]), name="q")
    return batch_prefill_ragged(q, k, v, np.array([0, nq], np.int32), np.array([0, n_kv], np.int32),
                                kv_layout=kv_layout, return_lse=return_lse, out=out, lse=lse,
                                tensor_cores=tensor_cores, stream=stream, **variant)


# ---------------------------------------------------------------------------
# The tensor-core kernel (GPU only)
# ---------------------------------------------------------------------------

def tensor_core_tiles(head_dim: int) -> tuple[int, int, int]:
    """(T_q, T_k, threads): 16 fused rows per warp; the static shared memory
    (Q, K and V^T tiles as packed uint32 pairs, rows padded by 4 words so the
    fragment reads hit 32 distinct banks) stays under 48 KB."""
    if head_dim <= 64:
        return 64, 64, 128
    if head_dim <= 128:
        return 64, 32, 128
    return 32, 16, 64


def _kv_vector_reader(mode: str, kv_layout: str) -> Callable:
    """Device function ``(src, which, page, slot, h, d) -> 4 x uint32``: eight
    2-byte elements of one K or V row from element d on (one 16-byte load)."""
    load = _mma.load_u32x4
    if mode == "paged":
        if kv_layout == "NHD":
            @cuda.jit(device=True, inline=True)
            def vec(src, which, page, slot, h, d):
                return load(src, (page, which, slot, h, d))
        else:
            @cuda.jit(device=True, inline=True)
            def vec(src, which, page, slot, h, d):
                return load(src, (page, which, h, slot, d))
    elif kv_layout == "NHD":
        @cuda.jit(device=True, inline=True)
        def vec(src, which, page, slot, h, d):
            return load(src, (slot, h, d))
    else:
        @cuda.jit(device=True, inline=True)
        def vec(src, which, page, slot, h, d):
            return load(src, (h, slot, d))
    return vec


def _fragment_functions(head_dim: int, mma, q_in_registers: bool) -> dict:
    """Straight-line device functions over register tuples, generated per head_dim.

    The O accumulator (head_dim/8 n-tiles x 4 floats per lane) and the Q
    fragments must stay in registers; a ``cuda.local.array`` indexed in loops
    only does if the compiler unrolls every loop, which it did not (measured:
    60 TFLOP/s).  So the loops over n-tiles and k-steps are written out here,
    once, as source text, and the state travels as tuples (SSA values).

    - ``o_zero()``: the zero O tuple;
    - ``q_frags(s_q, r_lo, r_hi, tq)``: all A fragments of the warp's 16 rows;
    - ``qk(qf, s_q, r_lo, r_hi, s_k, k, g, tq)``: S for 16 rows x keys k..k+15
      as (x0..x3, y0..y3) -- two n-tiles;
    - ``pv(o, p0, p1, p2, p3, s_vt, kc, g, alpha_lo, alpha_hi)``: O = alpha O + P V;
    - ``o_get(o, i)`` is plain tuple indexing with a constant.
    """
    ndt, ks = head_dim // 8, head_dim // 16
    n_o = 4 * ndt
    lines = []
    names = ", ".join(f"o{i}" for i in range(n_o))
    lines.append("def o_zero():")
    lines.append("    z = float32(0.0)")
    lines.append("    return (" + ", ".join("z" for _ in range(n_o)) + ",)")
    lines.append("def q_frags(s_q, r_lo, r_hi, tq):")
    frag = [] if q_in_registers else ["uint32(0)"]
    for k in range(ks if q_in_registers else 0):
        c = k * 8
        frag += [f"s_q[r_lo, {c} + tq]", f"s_q[r_hi, {c} + tq]", f"s_q[r_lo, {c + 4} + tq]", f"s_q[r_hi, {c + 4} + tq]"]
    lines.append("    return (" + ", ".join(frag) + ",)")
    lines.append("def qk(qf, s_q, r_lo, r_hi, s_k, k, g, tq):")
    lines.append("    z = float32(0.0)")
    lines.append("    x0 = x1 = x2 = x3 = z")
    lines.append("    y0 = y1 = y2 = y3 = z")
    lines.append("    ka = k + g")
    lines.append("    kb = k + 8 + g")
    for k in range(ks):
        c = k * 8
        if q_in_registers:
            a = f"qf[{4 * k}], qf[{4 * k + 1}], qf[{4 * k + 2}], qf[{4 * k + 3}]"
        else:
            lines.append(f"    a0 = s_q[r_lo, {c} + tq]; a1 = s_q[r_hi, {c} + tq]; "
                         f"a2 = s_q[r_lo, {c + 4} + tq]; a3 = s_q[r_hi, {c + 4} + tq]")
            a = "a0, a1, a2, a3"
        lines.append(f"    x0, x1, x2, x3 = mma({a}, s_k[ka, {c} + tq], s_k[ka, {c + 4} + tq], x0, x1, x2, x3)")
        lines.append(f"    y0, y1, y2, y3 = mma({a}, s_k[kb, {c} + tq], s_k[kb, {c + 4} + tq], y0, y1, y2, y3)")
    lines.append("    return x0, x1, x2, x3, y0, y1, y2, y3")
    lines.append("def pv(o, p0, p1, p2, p3, s_vt, kc, g, alpha_lo, alpha_hi):")
    lines.append(f"    {names}, = o" if n_o else "    pass")
    for nt in range(ndt):
        i = 4 * nt
        lines.append(f"    o{i}, o{i + 1}, o{i + 2}, o{i + 3} = mma(p0, p1, p2, p3, s_vt[{nt * 8} + g, kc], "
                     f"s_vt[{nt * 8} + g, kc + 4], o{i} * alpha_lo, o{i + 1} * alpha_lo, "
                     f"o{i + 2} * alpha_hi, o{i + 3} * alpha_hi)")
    lines.append(f"    return ({names},)")
    env = {"float32": float32, "uint32": uint32, "mma": mma}
    exec(compile("\n".join(lines), f"<nbattn fragments D={head_dim}>", "exec"), env)
    return {name: cuda.jit(device=True, inline=True)(env[name]) for name in ("o_zero", "q_frags", "qk", "pv")}


def tensor_core_kernel(spec: KernelSpec):
    """mma.sync path.  Launch: grid (n_work, num_kv_heads), T_q/16 warps.

    Warp w owns fused rows ``16w .. 16w+15`` of the tile.  Per KV tile (T_k
    keys in shared memory) it walks 16 keys at a time: S (16x16) = two
    m16n8k16 n-tiles over head_dim, the variant and mask per element, the
    online-softmax update on the fragments (row max and sum across the 4
    lanes of a quad by shuffles), then P (packed to f16/bf16 in registers,
    the C layout being the A layout) times V^T from shared memory into the
    O fragments ``o[nt*4 + c]`` (n-tile nt of head_dim, component c).
    """
    D, group = spec.head_dim, spec.group
    T_q, T_k, NT = spec.tile_q, spec.tile_k, spec.threads
    var = spec.variant
    sigmoid = var.use_sigmoid
    causal, window, sinks = var.causal, int(var.window_left), int(var.sink_size)
    positional = spec.mode != "bsr"
    # Only causal (or nothing) to apply: interior 16-key steps need no per-element work.
    plain = not (window >= 0 or sinks or var.has_alibi or var.has_soft_cap or var.score_mod is not None
                 or var.mask_mod is not None or sigmoid)
    scale = float32(var.scale(D))
    scale_log2 = float32(var.scale(D) * LOG2E)
    log2e = float32(LOG2E)
    write = _element_writer(spec.out_kind)
    vec = _kv_vector_reader(spec.mode, spec.kv_layout)
    locate = _key_locator(spec.mode)
    logits, keep, prob = _variant_functions(var)
    mma = _mma.mma_bf16 if spec.kind == "bf16" else _mma.mma_f16
    pack = _mma.pack_bf16x2 if spec.kind == "bf16" else _mma.pack_f16x2
    load_q = _mma.load_u32x4
    q_in_registers = D <= 128          # D=256 would need 64 more registers: read A from shared memory
    frags = _fragment_functions(D, mma, q_in_registers)
    o_zero, q_frags, qk, pv = frags["o_zero"], frags["q_frags"], frags["qk"], frags["pv"]
    neg_inf = float32(-math.inf)
    W = D // 2 + 4              # padded row of packed pairs (Q, K)
    WV = T_k // 2 + 4           # padded row of V^T (pairs along keys)
    NDT = D // 8                # n-tiles of the output
    N_O = NDT * 4               # O fragment floats per lane
    KS = D // 16                # k-steps of Q K^T
    lo16 = uint32(0xFFFF)
    hi16 = uint32(0xFFFF0000)
    sh16 = uint32(16)

    @cuda.jit(device=True, inline=True)
    def score(x, r, s_qpos, s_diag, s_req, s_kpos, row_ok, b_head0, t_local, slopes):
        """Scaled score of fused row r and tile key t_local -> log2-domain logit or -inf."""
        pos = s_kpos[t_local]
        if not row_ok or pos == NO_KEY:
            return neg_inf
        q_idx = s_qpos[r]
        kv_idx = pos + (q_idx - s_diag[r] if positional else 0)
        h = b_head0 + r % group
        b = s_req[r]
        if not keep(b, h, q_idx, kv_idx):
            return neg_inf
        s = logits(x * scale, b, h, q_idx, kv_idx, slopes[h])
        if sigmoid:
            return s
        return s * log2e

    @cuda.jit
    def kernel(q, k_src, v_src, kv_indices, work, row_pos, row_kvoff, row_req, slopes,
               block, n_keys, out, lse):
        wi = cuda.blockIdx.x
        kv_head = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        tq = lane % 4
        qo_start, qo_len, row0 = work[wi, 0], work[wi, 1], work[wi, 2]
        kv_ptr, kv_base, kv_begin, kv_end = work[wi, 3], work[wi, 4], work[wi, 5], work[wi, 6]
        out_shift = work[wi, 7] - qo_start
        n_rows = min(T_q, qo_len * group - row0)
        head0 = kv_head * group

        s_q = cuda.shared.array((T_q, W), uint32)
        s_k = cuda.shared.array((T_k, W), uint32)
        s_vt = cuda.shared.array((D, WV), uint32)
        s_kpos = cuda.shared.array(T_k, int32)
        s_qpos = cuda.shared.array(T_q, int32)
        s_diag = cuda.shared.array(T_q, int32)
        s_req = cuda.shared.array(T_q, int32)
        s_range = cuda.shared.array(3, int32)

        # Q tile: 16-byte loads, packed pairs stay packed.
        for e in range(tid, T_q * (D // 8), NT):
            r = e // (D // 8)
            c = e % (D // 8)
            if r < n_rows:
                qi = qo_start + (row0 + r) // group
                w0, w1, w2, w3 = load_q(q, (qi, head0 + (row0 + r) % group, c * 8))
            else:
                w0 = w1 = w2 = w3 = uint32(0)
            s_q[r, c * 4] = w0
            s_q[r, c * 4 + 1] = w1
            s_q[r, c * 4 + 2] = w2
            s_q[r, c * 4 + 3] = w3
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
                    if sinks > 0:
                        for r in range(n_rows):
                            sink_end = max(sink_end, sinks - (s_qpos[r] - s_diag[r]))
            s_range[0] = lo
            s_range[1] = hi
            s_range[2] = sink_end
        cuda.syncthreads()
        lo = s_range[0]
        hi = s_range[1]
        sink_end = s_range[2]

        r_lo = warp * 16 + g
        r_hi = r_lo + 8
        ok_lo = r_lo < n_rows
        ok_hi = r_hi < n_rows
        # smallest diagonal of this warp's rows: keys up to it are visible to all of them
        warp_diag = min(s_diag[warp * 16], s_diag[min(warp * 16 + 15, T_q - 1)])
        for r in range(warp * 16, warp * 16 + 16):
            warp_diag = min(warp_diag, s_diag[r])

        o = o_zero()
        qf = q_frags(s_q, r_lo, r_hi, tq)     # (a dummy when A is read from shared memory)
        m_lo = neg_inf
        m_hi = neg_inf
        l_lo = float32(0.0)
        l_hi = float32(0.0)

        for t0 in range(kv_begin, hi, T_k):
            if t0 + T_k <= lo and t0 >= sink_end:
                continue
            # K rows as packed pairs; V transposed so that pairs run along keys.
            for e in range(tid, T_k * (D // 8), NT):
                j = e // (D // 8)
                c = e % (D // 8)
                t = t0 + j
                w0 = w1 = w2 = w3 = uint32(0)
                if t < hi:
                    page, slot, pos = locate(kv_indices, kv_ptr, kv_base, t, block, n_keys)
                    if pos != NO_KEY:
                        w0, w1, w2, w3 = vec(k_src, 0, page, slot, kv_head, c * 8)
                else:
                    pos = NO_KEY
                s_k[j, c * 4] = w0
                s_k[j, c * 4 + 1] = w1
                s_k[j, c * 4 + 2] = w2
                s_k[j, c * 4 + 3] = w3
                if c == 0:
                    s_kpos[j] = pos
            for e in range(tid, (T_k // 2) * (D // 8), NT):
                jj = e // (D // 8)
                c = e % (D // 8)
                a0 = a1 = a2 = a3 = uint32(0)
                b0 = b1 = b2 = b3 = uint32(0)
                t = t0 + 2 * jj
                if t < hi:
                    page, slot, pos = locate(kv_indices, kv_ptr, kv_base, t, block, n_keys)
                    if pos != NO_KEY:
                        a0, a1, a2, a3 = vec(v_src, 1, page, slot, kv_head, c * 8)
                if t + 1 < hi:
                    page, slot, pos = locate(kv_indices, kv_ptr, kv_base, t + 1, block, n_keys)
                    if pos != NO_KEY:
                        b0, b1, b2, b3 = vec(v_src, 1, page, slot, kv_head, c * 8)
                d0 = c * 8
                s_vt[d0, jj] = (a0 & lo16) | (b0 << sh16)
                s_vt[d0 + 1, jj] = (a0 >> sh16) | (b0 & hi16)
                s_vt[d0 + 2, jj] = (a1 & lo16) | (b1 << sh16)
                s_vt[d0 + 3, jj] = (a1 >> sh16) | (b1 & hi16)
                s_vt[d0 + 4, jj] = (a2 & lo16) | (b2 << sh16)
                s_vt[d0 + 5, jj] = (a2 >> sh16) | (b2 & hi16)
                s_vt[d0 + 6, jj] = (a3 & lo16) | (b3 << sh16)
                s_vt[d0 + 7, jj] = (a3 >> sh16) | (b3 & hi16)
            cuda.syncthreads()

            for k0 in range(0, T_k, 16):
                if t0 + k0 >= hi:
                    break
                # S = Q K^T for 16 rows x 16 keys (two n-tiles)
                x0, x1, x2, x3, y0, y1, y2, y3 = qk(qf, s_q, r_lo, r_hi, s_k, k0, g, tq)
                # variant and mask; the fast case is a 16-key step every row sees whole
                kt = k0 + 2 * tq
                last = t0 + k0 + 15
                if plain and positional and last < hi and ok_hi and (not causal or last <= warp_diag):
                    x0 *= scale_log2
                    x1 *= scale_log2
                    x2 *= scale_log2
                    x3 *= scale_log2
                    y0 *= scale_log2
                    y1 *= scale_log2
                    y2 *= scale_log2
                    y3 *= scale_log2
                else:
                    x0 = score(x0, r_lo, s_qpos, s_diag, s_req, s_kpos, ok_lo, head0, kt, slopes)
                    x1 = score(x1, r_lo, s_qpos, s_diag, s_req, s_kpos, ok_lo, head0, kt + 1, slopes)
                    x2 = score(x2, r_hi, s_qpos, s_diag, s_req, s_kpos, ok_hi, head0, kt, slopes)
                    x3 = score(x3, r_hi, s_qpos, s_diag, s_req, s_kpos, ok_hi, head0, kt + 1, slopes)
                    y0 = score(y0, r_lo, s_qpos, s_diag, s_req, s_kpos, ok_lo, head0, kt + 8, slopes)
                    y1 = score(y1, r_lo, s_qpos, s_diag, s_req, s_kpos, ok_lo, head0, kt + 9, slopes)
                    y2 = score(y2, r_hi, s_qpos, s_diag, s_req, s_kpos, ok_hi, head0, kt + 8, slopes)
                    y3 = score(y3, r_hi, s_qpos, s_diag, s_req, s_kpos, ok_hi, head0, kt + 9, slopes)
                if sigmoid:
                    alpha_lo = float32(1.0)
                    alpha_hi = float32(1.0)
                    x0 = prob(x0) if x0 != neg_inf else float32(0.0)
                    x1 = prob(x1) if x1 != neg_inf else float32(0.0)
                    x2 = prob(x2) if x2 != neg_inf else float32(0.0)
                    x3 = prob(x3) if x3 != neg_inf else float32(0.0)
                    y0 = prob(y0) if y0 != neg_inf else float32(0.0)
                    y1 = prob(y1) if y1 != neg_inf else float32(0.0)
                    y2 = prob(y2) if y2 != neg_inf else float32(0.0)
                    y3 = prob(y3) if y3 != neg_inf else float32(0.0)
                else:
                    # online softmax (base 2) per row; a quad of lanes holds one row
                    mx_lo = max(max(x0, x1), max(y0, y1))
                    mx_hi = max(max(x2, x3), max(y2, y3))
                    mx_lo = max(mx_lo, cuda.shfl_xor_sync(0xFFFFFFFF, mx_lo, 1))
                    mx_lo = max(mx_lo, cuda.shfl_xor_sync(0xFFFFFFFF, mx_lo, 2))
                    mx_hi = max(mx_hi, cuda.shfl_xor_sync(0xFFFFFFFF, mx_hi, 1))
                    mx_hi = max(mx_hi, cuda.shfl_xor_sync(0xFFFFFFFF, mx_hi, 2))
                    new_lo = max(m_lo, mx_lo)
                    new_hi = max(m_hi, mx_hi)
                    base_lo = new_lo if new_lo != neg_inf else float32(0.0)
                    base_hi = new_hi if new_hi != neg_inf else float32(0.0)
                    alpha_lo = math.exp2(m_lo - base_lo)
                    alpha_hi = math.exp2(m_hi - base_hi)
                    x0 = math.exp2(x0 - base_lo)
                    x1 = math.exp2(x1 - base_lo)
                    y0 = math.exp2(y0 - base_lo)
                    y1 = math.exp2(y1 - base_lo)
                    x2 = math.exp2(x2 - base_hi)
                    x3 = math.exp2(x3 - base_hi)
                    y2 = math.exp2(y2 - base_hi)
                    y3 = math.exp2(y3 - base_hi)
                    l_lo = l_lo * alpha_lo + (x0 + x1 + y0 + y1)
                    l_hi = l_hi * alpha_hi + (x2 + x3 + y2 + y3)
                    m_lo = new_lo
                    m_hi = new_hi
                # O = alpha O + P V^T: P's C fragments are the A fragment
                p0 = pack(x0, x1)
                p1 = pack(x2, x3)
                p2 = pack(y0, y1)
                p3 = pack(y2, y3)
                o = pv(o, p0, p1, p2, p3, s_vt, k0 // 2 + tq, g, alpha_lo, alpha_hi)
            cuda.syncthreads()

        # Row sums live spread over the quad: add them up, normalize, write.
        if not sigmoid:
            l_lo += cuda.shfl_xor_sync(0xFFFFFFFF, l_lo, 1)
            l_lo += cuda.shfl_xor_sync(0xFFFFFFFF, l_lo, 2)
            l_hi += cuda.shfl_xor_sync(0xFFFFFFFF, l_hi, 1)
            l_hi += cuda.shfl_xor_sync(0xFFFFFFFF, l_hi, 2)
            inv_lo = float32(1.0) / l_lo if l_lo > 0 else float32(0.0)
            inv_hi = float32(1.0) / l_hi if l_hi > 0 else float32(0.0)
        else:
            inv_lo = float32(1.0)
            inv_hi = float32(1.0)
        if ok_lo:
            qi = qo_start + (row0 + r_lo) // group
            h = head0 + (row0 + r_lo) % group
            for nt in range(NDT):
                out[qi + out_shift, h, nt * 8 + 2 * tq] = write(o[nt * 4] * inv_lo)
                out[qi + out_shift, h, nt * 8 + 2 * tq + 1] = write(o[nt * 4 + 1] * inv_lo)
            if tq == 0:
                if sigmoid:
                    lse[qi + out_shift, h] = math.nan
                else:
                    lse[qi + out_shift, h] = m_lo + math.log2(l_lo) if l_lo > 0 else neg_inf
        if ok_hi:
            qi = qo_start + (row0 + r_hi) // group
            h = head0 + (row0 + r_hi) % group
            for nt in range(NDT):
                out[qi + out_shift, h, nt * 8 + 2 * tq] = write(o[nt * 4 + 2] * inv_hi)
                out[qi + out_shift, h, nt * 8 + 2 * tq + 1] = write(o[nt * 4 + 3] * inv_hi)
            if tq == 0:
                if sigmoid:
                    lse[qi + out_shift, h] = math.nan
                else:
                    lse[qi + out_shift, h] = m_hi + math.log2(l_hi) if l_hi > 0 else neg_inf

    return kernel

