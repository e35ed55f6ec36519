"""What both plan/run wrappers share (docs/concepts/scheduler.md): the workspace, its
layout, the staging of a plan, and the per-call checks of run().  The wrappers,
shaped like FlashInfer's, are :class:`nbattn.cuda.decode_wrapper.BatchDecodeWithPagedKVCacheWrapper`
and :class:`nbattn.cuda.prefill_wrapper.BatchPrefillWithPagedKVCacheWrapper`
(both importable from :mod:`nbattn.cuda.wrappers`).

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
* The attention kernels are persistent launches of ``num_ctas`` CTAs per KV
  head (block), CTA ``c`` walking its queue ``cta_indptr[c]:cta_indptr[c+1]``
  and reading the queue bounds from the workspace (the decode and prefill
  launches: the module docs of :mod:`nbattn.cuda.decode_wrapper` and
  :mod:`nbattn.cuda.prefill_wrapper`).
* Merge: a fixed grid whatever the plan (a plan has at most ``num_ctas``
  split tiles, since each has >= 2 of the <= 2*C partial slots); the number of
  merges is read from the workspace header, extra CTAs exit or take none.
  Prefill uses the tile merge (:func:`nbattn.cuda.merge.merge_tiles_launch`,
  ``num_ctas`` CTAs per KV head); decode the split-KV contraction
  (:func:`nbattn.cuda.merge.merge_partials_fixed_launch`).
  Slots are folded in the plan's order (increasing KV), never with atomics,
  so equal lengths give bitwise-equal outputs.

Every array handed to a kernel is a view of the workspace with a fixed shape
(its capacity), so a captured launch replays correctly after a new plan()
with different lengths, as long as the head configuration, dtype and batch
(decode) are unchanged and ``q``/``out`` are the same buffers.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np
from numba import cuda

from .. import layout as L
from .._checks import count_arg
from ..layout import INT32_MAX
from ..sched.plan import Plan
from ..variants import check_return_lse
from .blocks.primitives import SIMULATOR
from .blocks.variants import check_user_state
from .decode_problem import check_out
from .fp8 import check_run_dtypes, is_fp8
from .host import arrays as A
from .host import hostwork as HW
from .host.driver import data_ptr, sm_count, stream_handle, torch_stream
from .host.staging import HostToDevice

_FIRST = itemgetter(0)

__all__ = ["PlanRunWrapper", "WorkspaceLayout", "default_num_ctas", "data_code", "plan_page_table",
           "ALIGN", "HEADER", "H_NUM_ITEMS", "H_NUM_MERGES", "H_NUM_PARTIALS", "H_BATCH", "ELEM_BYTES"]

ALIGN = 256                 # byte alignment of every workspace array (16-byte loads need 16)
HEADER = 8                  # int32 header words
H_NUM_ITEMS, H_NUM_MERGES, H_NUM_PARTIALS, H_BATCH = 0, 1, 2, 3
ELEM_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "e4m3": 1, "e5m2": 1}
_Q_TYPES = {"float16": "f16", "half": "f16", "bfloat16": "bf16", "float32": "f32", "float": "f32",
            "f16": "f16", "bf16": "bf16", "f32": "f32"}


def default_num_ctas() -> int:
    """CTAs per KV head the workspace is built for when the caller does not say:
    one per SM (4 on the simulator).  A decode plan may use fewer (see
    :meth:`nbattn.cuda.decode_wrapper.BatchDecodeWithPagedKVCacheWrapper.plan`)."""
    return sm_count()


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


def data_code(q_data_type: Any, kv_data_type: Any) -> str:
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


def plan_page_table(indptr, indices, last_page_len, page_size) -> tuple:
    """plan()'s page table and its largest page id (-1 without pages); the cache is
    not known yet, so any page id fits (run() checks it against the largest)."""
    page_size = int(page_size)
    if page_size < 1:
        raise ValueError(f"page_size: must be >= 1, got {page_size}")
    return HW.checked_page_table(indptr, indices, last_page_len, page_size, INT32_MAX)


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

class PlanRunWrapper:
    """The workspace and the plan/run machinery both wrappers share (module doc)."""

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
        self._h2d_spare = None         # a second image, made when a plan finds the first still in flight
        self._ints_ptr = None
        self._host = self._h2d.host
        self._dirty: list = []         # (word offset, int32 array) pairs plan() staged
        self._plan: Plan | None = None
        self._kv_code = None           # the cache's fp8 code ("e4m3" / "e5m2") after an fp8 plan, else None
        self._slopes = None
        self._slopes_heads = 0
        self._bound: dict = {}          # bound launches of run(), by configuration
        self._bound_now = None          # the current plan's entry of _bound (reset by plan())
        self._run_seen = None           # what the last run() of this plan accepted (see _run_inputs)
        self._scratch_lse = None
        self._widened = self._widen_pages = None    # a prefill fp8 plan's scratch cache and page ids
        self._user_state = None         # the values a plan's score_mod / mask_mod read (blocks.variants.user_state)
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
        if self._h2d.in_flight():      # the two images take turns: no wait for the last plan's copies
            if self._h2d_spare is None:
                self._h2d_spare = HostToDevice(self.layout.plan_bytes // 4)
            self._h2d, self._h2d_spare = self._h2d_spare, self._h2d
            self._host = self._h2d.host
        self._h2d.begin()
        self._bound_now = None
        self._run_seen = None
        return 0 if SIMULATOR else stream_handle(self._ws_user)

    def _copy(self, name: str, host: np.ndarray) -> None:
        """Stage ``host`` (1-D, int32 values) at the front of array ``name``; :meth:`_flush` writes
        and sends it.  Kernels read each array only up to bounds the plan also writes
        (queue bounds, merge count), so stale entries past the front are never seen."""
        if type(host) is not np.ndarray or host.ndim != 1:
            host = np.asarray(host, dtype=np.int32).reshape(-1)
        self._dirty.append((self.layout.arrays[name][0] // 4, host))

    def _flush(self, stream) -> None:
        """Write the staged arrays into the pinned image and copy them to the workspace
        (:func:`nbattn.cuda.host.hostwork.stage_arrays`): arrays
        closer than 4096 words go in one copy, and the small ones sit together."""
        staged, self._dirty = self._dirty, []
        staged.sort(key=_FIRST)
        spans = HW.stage_arrays(self._host, [o for o, _ in staged], [a for _, a in staged], 4096)
        if self._ints_ptr is None and not SIMULATOR:
            self._ints_ptr = data_ptr(self._ints)
        for a, b in spans:
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

    def _check_num_ctas(self, num_ctas) -> None:
        """plan()'s ``num_ctas`` (None: the wrapper's own rule): an int in 1..the constructor's grid."""
        if num_ctas is not None and not (isinstance(num_ctas, (int, np.integer))
                                         and 1 <= int(num_ctas) <= self.num_ctas):
            raise ValueError(f"num_ctas: must be an int in 1..{self.num_ctas} (the constructor's grid), "
                             f"got {num_ctas!r}")

    def _bound_grid(self, plan_ctas: int, config_ctas: int) -> int:
        """CTAs per KV head (block) of the grid a plan runs on: the configuration's planner
        CTAs, or the plan's where more; every constructor CTA with ``use_cuda_graph``.
        Plans of one configuration thus share one bound grid, and a captured graph
        replays any of them."""
        return self.num_ctas if self._use_cuda_graph else max(int(plan_ctas), int(config_ctas))

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

    def _check_dtypes(self, q, cache) -> tuple[str, str]:
        """run()'s dtype checks: (q's element code, the cache's: plan()'s fp8 code after
        an fp8 plan, :func:`nbattn.cuda.fp8.check_run_dtypes`)."""
        if self._kv_code is not None or is_fp8(cache):
            return self._code, check_run_dtypes(q, cache, self._code, self._kv_code)
        code = A.dtype_code(q, "q")
        if code != self._code:
            raise L.LayoutError(f"q: dtype {L.dtype_of(q)} differs from plan()'s q_data_type ({self._code})")
        if A.dtype_code(cache, "paged_kv_cache") != code:
            raise L.LayoutError(f"paged_kv_cache: dtype must match q, got {L.dtype_of(cache)}")
        return code, code

    def _check_run(self, q, cache, out, lse):
        """The per-call checks of run(): (kind, dtype code, cache size in 32-bit words)."""
        kind = A.kind_of(q)
        code, kv_code = self._check_dtypes(q, cache)
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
                check_out(name, x, tuple(int(v) for v in want), c, kind)
                if kind == "torch" and x.device != q.device:
                    raise L.LayoutError(f"{name}: must be on q's device ({q.device}), got {x.device}")
        n = 1
        for v in cshape:
            n *= int(v)
        return kind, code, n * ELEM_BYTES[kv_code] // 4

    def _run_inputs(self, q, paged_kv_cache, out, lse, return_lse: bool):
        """What every run() does before it launches: the per-call checks (:meth:`_check_run`),
        q and the cache on the device (torch CUDA tensors as they are), the stream, and
        the outputs.  Returns (kind, code, stream, q_dev, kv_dev, out_user, out_dev,
        lse_user, lse_dev)."""
        self._need_plan()
        if self._user_state is not None:             # only a plan with score_mod / mask_mod
            check_user_state(self._variant, self._user_state)
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
        kv_dev = paged_kv_cache if dev else A.to_device(paged_kv_cache, "paged_kv_cache", 0, self._kv_code or code)
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

    def _run_with_sinks(self, sinks, q, paged_kv_cache, out, lse, return_lse: bool, **kwargs):
        """run() with learnable sinks: ``sinks [num_qo_heads]`` checked by the golden
        model's rules before anything launches (:func:`nbattn.cuda.sinks.checked_sinks`
        says when a CUDA tensor's values are read back), then the sink state merged
        into the result once (:mod:`nbattn.cuda.sinks`)."""
        from .sinks import apply_sinks, checked_sinks
        self._need_plan()
        checked = checked_sinks(sinks, q, self._variant, self._num_qo_heads)
        o, l = self.run(q, paged_kv_cache, out=out, lse=lse, return_lse=True, **kwargs)
        apply_sinks(o, l, checked)
        return (o, l) if return_lse else o

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
