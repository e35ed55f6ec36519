"""Scheduler: plan/run load balancing (docs/concepts/scheduler.md).

* :mod:`.plan`: the LPT planner and the :class:`Plan` it returns (per-CTA work
  queues and the reduction map of partial states).
* :mod:`.lpt`: LPT placement and the chunk-limit search the planner and the
  simulator share.
* :mod:`.tiles`: the query/KV tile-size heuristic.
* :mod:`.simulate`: a cost-model simulator comparing scheduling policies.

Plots of plans and simulations live in :mod:`nbattn.plots.sched`.
"""
from .plan import (
    DEFAULT_ALPHA,
    DEFAULT_BETA,
    DIRECT,
    Plan,
    check_partial_capacity,
    partial_buffer_bound,
    plan,
    plan_from_indptr,
    plan_lengths,
)
from .simulate import (
    POLICIES,
    WORKLOADS,
    CostModel,
    Schedule,
    SimResult,
    Workload,
    compare_policies,
    make_workload,
    simulate,
    simulate_plan,
)
from .tiles import (
    KV_TILES,
    QUERY_TILES,
    choose_tile_kv,
    choose_tile_q,
    choose_tiles,
    decode_tiles,
    resident_ctas,
    smem_bytes,
)

__all__ = [
    "DEFAULT_ALPHA", "DEFAULT_BETA", "DIRECT", "Plan", "check_partial_capacity",
    "partial_buffer_bound", "plan", "plan_from_indptr", "plan_lengths",
    "POLICIES", "WORKLOADS", "CostModel", "Schedule", "SimResult", "Workload",
    "compare_policies", "make_workload", "simulate", "simulate_plan",
    "KV_TILES", "QUERY_TILES", "choose_tile_kv", "choose_tile_q", "choose_tiles", "decode_tiles",
    "resident_ctas", "smem_bytes",
]
