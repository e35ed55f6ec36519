"""Plan/run wrappers over a preallocated workspace (docs/concepts/scheduler.md), shaped like
FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` and
``BatchPrefillWithPagedKVCacheWrapper``.

Why two steps
-------------
Every layer of a model sees the same lengths in one generation step, so the
load-balancing decision is made once: :meth:`plan` runs the LPT planner
(:func:`nbattn.sched.plan`) on the CPU and copies its result into the device
workspace; :meth:`run` is then called once per layer with that layer's ``q``
and KV cache and only launches kernels.  docs/concepts/performance.md says when this pays:
``L*(u - v) > p + h`` (``p`` is the plan() cost measured here).

The workspace
-------------
The caller hands the constructor one device buffer (FlashInfer's
``float_workspace_buffer``: a torch CUDA tensor, a numba device array, or, on
the simulator, a NumPy array that is copied to the device once).  It is cut
into fixed regions when the wrapper is built, so a plan never moves anything:

* **plan region** (int32, at the front): a small header, the per-CTA work
  queues (CSR over ``num_ctas`` CTAs), the reduction map, and a copy of the
  page table (and, for prefill, per-row positions).  Each array has a fixed
  offset and a fixed capacity (constructor arguments ``max_batch_size``,
  ``max_num_pages``, ``max_work_items``, ``max_qo_rows``).
* **partial region** (float32, the rest): partial outputs and their base-2
  LSEs.  Its size is the docs/concepts/scheduler.md bound, 2*C slots (App. D.3 of the
  paper), so *every* plan of a given head configuration fits once the first
  one did.

A plan that does not fit raises ``ValueError`` in :meth:`plan`, before any
copy or launch, naming the rule and the argument to grow.

Fixed grid, fixed addresses (what makes run() CUDA-graph capturable)
--------------------------------------------------------------------
* Decode: one persistent launch of ``num_ctas`` CTAs per KV-head block; CTA
  ``c`` walks its queue ``cta_indptr[c]:cta_indptr[c+1]``
  (:func:`nbattn.cuda.decode.run_decode_work`), reading the queue bounds from
  the workspace.
* Merge (:func:`nbattn.cuda.merge.merge_tiles_launch`): a fixed grid of
  ``num_ctas`` CTAs per KV head (a plan has at most ``num_ctas`` split tiles,
  since each has >= 2 of the <= 2*C partial slots);
  the number of merges is read from the workspace header, extra CTAs exit.
  Slots are folded in the plan's order (increasing KV), never with atomics,
  so equal lengths give bitwise-equal outputs.
* Prefill: persistent launches of ``num_ctas`` CTAs per KV head
  (:func:`nbattn.cuda.prefill.persistent_entry`), CTA ``c`` walking its LPT
  queue.  The queue is cut by output kind and run as two launches, first the
  chunks of split tiles (float32 partial states), then the unsplit tiles
  (final output): one kernel holding both bodies would need twice the static
  shared memory, past 48 KB.  Each phase keeps the plan's per-CTA order but
  is balanced only as a part of the whole queue.

Every array handed to a kernel is a view of the workspace with a fixed shape
(its capacity), so a captured launch replays correctly after a new plan()
with different lengths, as long as the head configuration, dtype and batch
(decode) are unchanged and ``q``/``out`` are the same buffers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

from .. import layout as L
from .._checks import count_arg
from ..sched.plan import DIRECT, Plan, plan as lpt_plan
from ..variants import check_return_lse, variant_from_kwargs
from .host import arrays as A
from .host import hostwork as HW
from . import decode as DEC
from .host.driver import BoundLaunch, HostToDevice, torch_stream, data_ptr, sm_count, stream_handle
from .merge import FEW_PARTIALS, MergeMap, merge_partials_launch, merge_tiles_launch
from .blocks.primitives import SIMULATOR

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
           "WorkspaceLayout", "default_num_ctas", "decode_plan_ctas", "DECODE_CHUNK_OVERHEAD"]

ALIGN = 256                 # byte alignment of every workspace array (16-byte loads need 16)
HEADER = 8                  # int32 header words
H_NUM_ITEMS, H_NUM_MERGES, H_NUM_PARTIALS, H_BATCH = 0, 1, 2, 3
ELEM_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
_Q_TYPES = {"float16": "f16", "half": "f16", "bfloat16": "bf16", "float32": "f32", "float": "f32",
            "f16": "f16", "bf16": "bf16", "f32": "f32"}


# Fixed price of one decode work item in KV tokens (the planner's
# ``chunk_overhead``): queue entry, first page ids, pipeline fill, the combine
# and the write of its state.  Fitted on the H200 from the decode kernel's time
# for the same keys cut into 1, 4, 16 and 64 items per CTA
# (``benchmarks/gpu_sched.py``, record ``item_overhead_tokens`` in sched.json):
# 63.7 tokens (4.3 us) on the warp path, 82.4 (5.2 us) on the tensor-core path
# that is now the default for groups >= 4.  Any value from 50 to 82 gives the
# very same queues on the benchmark's three workloads (checked on the CPU).
DECODE_CHUNK_OVERHEAD = 64.0


def default_num_ctas() -> int:
    """CTAs per KV head the workspace is built for when the caller does not say:
    one per SM (4 on the simulator).  A decode plan may use fewer (see
    :meth:`BatchDecodeWithPagedKVCacheWrapper.plan`)."""
    return sm_count()


def decode_plan_ctas(cfg, num_qo_heads: int, capacity: int) -> int:
    """CTAs per KV head a decode plan balances over: the CTAs of the persistent
    grid that are resident at once, at most ``capacity``.

    The warp and tensor-core paths' launch bounds promise ``cfg.min_blocks``
    CTAs per SM, and each planner CTA is ``num_qo_heads // heads_per_cta``
    kernel CTAs.  Planning for more queues than can run at once only cuts
    requests into chunks that then wait for a second wave; the shared-memory
    path (simulator, fallback) keeps the capacity."""
    if cfg.path not in ("warp", "tc"):
        return capacity
    head_blocks = num_qo_heads // cfg.heads_per_cta
    return max(1, min(capacity, cfg.min_blocks * sm_count() // head_blocks))


def _round_up(x: int, a: int = ALIGN) -> int:
    return -(-x // a) * a


def _q_code(q_data_type: Any) -> str:
    text = str(q_data_type).replace("torch.", "").replace("numpy.", "")
    if text in _Q_TYPES:
        return _Q_TYPES[text]
    try:
        return _Q_TYPES[np.dtype(q_data_type).name]
    except (TypeError, KeyError):
        raise ValueError(f"q_data_type: must be float16, bfloat16 or float32, got {q_data_type!r}")


def _data_code(q_data_type: Any, kv_data_type: Any) -> str:
    """plan()'s element type; ``kv_data_type`` may only repeat it (no mixed precision)."""
    code = _q_code(q_data_type)
    if kv_data_type is not None and _q_code(kv_data_type) != code:
        raise ValueError("kv_data_type: must equal q_data_type (no mixed precision)")
    return code


