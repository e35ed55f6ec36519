"""The prefill plan/run wrapper (docs/concepts/scheduler.md), shaped like FlashInfer's
``BatchPrefillWithPagedKVCacheWrapper``, over the workspace of
:mod:`nbattn.cuda.plan_run`.

Prefill runs persistent launches of the plan's CTAs per KV head
(:func:`nbattn.cuda.prefill.persistent_entry`), CTA ``c`` walking its LPT
queue; a plan balances over as many CTAs per KV head as fill the GPU once
(:func:`prefill_plan_ctas`), at most the constructor's ``num_ctas``, and runs on a
grid of that many (or the plan's ``num_ctas`` where larger; every one of the
constructor's ``num_ctas`` with ``use_cuda_graph=True``), so a CUDA graph captured
after one plan replays any later plan of the configuration (not after a plan with a
custom mask or fp8 K/V, whose arrays are the plan's own).  The
queue is cut by output kind and run as two launches, first the
chunks of split tiles (float32 partial states), then the unsplit tiles (final
output): one kernel holding both bodies would need twice the static shared
memory, past 48 KB.  Each phase keeps the plan's per-CTA order but is balanced
only as a part of the whole queue.
"""
from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from numba import cuda

from .. import layout as L
from ..sched.plan import DIRECT, plan_lengths
from .blocks.variants import kernel_variant, user_state
from .fp8 import check_widened_range, launch_widen, page_values, plan_kv_code, run_scales
from .host import arrays as A
from .host import hostwork as HW
from .host.driver import BoundLaunch, sm_count
from .merge import merge_tiles_launch
from .plan_run import H_NUM_MERGES, PlanRunWrapper, data_code, plan_page_table
from .tuning import PREFILL, PrefillTuning, check_tuning

__all__ = ["BatchPrefillWithPagedKVCacheWrapper", "prefill_plan_ctas"]


