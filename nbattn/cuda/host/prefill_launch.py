"""Host side of the prefill kernels: inputs, outputs, streams, work lists and the launch.

The public operations (:mod:`nbattn.cuda.prefill`, :mod:`~nbattn.cuda.sparse`,
:mod:`~nbattn.cuda.cascade`, the plan/run wrapper) share everything a prefill
launch needs around the kernel itself:

- checks of the inputs (:func:`check_kind_match`, :func:`contig_dims`), their
  device arrays (:func:`device_in`) and the stream (:func:`resolve_stream`; with
  torch tensors the kernels launch on torch's current stream unless a ``stream``
  is passed);
- the results in the caller's world (:class:`Outputs`);
- the work list (:func:`build_work`), each row's position, key offset and request
  (:func:`request_rows`), the launch order (:func:`longest_first`) and the
  ``slopes`` argument (:func:`tile_slopes`);
- the launch (:func:`launch_work`): host metadata packed into one staging slot and
  the kernel bound once per call shape; :func:`enqueue` and :class:`recording`
  keep launches to replay (benchmarks time the kernels apart from the host work).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from ... import layout as L
from ...variants import alibi_slopes
from . import arrays as A
from . import hostwork as HW
from .driver import BoundLaunch, handle_of, launch as launch_kernel
from .staging import Span, StagingRing

__all__ = ["default_stream", "resolve_stream", "device_in", "torch_direct", "Outputs", "check_kind_match",
           "contig_dims", "build_work", "request_rows", "longest_first", "NAN_ROW", "nan_row_at", "tile_slopes",
           "launch_work", "enqueue", "recording", "numba_stream", "BOUND", "BOUND_MOST"]


# ---------------------------------------------------------------------------
# Inputs, streams, outputs (nbattn.cuda.host.arrays)
# ---------------------------------------------------------------------------

def default_stream(stream) -> bool:
    """Whether the caller left ``stream`` at its default (torch's current stream is then used)."""
    return stream is None or (isinstance(stream, int) and stream == 0)


def resolve_stream(stream, *arrays: Any):
    """The stream to launch on: the caller's ``stream`` when one is passed, else
    (``stream=0``, the default) torch's current stream when any argument is a
    torch CUDA tensor -- as decode does -- else the default stream."""
    if default_stream(stream):
        return A.launch_stream(*arrays)
    return stream


def device_in(x: Any, name: str, code: str, stream, direct: bool = False):
    """A raw-typed device array over an input (copied from the host, zero-copy on
    the device; strided device arrays are fine: the kernels index with strides).
    With ``direct`` (see :func:`torch_direct`) a torch CUDA tensor is passed on as
    it is: :func:`launch_work` reads its pointer, shape and strides itself."""
    if direct:
        return x
    return A.to_device(x, name, stream, code, strided=True)


def torch_direct(*arrays: Any) -> bool:
    """Whether a call's arrays (None for an absent ``out=``/``lse=``) are all torch CUDA
    tensors: such a call launches on torch's current stream through a bound launch,
    making no numba array on the way (:func:`launch_work`)."""
    return all(x is None or (A.is_torch(x) and x.is_cuda) for x in arrays) and arrays[0] is not None


def check_kind_match(**tensors) -> str:
    """The element kind all ``tensors`` share (a LayoutError naming the last one otherwise)."""
    kinds = {k: A.dtype_code(v, k) for k, v in tensors.items()}
    if len(set(kinds.values())) > 1:
        listing = ", ".join(f"{k}={v}" for k, v in kinds.items())
        raise L.LayoutError(f"{list(kinds)[-1]}: dtype must match the other inputs, got {listing}")
    return next(iter(kinds.values()))


def contig_dims(k, v, kv_layout: str) -> tuple[int, int, int]:
    """(kv_rows, num_kv_heads, head_dim) of contiguous k / v."""
    L.check_kv_layout(kv_layout)
    ks, vs = tuple(int(s) for s in k.shape), tuple(int(s) for s in v.shape)
    if len(ks) != 3 or ks != vs:
        raise L.LayoutError(f"v: k and v must both be 3-D with equal shapes, got {ks} and {vs}")
    n, h, d = ks if kv_layout == "NHD" else (ks[1], ks[0], ks[2])
    return n, h, d


class Outputs:
    """Output and LSE of one call in the caller's world (:mod:`nbattn.cuda.host.arrays`):
    ``out=``/``lse=`` used in place on the device, copied into on the host.

    Two results differ from :func:`nbattn.cuda.host.arrays.finish`: a NumPy bf16
    ``q`` (raw ``|V2``) gives float32 values -- NumPy has no bf16, and the golden
    model answers in float32 too -- and a ``__cuda_array_interface__`` fp16 ``q``
    gives a float16 numba array.
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
        if direct:                                   # torch CUDA tensors, written in place by launch_work()
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
# Work lists
# ---------------------------------------------------------------------------

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


def request_rows(qo: L.RaggedQ, kv_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per query row: position (bottom-right aligned), key offset 0, request index
    (:func:`nbattn.cuda.host.hostwork.query_rows`)."""
    pos, req = HW.query_rows(qo.qo_indptr, np.asarray(kv_lens, np.int64))
    return pos, np.zeros(qo.total, np.int32), req


def longest_first(spec, work: np.ndarray, row_pos, row_kvoff) -> np.ndarray:
    """Causal work rows in launch order, most keys first (stable), when
    ``spec.tuning.longest_first`` is on.

    CTAs start in ``blockIdx.x`` order, and :func:`build_work` lists a causal
    request's query tiles shortest first, so the longest tiles would start
    last and run alone at the end of the grid; starting them first is the LPT
    rule of docs/concepts/scheduler.md.  Rows are independent, so the order changes no
    result.  Other masks keep the list's order."""
    if not (spec.tuning.longest_first and spec.variant.causal) or spec.mode == "bsr" or len(work) < 2:
        return work
    if not (isinstance(row_pos, np.ndarray) and isinstance(row_kvoff, np.ndarray)):
        return work
    qo_start, qo_len, row0 = (work[:, i].astype(np.int64) for i in range(3))
    last_q = qo_start + np.minimum(qo_len - 1, (row0 + spec.tile_q - 1) // spec.group)
    last_key = row_pos[last_q].astype(np.int64) - row_kvoff[last_q] + 1     # keys the tile's last row sees
    keys = np.clip(np.minimum(work[:, 6], last_key) - work[:, 5], 0, None)
    return work[np.argsort(-keys, kind="stable")]


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


# ---------------------------------------------------------------------------
# The launch
# ---------------------------------------------------------------------------

def launch_work(kernel, spec, q, k_src, v_src, kv_indices: np.ndarray, work: np.ndarray,
                row_pos: np.ndarray, row_kvoff: np.ndarray, row_req: np.ndarray,
                block: int, n_keys: int, num_kv_heads: int, out, lse, stream=0, mask=None) -> None:
    """Launch ``kernel`` (``spec``'s :func:`~nbattn.cuda.kernels.prefill_common.prefill_entry`)
    over a non-empty work list; ``mask`` the host arrays ``(mask_bits, mask_rows)`` of a
    runtime custom mask (:func:`~nbattn.cuda.kernels.prefill_common.masked_entry`), copied to
    the device with the call's other metadata."""
    work = longest_first(spec, work, row_pos, row_kvoff)
    slopes = tile_slopes(spec.num_qo_heads, spec.variant.has_alibi)
    idx = kv_indices if len(kv_indices) else np.zeros(1, np.int32)
    host_meta = (idx, work, row_pos, row_kvoff, row_req)
    grid = (len(work), num_kv_heads)
    dev, codes = (q, k_src, v_src, out, lse), (spec.kind,) * 3 + (spec.out_kind, "f32")
    if (mask is None and _RECORDING is None and out is not None and lse is not None
            and all(isinstance(x, np.ndarray) for x in host_meta)):
        _launch_staged(kernel, grid, spec.threads, stream, dev, [*host_meta, slopes], block, n_keys, codes)
        return
    stream = numba_stream(stream)
    q, k_src, v_src, out, lse = _raw_views(dev, codes, stream)
    meta = [A.device_meta(x, x, stream) for x in host_meta]
    args = (q, k_src, v_src, *meta, cuda.to_device(slopes, stream=stream), np.int32(block), np.int32(n_keys),
            out, lse)
    if mask is not None:
        args += tuple(cuda.to_device(np.ascontiguousarray(x), stream=stream) for x in mask)
    enqueue(kernel, grid, spec.threads, stream, args)


BOUND: dict = {}               # bound launches by call shape, oldest first
BOUND_MOST = 64                # call shapes kept
_RING = StagingRing()
_ARG_NAMES = ("q", "k", "v", "out", "lse")


def _raw_views(dev, codes, stream) -> tuple:
    """The kernel's raw-typed numba views of torch CUDA tensors among ``dev`` (others as they are)."""
    return tuple(A.to_device(x, n, stream, c, strided=True) if x is not None and A.is_torch(x) else x
                 for x, n, c in zip(dev, _ARG_NAMES, codes))


def numba_stream(stream):
    """A numba stream for numba's launch: a torch stream handle (see :func:`torch_direct`)
    wrapped, anything else as it is."""
    return cuda.external_stream(stream) if isinstance(stream, int) and stream else stream


def _shape_key(a) -> tuple:
    if A.is_torch(a):
        return (tuple(a.shape), a.stride(), a.dtype)
    return (tuple(a.shape), tuple(a.strides), a.dtype.str)


def _launch_staged(kernel, grid, threads, stream, dev, meta: list, block: int, n_keys: int,
                   codes: tuple) -> None:
    """:func:`launch_work` with host metadata: the five int32 arrays and the slopes are
    packed into one staging slot and sent with one asynchronous copy, and the
    kernel goes through a launch bound once per call shape (the shapes, strides
    and dtypes of q, k, v, out and lse; the last :data:`BOUND_MOST` shapes are
    kept), with only pointers, the metadata's sizes, scalars and the grid
    patched (:class:`nbattn.cuda.host.driver.BoundLaunch`)."""
    h = handle_of(stream)
    with _RING.lock:                                  # see StagingRing.lock
        slot, spans = _RING.stage(meta, h)
        key = (kernel, threads, tuple(_shape_key(a) for a in dev))
        bl = BOUND.get(key)
        if bl is None:
            q, k_src, v_src, out, lse = _raw_views(dev, codes, numba_stream(stream))
            bl = BOUND[key] = BoundLaunch(kernel, grid, threads,
                                          (q, k_src, v_src, *[sp.view() for sp in spans], np.int32(block),
                                           np.int32(n_keys), out, lse),
                                          convert={i: Span.view for i in range(3, 9)})
            while len(BOUND) > BOUND_MOST:
                BOUND.pop(next(iter(BOUND)))                 # the oldest call shape
        for i, a in zip((0, 1, 2, 11, 12), dev):
            bl.set(i, a)
        for i, sp, m in zip(range(3, 9), spans, meta):       # the metadata's sizes change per call
            bl.set(i, sp, m.size, m.shape[0])
        bl.set_scalar(9, int(block))
        bl.set_scalar(10, int(n_keys))
        bl.set_grid(grid)
        bl(h)
        slot.done(h)


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