def _run_signature(kind: str, q, cache) -> tuple:
    """What run()'s checks of ``q`` and the cache depend on, beside the plan: dtypes,
    shapes, and for torch the devices and contiguity, else the strides.  A run() whose
    inputs have the signature the last accepted run() had passes those checks again,
    so it skips them (plan() forgets the signature)."""
    if kind in ("torch", "torch_cpu"):
        return (q.dtype, q.shape, q.device, q.is_contiguous(), cache.dtype, cache.shape, cache.device,
                cache.is_contiguous())
    return (q.dtype, tuple(q.shape), tuple(q.strides), cache.dtype, tuple(cache.shape), tuple(cache.strides))


def _page_table(indptr, indices, last_page_len, page_size) -> L.PagedKV:
    """plan()'s page table; the cache is not known yet, so any page id fits (run() checks)."""
    if int(page_size) < 1:
        raise ValueError(f"page_size: must be >= 1, got {page_size}")
    return HW.page_table(indptr, indices, last_page_len, int(page_size), np.iinfo(np.int32).max)


# ---------------------------------------------------------------------------
# Workspace layout
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkspaceLayout:
    """Byte offsets of the plan arrays (int32) and the start of the partial region.

    ``arrays[name] = (byte_offset, capacity_in_elements)``.  Computed once per
    wrapper from its capacities; nothing here depends on a plan.
    """
    arrays: dict
    plan_bytes: int
    total_bytes: int

    @property
    def partial_bytes(self) -> int:
        return self.total_bytes - self.plan_bytes

    @classmethod
    def build(cls, total_bytes: int, sizes: dict) -> "WorkspaceLayout":
        arrays, off = {}, 0
        for name, count in sizes.items():
            arrays[name] = (off, int(count))
            off = _round_up(off + 4 * max(int(count), 1))
        return cls(arrays, off, int(total_bytes))


def _workspace_bytes(buf: Any):
    """(numba uint8 device array over the buffer, its size in bytes)."""
    if buf is None:
        raise ValueError("float_workspace_buffer: a preallocated device buffer is required "
                         "(e.g. torch.empty(128 << 20, dtype=torch.uint8, device='cuda'))")
    kind = A.kind_of(buf)
    if kind in ("numpy", "torch_cpu"):
        if not SIMULATOR:
            raise ValueError("float_workspace_buffer: must live on the GPU (a torch CUDA tensor or "
                             "a numba device array); host arrays are accepted only on the simulator")
        host = np.ascontiguousarray(L.to_numpy(buf)).reshape(-1).view(np.uint8)
        return cuda.to_device(np.zeros(host.size, np.uint8)), int(host.size)
    A.check_contiguous(buf, "float_workspace_buffer")
    if kind == "torch":
        import torch
        dev = cuda.as_cuda_array(buf.detach().reshape(-1).view(torch.uint8))
    else:
        dev = buf if kind == "numba" else cuda.as_cuda_array(buf)
        dev = A.flat(dev).view(np.uint8)
    return dev, int(dev.shape[0])


# ---------------------------------------------------------------------------
# Shared machinery of both wrappers
# ---------------------------------------------------------------------------