def prefill_plan_ctas(num_kv_heads: int, capacity: int, tuning: PrefillTuning) -> int:
    """CTAs per KV head a prefill plan balances over: the persistent grid is
    (CTAs, KV heads), so ``tuning.plan_ctas_per_sm * SMs // num_kv_heads`` of them
    are resident at once (at most ``capacity``).  Planning for more only queues
    whole CTAs behind a first wave the planner does not see."""
    return max(1, min(capacity, tuning.plan_ctas_per_sm * sm_count() // max(1, num_kv_heads)))


class BatchPrefillWithPagedKVCacheWrapper(PlanRunWrapper):
    """Batch prefill/append over a paged KV cache with a planned KV split
    (docs/concepts/scheduler.md); kernels from :mod:`nbattn.cuda.prefill`.

    The planner's query tile comes from the package's one tile rule,
    :func:`nbattn.sched.tiles.choose_tile_q`, over the menu the built kernel
    offers: its ``T_q`` (fused rows, GQA heads fused).  Unsplit tiles write the final output directly; chunks of
    split tiles write float32 partial states that the merge kernel folds in
    KV order.  Every launch of :meth:`run` has a grid fixed per configuration;
    ``use_cuda_graph=True`` (FlashInfer's flag) makes it the constructor's
    ``num_ctas``, for graphs replayed after plans that pass a larger ``num_ctas``.
    """

    _decode = False

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             causal: bool = False, pos_encoding_mode: str = "NONE", sm_scale: float | None = None,
             window_left: int = -1, logits_soft_cap: float | None = None,
             q_data_type: Any = "float16", kv_data_type: Any = None, *, alpha: float = 1.0,
             beta: float = 1.0, chunk_overhead: float = 0.0, chunk_limit: int | str | None = None,
             tensor_cores: bool | None = None, tuning: PrefillTuning | None = None, cost=None,
             custom_mask=None, packed_custom_mask=None, num_ctas: int | None = None, **variant) -> None:
        """LPT-plan a prefill step (FlashInfer's arguments) and copy it into the workspace.

        The planner's cost and limit rule (``alpha``, ``beta``, ``chunk_overhead``,
        ``chunk_limit``) default to docs/concepts/scheduler.md exactly: the persistent prefill
        kernel's per-item price has not been measured.  ``cost`` (a
        :class:`nbattn.sched.cost.CostModel`; None: the numbers above) replaces them, as in the
        decode wrapper's ``plan()`` (``nbattn.sched.plan(cost=...)``); with a model whose
        ``search`` is ``"plans"``, ``chunk_limit="auto"`` ranks whole plans by its predicted makespan.
        ``custom_mask`` / ``packed_custom_mask`` (as :func:`nbattn.cuda.batch_prefill_paged`
        takes them) is a runtime mask for every run() of this plan: checked here with the
        golden model's rules, packed, and copied to the device once (a synchronous copy);
        the plan's tiles are then the CUDA-core teaching tile's.  The mask's arrays are
        the plan's own, not the workspace's: a CUDA graph captured on a masked plan is
        valid until the next plan().  ``tuning`` (a
        :class:`~nbattn.cuda.tuning.PrefillTuning`; None: ``PREFILL``) shapes the tiles every
        run() of this plan launches.  ``num_ctas`` (None: :func:`prefill_plan_ctas`, one
        wave) is how many CTAs per KV head the plan balances over, at most the constructor's.

        ``kv_data_type`` may name an fp8 dtype (``torch.float8_e4m3fn`` /
        ``torch.float8_e5m2``, or the names; ``q_data_type`` float16, bfloat16 or float32).
        Each run() then takes the fp8 cache with ``k_scale`` / ``v_scale`` and first widens
        the plan's pages, in page-table order, into a scratch cache of q's dtype with the
        scales applied (:func:`nbattn.cuda.fp8.launch_widen`), which the 16-bit tiles read
        (docs/concepts/layouts.md, "fp8 in the kernels").  The scratch (two bytes a value
        for 16-bit q, four for float32, over the plan's pages) and the page ids on the
        device belong to the plan, as a custom mask's arrays do: a CUDA graph captured on an
        fp8 plan is valid until the next plan()."""
        from . import prefill as P

        t0 = time.perf_counter()
        tuning = check_tuning(tuning, PrefillTuning, PREFILL)
        self._check_num_ctas(num_ctas)
        var = kernel_variant(dict(variant, causal=causal, pos_encoding_mode=pos_encoding_mode,
                            window_left=window_left, logits_soft_cap=logits_soft_cap,
                            sm_scale=sm_scale))
        fp8 = plan_kv_code(q_data_type, kv_data_type)
        code = data_code(q_data_type, None if fp8 else kv_data_type)
        hq, hk, D = int(num_qo_heads), int(num_kv_heads), int(head_dim_qk)
        group = L.check_heads(hq, hk)
        pkv, max_page = plan_page_table(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        qo = L.RaggedQ.validate(qo_indptr)
        if qo.batch_size != pkv.batch_size:
            raise L.LayoutError(f"paged_kv_indptr: has {pkv.batch_size} requests, qo_indptr has "
                                f"{qo.batch_size}")
        kv_lens = HW.kv_lengths(pkv.paged_kv_indptr, pkv.paged_kv_last_page_len, pkv.page_size)
        if var.causal:
            L.check_causal_lengths(qo.lengths, kv_lens)
        mask = P.mask_arrays(custom_mask, packed_custom_mask, qo.lengths, kv_lens, causal=var.causal)
        masked = mask is not None
        spec = P.make_spec("paged", self._kv_layout, code, D, hq, hk, var, tensor_cores, tuning=tuning,
                           custom_mask=masked)
        spec_part = P.make_spec("paged", self._kv_layout, code, D, hq, hk, var, spec.tensor_cores,
                                out_kind="f32", tuning=tuning, custom_mask=masked)
        tq = spec.tile_q        # choose_tile_q over the kernel's menu, its one T_q
        if qo.total and int(qo.lengths.max()) * group > L.INT32_MAX:
            raise L.LayoutError(f"qo_indptr: a request's {int(qo.lengths.max())} queries times the group "
                                f"({group}) must fit in int32")
        # Positions one tile spans: tq/group when tiles start on a position boundary.
        slot_rows = tq // group if tq % group == 0 else tq // group + 2
        ctas = prefill_plan_ctas(hk, self.num_ctas, tuning) if num_ctas is None else int(num_ctas)
        # the lengths are checked above (RaggedQ, the page table, the causal rule)
        p = plan_lengths(qo.lengths.astype(np.int64), kv_lens.astype(np.int64), ctas, tile_q=tq, group=group,
                         alpha=alpha, beta=beta, chunk_overhead=chunk_overhead, chunk_limit=chunk_limit,
                         causal=var.causal, cost=cost)
        self._check_bound(p)
        n_direct = int(np.count_nonzero(p.out_slot == DIRECT))
        self._check_fits(qo.batch_size, int(pkv.paged_kv_indices.size), n_direct, hq, D, slot_rows,
                         tq, qo.total)

        # Work rows in the plan's CTA-queue order, cut by output kind (two persistent
        # launches, see run()): the kernel's CTA c runs rows indptr[c]:indptr[c+1] of each.
        final_rows, part_rows, final_indptr, part_indptr = HW.prefill_rows(
            p.request, p.qo_tile, p.kv_start, p.kv_end, p.out_slot, p.cta_indptr, self.num_ctas, qo.qo_indptr,
            pkv.paged_kv_indptr, tq, group, slot_rows)
        row_pos, row_kvoff, row_req = P.request_rows(qo, kv_lens)

        indices = pkv.paged_kv_indices
        if fp8 is not None:     # the tiles read the widened pages, page j of the scratch cache
            indices = self._plan_widening(fp8, code, indices[:int(pkv.paged_kv_indptr[-1])], hk, D, page_size)
        else:
            self._widened = self._widen_pages = None
        stream = self._begin_plan()
        self._write_common(p, pkv.paged_kv_indptr, indices, pkv.paged_kv_last_page_len, stream)
        self._copy("final_rows", final_rows)
        self._copy("part_rows", part_rows)
        self._copy("final_indptr", final_indptr)
        self._copy("part_indptr", part_indptr)
        self._copy("qo_indptr", qo.qo_indptr)
        self._copy("row_pos", row_pos)
        self._copy("row_kvoff", row_kvoff)
        self._copy("row_req", row_req)
        self._flush(stream)
        self._slopes_for(hq, stream)
        # a custom mask lives in its own device arrays, new with every plan that has one
        self._mask = None if mask is None else tuple(cuda.to_device(np.ascontiguousarray(x)) for x in mask)
        self._grid_ctas = self._bound_grid(p.num_ctas, prefill_plan_ctas(hk, self.num_ctas, tuning))
        self._plan, self._variant, self._code, self._kv_code = p, var, code, fp8
        self._user_state = user_state(var)
        self._spec, self._spec_part, self._slot_rows = spec, spec_part, slot_rows
        self._num_qo_heads, self._num_kv_heads, self._group = hq, hk, group
        self._head_dim, self._page_size, self._total_q = D, int(page_size), qo.total
        self._max_page = max_page
        self._q_shape = (qo.total, hq, D)
        self.plan_seconds = time.perf_counter() - t0

    def _plan_widening(self, fp8: str, code: str, pages: np.ndarray, num_kv_heads: int, head_dim: int,
                       page_size: int) -> np.ndarray:
        """An fp8 plan's widening (run() widens the plan's pages, in page-table order, into a
        scratch cache of q's dtype): the page ids on the device and the scratch, kept while
        a later plan fits it; returns the page table the tiles read (``arange``)."""
        page = (2, page_size, num_kv_heads, head_dim) if self._kv_layout == "NHD" else (
            2, num_kv_heads, page_size, head_dim)
        page_values((1,) + page, "head_dim_qk", True)     # a page must be whole 32-bit words
        n = max(len(pages), 1)
        old = self._widened
        if old is None or old.shape[0] < n or old.shape[1:] != page or old.dtype != A.RAW[code]:
            self._widened = None                       # the old scratch goes before the new one comes
            self._widened = cuda.device_array((n,) + page, A.RAW[code])
        self._widen_pages = cuda.to_device(np.ascontiguousarray(pages, np.int32)) if len(pages) else None
        return np.arange(len(pages), dtype=np.int32)

    def _widen(self, cache, kv_dev, k_scale, v_scale, stream):
        """run()'s scales (None: 1.0; a plain plan refuses them), checked before anything
        launches; after an fp8 plan, the plan's pages of ``cache`` widened into the scratch."""
        fp8 = self._kv_code
        ks, vs = run_scales(fp8, cache, k_scale, v_scale)
        if fp8 is None:
            return kv_dev
        check_widened_range(fp8, self._code, ks, vs)
        if self._widen_pages is not None:
            per = math.prod(self._widened.shape[1:])        # values a page
            launch_widen(kv_dev, self._widen_pages, per, per // 2, fp8, self._code, ks, vs, self._widened, stream)
        return self._widened

    def run(self, q, paged_kv_cache, out=None, lse=None, return_lse: bool = False, *, k_scale=None,
            v_scale=None, sinks=None):
        """Attention of ragged ``q [total_q, num_qo_heads, head_dim]`` (rows as
        in plan()'s ``qo_indptr``) over the planned pages; returns ``o`` (and
        the base-2 ``lse``).  After an fp8 plan the cache has plan()'s fp8 dtype and
        ``k_scale`` / ``v_scale`` (floats, None: 1.0) are its scales, checked before
        anything launches (a scale that would overflow q's dtype is refused); a new scale
        needs no new plan.  A plain plan refuses them.

        As the decode wrapper's run(): only what can change between calls is
        checked, then three launches bound once per plan configuration run on
        torch's current stream (torch CUDA tensors in, torch tensors out).
        ``sinks [num_qo_heads]``: learnable sink logits, checked on the host and
        merged once after the kernels (:mod:`nbattn.cuda.sinks`: capturable in a CUDA
        graph after one run outside it)."""
        if sinks is not None:
            return self._run_with_sinks(sinks, q, paged_kv_cache, out, lse, return_lse, k_scale=k_scale,
                                        v_scale=v_scale)
        kind, code, stream, q_dev, kv_dev, kv_words, out_user, out_dev, lse_user, lse_dev = self._run_inputs(
            q, paged_kv_cache, out, lse, return_lse)
        if self._kv_code is not None or k_scale is not None or v_scale is not None:
            kv_dev = self._widen(paged_kv_cache, kv_dev, k_scale, v_scale, stream)
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

        key = (self._spec, self._spec_part, self._slot_rows, self._q_shape, tuple(kv_dev.shape), self._grid_ctas,
               None if self._mask is None else tuple(id(x) for x in self._mask))
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
            args = (q_raw, kv_raw, kv_raw, self._view("kv_indices"), work, self._view(f"{name}_indptr"), *tail, o, l,
                    *(self._mask or ()))
            bound.append(BoundLaunch(P.get_persistent_kernel(spec), (self._grid_ctas, self._num_kv_heads),
                                     spec.threads, args, convert=conv))
        k, g, t, a = merge_tiles_launch(
            self._view("header")[H_NUM_MERGES:H_NUM_MERGES + 1], self._view("merge_indptr"),
            self._view("merge_request"), self._view("merge_qo_tile"), self._view("merge_slots"),
            self._view("qo_indptr"), po, pl, A.flat(out_raw), A.flat(lse_raw), code=code, head_dim=D,
            num_qo_heads=H, num_kv_heads=self._num_kv_heads, group=self._group, tile_q=self._plan.tile_q,
            slot_rows=self._slot_rows, num_ctas=self._grid_ctas,
            use_sigmoid=self._variant.use_sigmoid)
        merge = BoundLaunch(k, g, t, a, convert={8: lambda x: A.flat(raw["out"](x)),
                                                  9: lambda x: A.flat(raw["lse"](x))})
        self._bound[key] = (bound[0], bound[1], merge)
        return self._bound[key]

    forward = run
