"""The decode plan/run wrapper (docs/concepts/scheduler.md), shaped like FlashInfer's
``BatchDecodeWithPagedKVCacheWrapper``: plan() once per generation step, run()
once per layer, over the workspace of :mod:`nbattn.cuda.plan_run`.

Decode runs one persistent launch of G CTAs per KV-head block; CTA ``c`` walks
its queue ``cta_indptr[c]:cta_indptr[c+1]``
(:func:`nbattn.cuda.decode.run_decode_work`), reading the queue bounds from the
workspace; the merge is the split-KV contraction on a fixed grid of G CTAs
(:func:`nbattn.cuda.merge.merge_partials_fixed_launch`, an LPT plan: the merge
count is read on the device) or :func:`nbattn.cuda.merge.merge_partials_launch` sized
to the plan (a ``"split"`` plan; the one-round form where it fits).  For an
LPT plan G is the configuration's planner CTAs (:func:`decode_plan_ctas`, or the
plan's ``num_ctas`` where that is larger), so every plan of one configuration
runs on one bound grid; with ``use_cuda_graph=True`` G is the constructor's
``num_ctas``, the largest any plan may use.

fp8 caches (docs/concepts/layouts.md, "fp8 in the kernels"): ``plan(...,
kv_data_type=torch.float8_e4m3fn)`` (or ``float8_e5m2``, or their names; q stays
float16, bfloat16 or float32) builds the fp8 kernel configuration and plans the
work for its shape (path and heads a CTA); ``run(..., k_scale=, v_scale=)`` then
takes the fp8 cache, and sets the scales in the bound launch at every call, so a
new scale needs no new plan.  After a plain plan a scale or an fp8 cache is
refused, naming it.  The checks are :mod:`nbattn.cuda.fp8`'s.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
from numba import cuda

from .. import layout as L
from ..sched.plan import DIRECT, Plan, plan_lengths
from ..sched.tiles import decode_tiles
from .decode_problem import (DecodeProblem, check_head_dim, decode_arg_index, first_visible, launch_for, split_rule,
                             window_edge)
from .fp8 import plan_kv_code, run_scales
from .blocks.variants import cached_variant, user_state
from .host import arrays as A
from .host import hostwork as HW
from .host.driver import BoundLaunch, sm_count
from .kernels.decode_common import WorkList, make_config
from .merge import MergeMap, merge_partials_fixed_launch, merge_partials_launch
from .plan_run import H_NUM_MERGES, PlanRunWrapper, data_code, plan_page_table
from .tuning import DECODE, DecodeTuning, check_tuning

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "decode_plan_ctas"]


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


class BatchDecodeWithPagedKVCacheWrapper(PlanRunWrapper):
    """Batch decode (one query row per request) over a paged KV cache, planned
    once per step and run once per layer (docs/concepts/scheduler.md).

    >>> ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    >>> w = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    >>> w.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16)
    >>> for layer in range(32):
    ...     o = w.run(q[layer], kv_cache[layer])

    ``num_ctas`` bounds the planner's C per KV head; the decode kernel runs
    ``G * num_qo_heads // heads_per_cta`` CTAs (module doc: G is the
    configuration's planner CTAs, or ``num_ctas`` with ``use_cuda_graph=True``).
    A CUDA graph captured after one plan replays any later plan of the same
    configuration and batch made without ``num_ctas``; one that passes a larger
    ``num_ctas`` than the configuration's needs ``use_cuda_graph=True``.

    An fp8 cache: ``plan(..., q_data_type=torch.float16, kv_data_type=torch.float8_e4m3fn)``
    (or ``float8_e5m2``; head_dim a multiple of 16), then ``run(q, cache, k_scale=...,
    v_scale=...)`` (module doc).
    """

    _decode = True

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type: Any = "float16",
             kv_data_type: Any = None, sm_scale: float | None = None, *, alpha: float = 1.0,
             beta: float = 1.0, chunk_overhead: float | None = None,
             chunk_limit: int | str | None = "auto", num_ctas: int | None = None,
             schedule: str = "auto", tuning: DecodeTuning | None = None, cost=None, **variant) -> None:
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
          ``chunk_overhead + alpha*l_q + beta*l_kv`` (``chunk_overhead`` None:
          ``tuning.plan_chunk_overhead``) and ``chunk_limit`` its limit rule
          (``None``: ``ceil(W/C)``).
        * ``"split"``: every request is cut into the same number of equal
          chunks, as many as fill one wave of the small-batch kernel shape,
          merged by the one-round merge; both kernels launch programmatically.
          This is the standalone decode's split for small batches.
        * ``"auto"`` (default): ``"split"`` where the batch alone leaves the SMs
          idle (the small-batch kernel shape applies) and the split cuts every
          request in two or more, else ``"lpt"``.  The choice depends on the batch
          and the configuration, not on the lengths, so a CUDA graph captured after
          one plan replays the next plans of the batch.

        ``cost`` (an ``"lpt"`` plan; a :class:`nbattn.sched.cost.CostModel`, e.g. a GPU
        fit's ``load_cost_fit(path).for_path("tc")``; None: the numbers above) is the
        planner's cost model (``nbattn.sched.plan(cost=...)``).

        ``tuning`` (a :class:`~nbattn.cuda.tuning.DecodeTuning`; None: ``DECODE``) shapes
        the kernels every run() of this plan launches.

        ``kv_data_type`` may name an fp8 dtype (``torch.float8_e4m3fn`` /
        ``torch.float8_e5m2``, or the names), with ``q_data_type`` float16, bfloat16 or
        float32: the plan is then for the fp8 kernel (module doc).

        Raises before touching the workspace when the plan would not fit it.
        """
        t0 = time.perf_counter()
        tuning = check_tuning(tuning, DecodeTuning, DECODE)
        var = cached_variant(dict(variant, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                                  logits_soft_cap=logits_soft_cap, sm_scale=sm_scale))
        fp8 = plan_kv_code(q_data_type, kv_data_type)
        code = data_code(q_data_type, None if fp8 else kv_data_type)
        group = L.check_heads(int(num_qo_heads), int(num_kv_heads))
        check_head_dim(int(head_dim), fp8)
        if schedule not in ("auto", "lpt", "split"):
            raise ValueError(f"schedule: must be 'auto', 'lpt' or 'split', got {schedule!r}")
        pkv, max_page = plan_page_table(indptr, indices, last_page_len, page_size)
        batch = pkv.batch_size
        kv_lens = HW.kv_lengths(pkv.paged_kv_indptr, pkv.paged_kv_last_page_len, pkv.page_size)
        hq, hk, D = int(num_qo_heads), int(num_kv_heads), int(head_dim)
        cfg = make_config(code, D, group, self._kv_layout, var, True, batch * hk, tuning, fp8)
        small = cfg.path == "tc" and cfg.min_blocks == 1          # the one-wave small-batch shape
        mode = schedule
        if schedule == "auto":      # batch and configuration only: a captured graph replays re-plans
            cuts = small and batch <= self.num_ctas and self._split_count(batch, hq // cfg.heads_per_cta, cfg) > 1
            mode = "split" if cuts else "lpt"
        if mode == "split" and batch > self.num_ctas:
            raise ValueError(f"schedule: 'split' runs one work item per CTA of the constructor's grid, "
                             f"so batch ({batch}) must be at most num_ctas ({self.num_ctas})")
        self._check_num_ctas(num_ctas)
        if mode == "lpt" and small:       # the persistent grid runs the batch-independent shape
            cfg = make_config(code, D, group, self._kv_layout, var, tuning=tuning)
        # a sliding window's hidden keys are planned out: plan the keys from the first visible one
        edge = window_edge(var)
        first = first_visible(kv_lens, edge, split_rule(cfg, batch, hq)[2]) if edge >= 0 else None
        seen = kv_lens.astype(np.int64) if first is None else kv_lens - first
        if mode == "split":
            p = self._split_plan(seen, batch, hq // cfg.heads_per_cta, cfg)
        else:
            if num_ctas is None:
                num_ctas = decode_plan_ctas(cfg, hq, self.num_ctas)
            # One query tile per request: its `group` fused rows are one decode CTA's heads.
            overhead = tuning.plan_chunk_overhead if chunk_overhead is None else chunk_overhead
            # The lengths come from the page table checked above: int64, non-negative, < 2**31.
            qo_lens = np.ones(batch, np.int64)
            p = plan_lengths(qo_lens, seen, int(num_ctas), tile_q=decode_tiles(group)[0], group=group,
                             alpha=alpha, beta=beta, chunk_overhead=overhead, chunk_limit=chunk_limit,
                             cost=cost)
            self._check_bound(p)
        if first is not None and first.any():
            at = first[p.request].astype(np.int32)
            p = dataclasses.replace(p, kv_lens=kv_lens.astype(np.int32), kv_start=p.kv_start + at,
                                    kv_end=p.kv_end + at)
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
        self._user_state = user_state(var)
        self._kv_code, self._sm_scale = fp8, var.scale(D)
        self._num_qo_heads, self._num_kv_heads, self._group = hq, hk, group
        self._head_dim, self._page_size, self._batch = D, int(page_size), batch
        self._kv_lens = kv_lens
        self._max_page = max_page
        self._q_shape = (batch, hq, D)
        self._grid_ctas = self._bound_grid(p.num_ctas, decode_plan_ctas(cfg, hq, self.num_ctas))
        self._bound_key = (cfg, mode, p.num_ctas if mode == "split" else self._grid_ctas, batch, hq,
                           p.num_partials if mode == "split" else -1)
        self.plan_seconds = time.perf_counter() - t0

    def _split_count(self, batch: int, head_blocks: int, cfg) -> int:
        """Chunks a request of a ``"split"`` plan: as many as fill one wave of the
        small-batch shape (at most the one-round merge's partials)."""
        slots = cfg.min_blocks * sm_count()
        return max(1, min(slots // max(batch * head_blocks, 1), self.num_ctas // max(batch, 1),
                          cfg.tuning.merge.few_partials))

    def _split_plan(self, kv_lens: np.ndarray, batch: int, head_blocks: int, cfg) -> Plan:
        """Every request in ``splits`` chunks (one wave of the small-batch shape), the
        chunk a multiple of 16 keys; chunk j of request r writes slot ``r*splits + j``
        (empty chunks past a short request's end write an empty state).  The number of
        items depends on the batch and heads only, so a captured graph replays after a
        re-plan with other lengths."""
        splits = self._split_count(batch, head_blocks, cfg)
        request, start, end, largest = HW.split_plan(kv_lens.astype(np.int32), splits)
        n = batch * splits
        direct = splits == 1
        cost = (end - start).astype(np.float64)
        span = float(cost.max(initial=0.0))
        steps = np.arange(n + 1, dtype=np.int32)
        merge_indptr = steps[::splits] if not direct else steps[:1]
        return Plan.of(num_ctas=n, tile_q=1, group=1, chunk_limit=int(largest), alpha=0.0, beta=1.0,
                    chunk_overhead=0.0, causal=False, qo_lens=np.ones(batch, np.int32),
                    kv_lens=kv_lens.astype(np.int32), cta_indptr=steps, request=request,
                    qo_tile=np.zeros(n, np.int32), kv_start=start, kv_end=end,
                    out_slot=np.full(n, DIRECT, np.int32) if direct else steps[:n],
                    merge_indptr=merge_indptr, merge_request=steps[:0 if direct else batch],
                    merge_qo_tile=np.zeros(0 if direct else batch, np.int32),
                    merge_slots=steps[:0 if direct else n],
                    num_partials=0 if direct else n, cta_cost=cost, makespan=span, lower_bound=span,
                    placement="request", cost_model=None, predicted_makespan=float("nan"))

    # -- run ------------------------------------------------------------------
    def run(self, q, paged_kv_cache, out=None, lse=None, return_lse: bool = False, *, k_scale=None,
            v_scale=None, sinks=None):
        """Attention of ``q [batch, num_qo_heads, head_dim]`` against the planned
        pages of ``paged_kv_cache``; returns ``o`` (and the base-2 ``lse``).

        Checks only what can change between calls (shapes, dtypes and devices of
        ``q``, the cache, ``out`` and ``lse``) and launches the kernels bound at
        the first run of this plan's configuration; with torch CUDA tensors it
        launches on torch's current stream and returns torch tensors.  After an fp8
        plan the cache has plan()'s fp8 dtype and ``k_scale`` / ``v_scale`` (floats,
        None: 1.0) are its scales; a plain plan refuses them.  ``sinks
        [num_qo_heads]``: learnable sink logits, checked on the host and merged
        once after the kernels (:mod:`nbattn.cuda.sinks`: capturable in a CUDA graph
        after one run outside it)."""
        if sinks is not None:
            return self._run_with_sinks(sinks, q, paged_kv_cache, out, lse, return_lse, k_scale=k_scale,
                                        v_scale=v_scale)
        kind, code, stream, q_dev, kv_dev, kv_words, out_user, out_dev, lse_user, lse_dev = self._run_inputs(
            q, paged_kv_cache, out, lse, return_lse)
        fp8 = self._kv_code is not None or k_scale is not None or v_scale is not None     # the fp16 path's one check
        if fp8:
            ks, vs = run_scales(self._kv_code, paged_kv_cache, k_scale, v_scale)
        bound = self._bound_now               # this plan's launches, found once (not hashed per call)
        if bound is None:
            bound = self._bound_now = self._bound_launches(q_dev, kv_dev)
        dec, merge, ix = bound
        dec.set(ix["q"], q_dev)
        dec.set(ix["kv"], kv_dev, kv_words)
        dec.set(ix["out"], out_dev)
        dec.set(ix["lse"], lse_dev)
        if fp8:
            dec.set_scalar(ix["sm_scale"], self._sm_scale * ks)       # k_scale joins the score scale
            dec.set_scalar(ix["v_scale"], vs)
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
        var, kvc = self._variant, self._kv_code or code
        q_w, kv_w = A.words(A.to_device(q_dev, "q", 0, code)), A.words(A.to_device(kv_dev, "paged_kv_cache", 0, kvc))
        out0 = cuda.device_array((self._batch, hq, D), A.RAW[code])
        lse0 = cuda.device_array((self._batch, hq), np.float32)
        prob = DecodeProblem(code, "numba", 0, var, var.scale(D), self._batch, hq, self._num_kv_heads, D,
                             self._page_size, self._kv_layout, self._kv_lens, q_w, kv_w,
                             self._view("kv_indptr"), self._view("kv_indices"), self._view("kv_last"),
                             self._slopes, out0, out0, lse0, lse0, True, cfg.tuning, self._kv_code)
        work = WorkList(self._view("cta_indptr"), self._view("request"), self._view("kv_start"),
                        self._view("kv_end"), self._view("out_slot"))
        po, pl = self._partials(1, hq, D)
        split = self._mode == "split"
        # the persistent grid: a "split" plan's items, one per CTA; an "lpt" plan's bound grid
        grid_ctas = self._plan.num_ctas if split else self._grid_ctas
        work = work._replace(cta_indptr=self._view("cta_indptr")[:grid_ctas + 1])
        pdl = split and cfg.tuning.programmatic     # a "split" plan launches programmatically
        kern, grid, threads, args = launch_for(prob, cfg, work, po, pl, prefetch=pdl)
        ix = decode_arg_index(cfg)
        conv = {ix["q"]: lambda x: A.words(A.to_device(x, "q", 0, code)),
                ix["kv"]: lambda x: A.words(A.to_device(x, "paged_kv_cache", 0, kvc)),
                ix["out"]: lambda x: A.flat(A.to_device(x, "out", 0, code)),
                ix["lse"]: lambda x: A.flat(A.to_device(x, "lse", 0, "f32"))}
        dec = BoundLaunch(kern, grid, threads, args, convert=conv,
                          programmatic=pdl and cfg.path == "tc")
        merge = None
        if split and self._plan.num_partials:
            B = self._batch
            mmap = MergeMap(self._view("merge_indptr")[:B + 1], self._view("merge_request")[:B],
                            self._view("merge_slots")[:self._plan.num_partials])
            k, g, t, a = merge_partials_launch(po.reshape(2 * self.num_ctas, hq, D), pl.reshape(2 * self.num_ctas, hq),
                                               mmap, out0, lse0, code=code, use_sigmoid=var.use_sigmoid,
                                               max_partials=self._plan.num_partials // B, tuning=cfg.tuning.merge)
            ix = dict(ix, merge_out=5, merge_lse=6)
        else:       # an LPT plan: the split-KV contraction on the fixed grid
            mmap = MergeMap(self._view("merge_indptr"), self._view("merge_request"), self._view("merge_slots"))
            k, g, t, a = merge_partials_fixed_launch(
                self._view("header")[H_NUM_MERGES:H_NUM_MERGES + 1], po.reshape(2 * self.num_ctas, hq, D),
                pl.reshape(2 * self.num_ctas, hq), mmap, A.flat(out0), A.flat(lse0), code=code,
                num_ctas=grid_ctas, use_sigmoid=var.use_sigmoid)
            ix = dict(ix, merge_out=6, merge_lse=7)
        if split and not self._plan.num_partials:
            merge = None
        else:
            mconv = {ix["merge_out"]: conv[ix["out"]], ix["merge_lse"]: conv[ix["lse"]]}
            merge = BoundLaunch(k, g, t, a, convert=mconv)
        self._bound[key] = (dec, merge, ix)
        return self._bound[key]