class _PlanRunWrapper:
    _decode = True

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 *, num_ctas: int | None = None, max_batch_size: int | None = None,
                 max_num_pages: int | None = None, max_work_items: int | None = None,
                 max_qo_rows: int | None = None) -> None:
        self._kv_layout = L.check_kv_layout(kv_layout)
        self._use_cuda_graph = bool(use_cuda_graph)
        self._ws, nbytes = _workspace_bytes(float_workspace_buffer)
        self._ws_user = float_workspace_buffer
        C = default_num_ctas() if num_ctas is None else count_arg("num_ctas", num_ctas)
        for name, cap in (("max_batch_size", max_batch_size), ("max_num_pages", max_num_pages),
                          ("max_work_items", max_work_items), ("max_qo_rows", max_qo_rows)):
            if cap is not None:
                count_arg(name, cap)
        self.num_ctas = C
        # Capacities default to shares of the buffer (a 128 MiB buffer gives
        # 16k requests, 512k pages, 128k work items and 256k query rows).
        self.max_batch_size = int(max_batch_size or max(1, nbytes // 8192))
        self.max_num_pages = int(max_num_pages or max(1, nbytes // 256))
        self.max_work_items = int(max_work_items or max(1, nbytes // 1024))
        self.max_qo_rows = int(max_qo_rows or max(1, nbytes // 512))
        B, I = self.max_batch_size, self.max_work_items
        # Small per-plan arrays first and together, so one plan() is a handful of
        # host-to-device copies (see _flush), not one per array.
        sizes = {"header": HEADER, "cta_indptr": C + 1, "merge_indptr": C + 1, "merge_request": C,
                 "merge_qo_tile": C, "merge_slots": 2 * C, "kv_indptr": B + 1, "kv_last": B}
        if self._decode:
            # A decode plan has one query tile per request, so at most
            # batch + 2*C items (the split tiles add at most 2*C chunks).
            sizes.update(request=I, kv_start=I, kv_end=I, out_slot=I)
        else:
            # Prefill work rows (8 int32 columns, see nbattn.cuda.prefill.build_work) in
            # CTA-queue order, with per-CTA bounds: up to I unsplit tiles (final
            # output) and the at most 2*C chunks of split tiles (partial states).
            sizes.update(qo_indptr=B + 1, final_indptr=C + 1, part_indptr=C + 1,
                         part_rows=8 * 2 * C, final_rows=8 * I, row_pos=self.max_qo_rows,
                         row_kvoff=self.max_qo_rows, row_req=self.max_qo_rows)
        sizes.update(kv_indices=self.max_num_pages)
        self.layout = WorkspaceLayout.build(nbytes, sizes)
        if self.layout.plan_bytes >= nbytes:
            raise ValueError(
                f"float_workspace_buffer: {nbytes} bytes cannot hold the plan region of "
                f"{self.layout.plan_bytes} bytes (num_ctas={C}, max_batch_size={B}, "
                f"max_num_pages={self.max_num_pages}, max_work_items={I}); pass a larger "
                f"buffer or smaller capacities")
        self._ints = self._ws[:self.layout.plan_bytes].view(np.int32)
        # Fixed-shape views, made once: slicing a device array costs tens of us.
        self._views = {name: self._ints[off // 4: off // 4 + max(cap, 1)]
                       for name, (off, cap) in self.layout.arrays.items()}
        self._h2d = HostToDevice(self.layout.plan_bytes // 4)     # pinned staging image of the plan region
        self._ints_ptr = None
        self._host = self._h2d.host
        self._dirty: list = []         # element spans of _host that plan() wrote
        self._plan: Plan | None = None
        self._slopes = None
        self._slopes_heads = 0
        self._bound: dict = {}          # bound launches of run(), by configuration
        self._bound_now = None          # the current plan's entry of _bound (reset by plan())
        self._run_seen = None           # what the last run() of this plan accepted (see _run_inputs)
        self._scratch_lse = None
        self.plan_seconds = 0.0

    # -- workspace views ----------------------------------------------------
    def _view(self, name: str):
        """Fixed-shape int32 view (the array's full capacity) of a plan array."""
        return self._views[name]

    def _partials(self, slot_rows: int, num_qo_heads: int, head_dim: int):
        """(partial_o, partial_lse) flat float32 views for 2*C slots of ``slot_rows`` rows."""
        rows = 2 * self.num_ctas * slot_rows
        base = self.layout.plan_bytes
        lse_bytes = _round_up(4 * rows * num_qo_heads)
        o_count = rows * num_qo_heads * head_dim
        lse = self._ws[base: base + 4 * rows * num_qo_heads].view(np.float32)
        o = self._ws[base + lse_bytes: base + lse_bytes + 4 * o_count].view(np.float32)
        return o, lse

    def _partial_bytes_needed(self, slot_rows: int, num_qo_heads: int, head_dim: int) -> int:
        rows = 2 * self.num_ctas * slot_rows
        return _round_up(4 * rows * num_qo_heads) + 4 * rows * num_qo_heads * head_dim

    def _check_fits(self, batch: int, num_pages: int, num_items: int, num_qo_heads: int,
                    head_dim: int, slot_rows: int, tile_q: int, qo_rows: int = 0) -> None:
        """Raise ValueError (before any copy) when a plan would not fit the workspace."""
        for what, need, cap, arg in (("requests", batch, self.max_batch_size, "max_batch_size"),
                                     ("pages", num_pages, self.max_num_pages, "max_num_pages"),
                                     ("work items", num_items, self.max_work_items, "max_work_items"),
                                     ("query rows", qo_rows, self.max_qo_rows, "max_qo_rows")):
            if need > cap:
                raise ValueError(f"plan does not fit the workspace: {need} {what} but the wrapper "
                                 f"was built for {cap} ({arg}); build it with a larger {arg}")
        need = self._partial_bytes_needed(slot_rows, num_qo_heads, head_dim)
        have = self.layout.partial_bytes
        if need > have:
            C = self.num_ctas
            total = self.layout.plan_bytes + need
            raise ValueError(
                f"float_workspace_buffer too small: partial states need {need} bytes but only "
                f"{have} remain after the {self.layout.plan_bytes}-byte plan region. Rule "
                f"(docs/concepts/scheduler.md, paper App. D.3): reserve 2*C*T_q*H_qo*(head_dim+1) floats for partial "
                f"outputs and LSEs, here 2*{C} slots x {slot_rows} rows x {num_qo_heads} heads x "
                f"({head_dim}+1) (T_q={tile_q}); pass at least {total} bytes or fewer num_ctas")

    def _begin_plan(self) -> int:
        """The stream a plan's copies go on (torch's current one for a torch workspace),
        once the staging image may be rewritten."""
        self._h2d.begin()
        self._bound_now = None
        self._run_seen = None
        return 0 if SIMULATOR else stream_handle(self._ws_user)

    def _copy(self, name: str, host: np.ndarray) -> None:
        """Stage ``host`` (int32) at the front of array ``name``; :meth:`_flush` sends it.
        Kernels read each array only up to bounds the plan also writes (queue
        bounds, merge count), so stale entries past the front are never seen."""
        host = np.ascontiguousarray(host, dtype=np.int32).reshape(-1)
        off, _ = self.layout.arrays[name]
        start, end = off // 4, off // 4 + host.size
        self._host[start:end] = host
        if end > start:
            self._dirty.append((start, end))

    def _flush(self, stream) -> None:
        """Copy the staged spans to the workspace, neighbours merged into one copy
        when the gap between them is small (the small arrays sit together)."""
        spans = sorted(self._dirty)
        self._dirty = []
        merged: list = []
        for a, b in spans:
            if merged and a - merged[-1][1] <= 4096:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        if self._ints_ptr is None and not SIMULATOR:
            self._ints_ptr = data_ptr(self._ints)
        for a, b in merged:
            self._h2d.copy(self._ints, a, b, stream, self._ints_ptr)
        self._h2d.end(stream)

    def _stream(self):
        return A.launch_stream(self._ws_user)

    def _slopes_for(self, num_qo_heads: int, stream):
        # Kept at one address while the head count is unchanged (captured graphs read it).
        if self._slopes is None or self._slopes_heads != num_qo_heads:
            from . import prefill as P
            self._slopes = cuda.to_device(P.tile_slopes(num_qo_heads, True))
            self._slopes_heads = num_qo_heads
        return self._slopes

    def _write_common(self, p: Plan, kv_indptr, kv_indices, kv_last, stream) -> None:
        header = np.zeros(HEADER, np.int32)
        header[H_NUM_ITEMS] = p.num_items
        header[H_NUM_MERGES] = p.num_merges
        header[H_NUM_PARTIALS] = p.num_partials
        header[H_BATCH] = len(kv_indptr) - 1
        self._copy("header", header)
        # A plan may use fewer queues than the grid has CTAs: the rest get empty ones.
        cta_indptr = np.full(self.num_ctas + 1, p.num_items, np.int32)
        cta_indptr[:p.num_ctas + 1] = p.cta_indptr
        self._copy("cta_indptr", cta_indptr)
        self._copy("merge_indptr", p.merge_indptr)
        self._copy("merge_request", p.merge_request)
        self._copy("merge_qo_tile", p.merge_qo_tile)
        self._copy("merge_slots", p.merge_slots)
        self._copy("kv_indptr", kv_indptr)
        self._copy("kv_indices", kv_indices)
        self._copy("kv_last", kv_last)

    def _check_bound(self, p: Plan) -> None:
        C = self.num_ctas
        if p.num_ctas > C:
            raise ValueError(f"num_ctas: a plan over {p.num_ctas} CTAs does not fit the grid of "
                             f"{C} the wrapper was built for")
        if p.num_partials > 2 * C or p.num_merges > C:
            raise ValueError(f"plan has {p.num_partials} partial slots / {p.num_merges} merges, over "
                             f"the scheduler's bound of 2*C={2 * C} / C={C} (docs/concepts/scheduler.md)")

    @property
    def last_plan(self) -> Plan | None:
        """The :class:`nbattn.sched.Plan` of the last :meth:`plan` call."""
        return self._plan

    def _need_plan(self):
        if self._plan is None:
            raise RuntimeError("run() called before plan()")

    def _check_run(self, q, cache, out, lse):
        """The per-call checks of run(): (kind, dtype code, cache size in 32-bit words)."""
        kind = A.kind_of(q)
        code = A.dtype_code(q, "q")
        if code != self._code:
            raise L.LayoutError(f"q: dtype {L.dtype_of(q)} differs from plan()'s q_data_type ({self._code})")
        if A.dtype_code(cache, "paged_kv_cache") != code:
            raise L.LayoutError(f"paged_kv_cache: dtype must match q, got {L.dtype_of(cache)}")
        shape = self._q_shape
        if q.shape != shape:
            raise L.LayoutError(f"q: must have shape {shape} for this plan, got {tuple(int(x) for x in q.shape)}")
        cshape = tuple(cache.shape)
        if len(cshape) != 5 or cshape[1] != 2:
            L.cache_dims(cache, self._kv_layout)              # raises the layout's message
        ps, hk = (cshape[2], cshape[3]) if self._kv_layout == "NHD" else (cshape[3], cshape[2])
        if (ps, hk, cshape[4]) != (self._page_size, self._num_kv_heads, self._head_dim):
            raise L.LayoutError(f"paged_kv_cache: (page_size, num_kv_heads, head_dim) = "
                                f"{(int(ps), int(hk), int(cshape[4]))} differs from plan()'s "
                                f"{(self._page_size, self._num_kv_heads, self._head_dim)}")
        if self._max_page >= cshape[0]:
            raise L.LayoutError(f"paged_kv_cache: plan() uses page {self._max_page} but the cache "
                                f"has {int(cshape[0])} pages")
        dev = kind in ("torch", "numba", "cai")
        if dev != (A.kind_of(cache) in ("torch", "numba", "cai")):
            raise L.LayoutError("paged_kv_cache: must live where q lives")
        if kind == "torch":
            if q.device != cache.device:
                raise L.LayoutError(f"paged_kv_cache: must be on q's device ({q.device}), got {cache.device}")
            if not (q.is_contiguous() and cache.is_contiguous()):
                raise L.LayoutError("q, paged_kv_cache: device arrays must be C-contiguous "
                                    "(they are used in place)")
        elif dev:
            A.check_contiguous(q, "q")
            A.check_contiguous(cache, "paged_kv_cache")
        for name, x, want, c in (("out", out, shape, code), ("lse", lse, shape[:2], None)):
            if x is not None:
                DEC._check_out(name, x, tuple(int(v) for v in want), c, kind)
                if kind == "torch" and x.device != q.device:
                    raise L.LayoutError(f"{name}: must be on q's device ({q.device}), got {x.device}")
        n = 1
        for v in cshape:
            n *= int(v)
        return kind, code, n * ELEM_BYTES[code] // 4

    def _run_inputs(self, q, paged_kv_cache, out, lse, return_lse: bool):
        """What every run() does before it launches: the per-call checks (:meth:`_check_run`),
        q and the cache on the device (torch CUDA tensors as they are), the stream, and
        the outputs.  Returns (kind, code, stream, q_dev, kv_dev, out_user, out_dev,
        lse_user, lse_dev)."""
        self._need_plan()
        seen = self._run_seen
        if (seen is not None and out is None and lse is None and type(q) is seen[0]
                and type(paged_kv_cache) is seen[0] and not (return_lse and self._variant.use_sigmoid)
                and _run_signature(seen[1], q, paged_kv_cache) == seen[2]):
            kind, code, kv_words = seen[1], self._code, seen[3]        # as the last run() accepted
        else:
            if return_lse and self._variant.use_sigmoid:
                check_return_lse(self._variant, return_lse)
            kind, code, kv_words = self._check_run(q, paged_kv_cache, out, lse)
            if out is None and lse is None and type(q) is type(paged_kv_cache) and kind != "cai":
                self._run_seen = (type(q), kind, _run_signature(kind, q, paged_kv_cache), kv_words)
        dev = kind in ("torch", "numba", "cai")
        q_dev = q if dev else A.to_device(q, "q", 0, code)
        kv_dev = paged_kv_cache if dev else A.to_device(paged_kv_cache, "paged_kv_cache", 0, code)
        if not SIMULATOR and (data_ptr(q_dev) | data_ptr(kv_dev)) % 16:
            raise L.LayoutError("q, paged_kv_cache: must start at 16-byte aligned addresses (the kernels "
                                "read 16 bytes at a time)")
        stream = 0 if SIMULATOR else (torch_stream(q.device.index) if kind == "torch" else stream_handle(q))
        shape = self._q_shape
        if kind == "torch":
            out_dev = out if out is not None else q.new_empty(shape)
            lse_dev = lse if lse is not None else self._lse_scratch(q, return_lse)
            out_user, lse_user = out_dev, lse_dev
        else:
            out_user, out_dev = A.output_for("out", out, kind, shape, code, 0, like=q)
            lse_user, lse_dev = A.output_for("lse", lse, kind, shape[:2], "f32", 0, like=q)
        return kind, code, stream, q_dev, kv_dev, kv_words, out_user, out_dev, lse_user, lse_dev

    def _results(self, kind, code, out, out_user, out_dev, lse, lse_user, lse_dev, return_lse: bool):
        if kind == "torch":
            return (out_dev, lse_dev) if return_lse else out_dev
        return A.finish_results(kind, code, 0, out, out_user, out_dev, lse, lse_user, lse_dev, return_lse)

    def _lse_scratch(self, q, return_lse: bool):
        """A fresh LSE when the caller gets it, else one reused buffer (the kernels write
        an LSE either way)."""
        shape = self._q_shape[:2]
        if return_lse:
            import torch
            return torch.empty(shape, dtype=torch.float32, device=q.device)
        buf = self._scratch_lse
        if buf is None or tuple(buf.shape) != shape or buf.device != q.device:
            import torch
            buf = self._scratch_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
        return buf

# ---------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------

class BatchDecodeWithPagedKVCacheWrapper(_PlanRunWrapper):
    """Batch decode (one query row per request) over a paged KV cache, planned
    once per step and run once per layer (docs/concepts/scheduler.md).

    >>> ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    >>> w = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    >>> w.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16)
    >>> for layer in range(32):
    ...     o = w.run(q[layer], kv_cache[layer])

    ``num_ctas`` is the fixed grid per KV head (the planner's C); the decode
    kernel runs ``num_ctas * num_qo_heads // heads_per_cta`` CTAs (see
    :func:`nbattn.cuda.decode.run_decode_work`).
    """

    _decode = True

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type: Any = "float16",
             kv_data_type: Any = None, sm_scale: float | None = None, *, alpha: float = 1.0,
             beta: float = 1.0, chunk_overhead: float = DECODE_CHUNK_OVERHEAD,
             chunk_limit: int | str | None = "auto", num_ctas: int | None = None,
             schedule: str = "auto", **variant) -> None:
        """Plan a decode step and copy the plan into the workspace.

        Arguments are FlashInfer's; other variant keywords of
        :mod:`nbattn.variants` (``sink_size``, ``use_sigmoid``, ``score_mod``,
        ...) pass through.  The metadata (``indptr``, ``indices``,
        ``last_page_len``) is read on the host: NumPy arrays, lists or CPU
        tensors; a GPU tensor is copied to the host once, here.

        ``schedule`` picks how the keys are cut into work:

        * ``"lpt"``: the LPT planner (:func:`nbattn.sched.plan`) balances the
          requests' chunks over ``num_ctas`` persistent CTAs per head block
          (by default the decode kernel's resident CTAs, :func:`decode_plan_ctas`);
          ``alpha``/``beta``/``chunk_overhead`` are its chunk cost
          ``chunk_overhead + alpha*l_q + beta*l_kv`` and ``chunk_limit`` its
          limit rule (``None``: ``ceil(W/C)``).
        * ``"split"``: every request is cut into the same number of equal
          chunks, as many as fill one wave of the small-batch kernel shape,
          merged by the one-round merge; both kernels launch programmatically.
          This is the standalone decode's split for small batches.
        * ``"auto"`` (default): ``"split"`` where the batch alone leaves the SMs
          idle (the small-batch kernel shape applies), else ``"lpt"``.

        Raises before touching the workspace when the plan would not fit it.
        """
        t0 = time.perf_counter()
        var = variant_from_kwargs(dict(variant, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                                       logits_soft_cap=logits_soft_cap, sm_scale=sm_scale))
        code = _data_code(q_data_type, kv_data_type)
        group = L.check_heads(int(num_qo_heads), int(num_kv_heads))
        DEC._check_head_dim(int(head_dim))
        if schedule not in ("auto", "lpt", "split"):
            raise ValueError(f"schedule: must be 'auto', 'lpt' or 'split', got {schedule!r}")
        pkv = _page_table(indptr, indices, last_page_len, page_size)
        batch = pkv.batch_size
        kv_lens = pkv.kv_lens
        hq, hk, D = int(num_qo_heads), int(num_kv_heads), int(head_dim)
        cfg = DEC.make_config(code, D, group, self._kv_layout, var, True, batch * hk)
        small = cfg.path == "tc" and cfg.min_blocks == 1          # the one-wave small-batch shape
        mode = ("split" if small and batch <= self.num_ctas else "lpt") if schedule == "auto" else schedule
        if mode == "split" and batch > self.num_ctas:
            raise ValueError(f"schedule: 'split' runs one work item per CTA of the constructor's grid, "
                             f"so batch ({batch}) must be at most num_ctas ({self.num_ctas})")
        if num_ctas is not None and not 1 <= int(num_ctas) <= self.num_ctas:
            raise ValueError(f"num_ctas: must be in 1..{self.num_ctas} (the constructor's grid), "
                             f"got {num_ctas}")
        if mode == "split":
            p = self._split_plan(kv_lens, batch, hq // cfg.heads_per_cta, cfg)
        else:
            if small:       # the persistent grid runs the batch-independent shape
                cfg = DEC.make_config(code, D, group, self._kv_layout, var)
            if num_ctas is None:
                num_ctas = decode_plan_ctas(cfg, hq, self.num_ctas)
            # One query tile per request: its `group` fused rows are one decode CTA's heads.
            p = lpt_plan(np.ones(batch, np.int64), kv_lens, int(num_ctas), tile_q=group, group=group,
                         alpha=alpha, beta=beta, chunk_overhead=chunk_overhead, chunk_limit=chunk_limit)
            self._check_bound(p)
        self._check_fits(batch, int(pkv.paged_kv_indices.size), p.num_items, hq, D, 1, group)
        stream = self._begin_plan()
        self._write_common(p, pkv.paged_kv_indptr, pkv.paged_kv_indices,
                           pkv.paged_kv_last_page_len, stream)
        self._copy("request", p.request)
        self._copy("kv_start", p.kv_start)
        self._copy("kv_end", p.kv_end)
        self._copy("out_slot", p.out_slot)
        self._flush(stream)
        self._slopes_for(hq, stream)
        self._plan, self._variant, self._code, self._cfg, self._mode = p, var, code, cfg, mode
        self._num_qo_heads, self._num_kv_heads, self._group = hq, hk, group
        self._head_dim, self._page_size, self._batch = D, int(page_size), batch
        self._kv_lens = kv_lens
        self._max_page = int(pkv.paged_kv_indices.max()) if pkv.paged_kv_indices.size else -1
        self._q_shape = (batch, hq, D)
        self._bound_key = (cfg, mode, p.num_ctas if mode == "split" else self.num_ctas, batch, hq,
                           p.num_partials if mode == "split" else -1)
        self.plan_seconds = time.perf_counter() - t0

    def _split_plan(self, kv_lens: np.ndarray, batch: int, head_blocks: int, cfg) -> Plan:
        """Every request in ``splits`` chunks (one wave of the small-batch shape), the
        chunk a multiple of 16 keys; chunk j of request r writes slot ``r*splits + j``
        (empty chunks past a short request's end write an empty state).  The number of
        items depends on the batch and heads only, so a captured graph replays after a
        re-plan with other lengths."""
        slots = cfg.min_blocks * sm_count()
        splits = max(1, min(slots // max(batch * head_blocks, 1), self.num_ctas // max(batch, 1),
                            FEW_PARTIALS))
        lens = kv_lens.astype(np.int64)
        chunk = np.maximum(16, -(-(-(-lens // splits)) // 16) * 16)            # per request
        j = np.tile(np.arange(splits, dtype=np.int64), batch)
        r = np.repeat(np.arange(batch, dtype=np.int64), splits)
        start = np.minimum(j * chunk[r], lens[r])
        end = np.minimum(start + chunk[r], lens[r])
        n = batch * splits
        direct = splits == 1
        i32 = lambda x: np.ascontiguousarray(x, np.int32)  # noqa: E731
        cost = (end - start).astype(np.float64)
        return Plan(num_ctas=n, tile_q=1, group=1, chunk_limit=int(chunk.max(initial=16)), alpha=0.0, beta=1.0,
                    chunk_overhead=0.0, causal=False, qo_lens=np.ones(batch, np.int32),
                    kv_lens=i32(lens), cta_indptr=i32(np.arange(n + 1)), request=i32(r),
                    qo_tile=np.zeros(n, np.int32), kv_start=i32(start), kv_end=i32(end),
                    out_slot=i32(np.full(n, DIRECT) if direct else np.arange(n)),
                    merge_indptr=i32([0] if direct else np.arange(0, n + 1, splits)),
                    merge_request=i32([] if direct else np.arange(batch)),
                    merge_qo_tile=np.zeros(0 if direct else batch, np.int32),
                    merge_slots=i32([] if direct else np.arange(n)),
                    num_partials=0 if direct else n, cta_cost=cost,
                    makespan=float(cost.max(initial=0.0)), lower_bound=float(cost.max(initial=0.0)))

    # -- run ------------------------------------------------------------------
    def run(self, q, paged_kv_cache, out=None, lse=None, return_lse: bool = False):
        """Attention of ``q [batch, num_qo_heads, head_dim]`` against the planned
        pages of ``paged_kv_cache``; returns ``o`` (and the base-2 ``lse``).

        Checks only what can change between calls (shapes, dtypes and devices of
        ``q``, the cache, ``out`` and ``lse``) and launches the kernels bound at
        the first run of this plan's configuration; with torch CUDA tensors it
        launches on torch's current stream and returns torch tensors."""
        kind, code, stream, q_dev, kv_dev, kv_words, out_user, out_dev, lse_user, lse_dev = self._run_inputs(
            q, paged_kv_cache, out, lse, return_lse)
        bound = self._bound_now               # this plan's launches, found once (not hashed per call)
        if bound is None:
            bound = self._bound_now = self._bound_launches(q_dev, kv_dev)
        dec, merge, ix = bound
        dec.set(ix["q"], q_dev)
        dec.set(ix["kv"], kv_dev, kv_words)
        dec.set(ix["out"], out_dev)
        dec.set(ix["lse"], lse_dev)
        dec(stream)
        if merge is not None:
            merge.set(ix["merge_out"], out_dev)
            merge.set(ix["merge_lse"], lse_dev)
            merge(stream)
        return self._results(kind, code, out, out_user, out_dev, lse, lse_user, lse_dev, return_lse)

    forward = run

    def _bound_launches(self, q_dev, kv_dev):
        """(decode, merge or None, argument indices): bound once per configuration."""
        key = self._bound_key
        hit = self._bound.get(key)
        if hit is not None:
            return hit
        cfg, code, D, hq = self._cfg, self._code, self._head_dim, self._num_qo_heads
        var = self._variant
        q_w, kv_w = A.words(A.to_device(q_dev, "q", 0, code)), A.words(A.to_device(kv_dev, "paged_kv_cache", 0, code))
        out0 = cuda.device_array((self._batch, hq, D), A.RAW[code])
        lse0 = cuda.device_array((self._batch, hq), np.float32)
        prob = DEC.DecodeProblem(code, "numba", 0, var, var.scale(D), self._batch, hq, self._num_kv_heads, D,
                                 self._page_size, self._kv_layout, self._kv_lens, q_w, kv_w,
                                 self._view("kv_indptr"), self._view("kv_indices"), self._view("kv_last"),
                                 self._slopes, out0, out0, lse0, lse0, True)
        work = DEC.WorkList(self._view("cta_indptr"), self._view("request"), self._view("kv_start"),
                            self._view("kv_end"), self._view("out_slot"))
        po, pl = self._partials(1, hq, D)
        split = self._mode == "split"
        if split:       # the persistent grid is the plan's items, one per CTA
            work = work._replace(cta_indptr=self._view("cta_indptr")[:self._plan.num_ctas + 1])
        kern, grid, threads, args = DEC._launch_for(prob, cfg, work, po, pl, prefetch=split and DEC.DECODE_PROGRAMMATIC)
        ix = DEC.decode_arg_index(cfg)
        conv = {ix["q"]: lambda x: A.words(A.to_device(x, "q", 0, code)),
                ix["kv"]: lambda x: A.words(A.to_device(x, "paged_kv_cache", 0, code)),
                ix["out"]: lambda x: A.flat(A.to_device(x, "out", 0, code)),
                ix["lse"]: lambda x: A.flat(A.to_device(x, "lse", 0, "f32"))}
        dec = BoundLaunch(kern, grid, threads, args, convert=conv,
                          programmatic=split and DEC.DECODE_PROGRAMMATIC and cfg.path == "tc")
        merge = None
        if split and self._plan.num_partials:
            B = self._batch
            mmap = MergeMap(self._view("merge_indptr")[:B + 1], self._view("merge_request")[:B],
                            self._view("merge_slots")[:self._plan.num_partials])
            k, g, t, a = merge_partials_launch(po.reshape(2 * self.num_ctas, hq, D), pl.reshape(2 * self.num_ctas, hq),
                                               mmap, out0, lse0, code=code, use_sigmoid=var.use_sigmoid,
                                               max_partials=self._plan.num_partials // B)
            ix = dict(ix, merge_out=5, merge_lse=6)
        elif not split:
            k, g, t, a = merge_tiles_launch(
                self._view("header")[H_NUM_MERGES:H_NUM_MERGES + 1], self._view("merge_indptr"),
                self._view("merge_request"), self._view("merge_qo_tile"), self._view("merge_slots"),
                self._view("cta_indptr"), po, pl, A.flat(out0), A.flat(lse0), code=code, head_dim=D,
                num_qo_heads=hq, num_kv_heads=self._num_kv_heads, group=self._group, tile_q=self._plan.tile_q,
                slot_rows=1, num_ctas=self.num_ctas, per_request_row=True, use_sigmoid=var.use_sigmoid)
            ix = dict(ix, merge_out=8, merge_lse=9)
        if split and not self._plan.num_partials:
            merge = None
        else:
            mconv = {ix["merge_out"]: conv[ix["out"]], ix["merge_lse"]: conv[ix["lse"]]}
            merge = BoundLaunch(k, g, t, a, convert=mconv)
        self._bound[key] = (dec, merge, ix)
        return self._bound[key]



# ---------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------

class BatchPrefillWithPagedKVCacheWrapper(_PlanRunWrapper):
    """Batch prefill/append over a paged KV cache with a planned KV split
    (docs/concepts/scheduler.md); kernels from :mod:`nbattn.cuda.prefill`.

    The planner's query tile is the prefill kernel's ``T_q`` (fused rows, GQA
    heads fused).  Unsplit tiles write the final output directly; chunks of
    split tiles write float32 partial states that the merge kernel folds in
    KV order.  Every launch of :meth:`run` has a fixed grid, so
    ``use_cuda_graph`` (FlashInfer's flag) changes nothing here.
    """

    _decode = False

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             causal: bool = False, pos_encoding_mode: str = "NONE", sm_scale: float | None = None,
             window_left: int = -1, logits_soft_cap: float | None = None,
             q_data_type: Any = "float16", kv_data_type: Any = None, *, alpha: float = 1.0,
             beta: float = 1.0, chunk_overhead: float = 0.0, chunk_limit: int | str | None = None,
             tensor_cores: bool | None = None, **variant) -> None:
        """LPT-plan a prefill step (FlashInfer's arguments) and copy it into the workspace.

        The planner's cost and limit rule (``alpha``, ``beta``, ``chunk_overhead``,
        ``chunk_limit``) default to docs/concepts/scheduler.md exactly: the persistent prefill
        kernel's per-item price has not been measured."""
        from . import prefill as P

        t0 = time.perf_counter()
        var = variant_from_kwargs(dict(variant, causal=causal, pos_encoding_mode=pos_encoding_mode,
                            window_left=window_left, logits_soft_cap=logits_soft_cap,
                            sm_scale=sm_scale))
        code = _data_code(q_data_type, kv_data_type)
        hq, hk, D = int(num_qo_heads), int(num_kv_heads), int(head_dim_qk)
        group = L.check_heads(hq, hk)
        pkv = _page_table(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        qo = L.RaggedQ.validate(qo_indptr)
        if qo.batch_size != pkv.batch_size:
            raise L.LayoutError(f"paged_kv_indptr: has {pkv.batch_size} requests, qo_indptr has "
                                f"{qo.batch_size}")
        kv_lens = pkv.kv_lens
        if var.causal:
            L.check_causal_lengths(qo.lengths, kv_lens)
        spec = P.make_spec("paged", self._kv_layout, code, D, hq, hk, var, tensor_cores)
        spec_part = P.make_spec("paged", self._kv_layout, code, D, hq, hk, var, spec.tensor_cores,
                                out_kind="f32")
        tq = spec.tile_q
        # Positions one tile spans: tq/group when tiles start on a position boundary.
        slot_rows = tq // group if tq % group == 0 else tq // group + 2
        p = lpt_plan(qo.lengths, kv_lens, self.num_ctas, tile_q=tq, group=group, alpha=alpha,
                     beta=beta, chunk_overhead=chunk_overhead, chunk_limit=chunk_limit,
                     causal=var.causal)
        self._check_bound(p)
        n_direct = int(np.count_nonzero(p.out_slot == DIRECT))
        self._check_fits(qo.batch_size, int(pkv.paged_kv_indices.size), n_direct, hq, D, slot_rows,
                         tq, qo.total)

        # Work rows in the plan's CTA-queue order: the persistent kernel's CTA c
        # runs rows cta_indptr[c]:cta_indptr[c+1].
        r = p.request.astype(np.int64)
        row0 = p.qo_tile.astype(np.int64) * tq
        slot = p.out_slot.astype(np.int64)
        qo_start = qo.qo_indptr[:-1].astype(np.int64)[r]
        out_row0 = np.where(slot == DIRECT, qo_start, slot * slot_rows - row0 // group)
        rows = np.stack([qo_start, qo.lengths[r], row0, pkv.paged_kv_indptr[:-1][r],
                         np.zeros_like(r), p.kv_start, p.kv_end, out_row0], axis=1)
        # Each CTA's queue, cut by output kind: two persistent launches (see run()).
        cta = p.item_cta()
        split = slot != DIRECT
        final_indptr = np.zeros(self.num_ctas + 1, np.int32)
        part_indptr = np.zeros(self.num_ctas + 1, np.int32)
        final_indptr[1:p.num_ctas + 1] = np.bincount(cta[~split], minlength=p.num_ctas)
        part_indptr[1:p.num_ctas + 1] = np.bincount(cta[split], minlength=p.num_ctas)
        final_indptr, part_indptr = np.cumsum(final_indptr), np.cumsum(part_indptr)
        row_pos, row_kvoff, row_req = P.request_rows(qo, kv_lens)

        stream = self._begin_plan()
        self._write_common(p, pkv.paged_kv_indptr, pkv.paged_kv_indices,
                           pkv.paged_kv_last_page_len, stream)
        self._copy("final_rows", rows[~split])
        self._copy("part_rows", rows[split])
        self._copy("final_indptr", final_indptr)
        self._copy("part_indptr", part_indptr)
        self._copy("qo_indptr", qo.qo_indptr)
        self._copy("row_pos", row_pos)
        self._copy("row_kvoff", row_kvoff)
        self._copy("row_req", row_req)
        self._flush(stream)
        self._slopes_for(hq, stream)
        self._plan, self._variant, self._code = p, var, code
        self._spec, self._spec_part, self._slot_rows = spec, spec_part, slot_rows
        self._num_qo_heads, self._num_kv_heads, self._group = hq, hk, group
        self._head_dim, self._page_size, self._total_q = D, int(page_size), qo.total
        self._max_page = int(pkv.paged_kv_indices.max()) if pkv.paged_kv_indices.size else -1
        self._q_shape = (qo.total, hq, D)
        self.plan_seconds = time.perf_counter() - t0

    def run(self, q, paged_kv_cache, out=None, lse=None, return_lse: bool = False):
        """Attention of ragged ``q [total_q, num_qo_heads, head_dim]`` (rows as
        in plan()'s ``qo_indptr``) over the planned pages; returns ``o`` (and
        the base-2 ``lse``).

        As the decode wrapper's run(): only what can change between calls is
        checked, then three launches bound once per plan configuration run on
        torch's current stream (torch CUDA tensors in, torch tensors out)."""
        kind, code, stream, q_dev, kv_dev, kv_words, out_user, out_dev, lse_user, lse_dev = self._run_inputs(
            q, paged_kv_cache, out, lse, return_lse)
        bound = self._bound_now               # this plan's launches for this cache shape
        if bound is None or bound[0] != kv_dev.shape:
            bound = self._bound_now = (kv_dev.shape, self._bound_launches(q_dev, kv_dev, out_dev, lse_dev))
        part, final, merge = bound[1]
        for bl in (part, final):
            bl.set(0, q_dev)
            bl.set(1, kv_dev)
            bl.set(2, kv_dev)
        final.set(12, out_dev)
        final.set(13, lse_dev)
        merge.set(8, out_dev)
        merge.set(9, lse_dev)
        part(stream)
        final(stream)
        merge(stream)
        return self._results(kind, code, out, out_user, out_dev, lse, lse_user, lse_dev, return_lse)

    def _bound_launches(self, q_dev, kv_dev, out_dev, lse_dev):
        """(part, final, merge): the two persistent launches of C CTAs per KV head -- chunks
        of split tiles into float32 partial states, then unsplit tiles -- and the fixed-grid
        merge, bound once per configuration (every array but q, the cache, out and lse is
        a fixed view of the workspace)."""
        from . import prefill as P

        key = (self._spec, self._spec_part, self._slot_rows, self._q_shape, tuple(kv_dev.shape))
        hit = self._bound.get(key)
        if hit is not None:
            return hit
        code, H, D = self._code, self._num_qo_heads, self._head_dim
        rows_cap = 2 * self.num_ctas * self._slot_rows
        raw = {"q": lambda x: A.to_device(x, "q", 0, code),
               "kv": lambda x: A.to_device(x, "paged_kv_cache", 0, code),
               "out": lambda x: A.to_device(x, "out", 0, code),
               "lse": lambda x: A.to_device(x, "lse", 0, "f32")}
        q_raw, kv_raw, out_raw, lse_raw = raw["q"](q_dev), raw["kv"](kv_dev), raw["out"](out_dev), raw["lse"](lse_dev)
        po, pl = self._partials(self._slot_rows, H, D)
        tail = (self._view("row_pos"), self._view("row_kvoff"), self._view("row_req"), self._slopes,
                np.int32(self._page_size), np.int32(0))
        conv = {0: raw["q"], 1: raw["kv"], 2: raw["kv"], 12: raw["out"], 13: raw["lse"]}
        bound = []
        for spec, name, cap, o, l in (
                (self._spec_part, "part", 2 * self.num_ctas, po.reshape(rows_cap, H, D), pl.reshape(rows_cap, H)),
                (self._spec, "final", self.max_work_items, out_raw, lse_raw)):
            work = self._view(f"{name}_rows")[:8 * cap].reshape(cap, 8)
            args = (q_raw, kv_raw, kv_raw, self._view("kv_indices"), work, self._view(f"{name}_indptr"), *tail, o, l)
            bound.append(BoundLaunch(P.get_persistent_kernel(spec), (self.num_ctas, self._num_kv_heads),
                                     spec.threads, args, convert=conv))
        k, g, t, a = merge_tiles_launch(
            self._view("header")[H_NUM_MERGES:H_NUM_MERGES + 1], self._view("merge_indptr"),
            self._view("merge_request"), self._view("merge_qo_tile"), self._view("merge_slots"),
            self._view("qo_indptr"), po, pl, A.flat(out_raw), A.flat(lse_raw), code=code, head_dim=D,
            num_qo_heads=H, num_kv_heads=self._num_kv_heads, group=self._group, tile_q=self._plan.tile_q,
            slot_rows=self._slot_rows, num_ctas=self.num_ctas, per_request_row=False,
            use_sigmoid=self._variant.use_sigmoid)
        merge = BoundLaunch(k, g, t, a, convert={8: lambda x: A.flat(raw["out"](x)),
                                                  9: lambda x: A.flat(raw["lse"](x))})
        self._bound[key] = (bound[0], bound[1], merge)
        return self._bound[key]

    forward = run
