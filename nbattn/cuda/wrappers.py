"""Plan/run wrappers over a preallocated workspace (docs/concepts/scheduler.md), shaped like
FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` and
``BatchPrefillWithPagedKVCacheWrapper``: one import for both.

* :mod:`nbattn.cuda.plan_run`: what both share (the workspace and its layout, the
  staging of a plan, run()'s checks), and why plan and run are two steps;
* :mod:`nbattn.cuda.decode_wrapper`: the decode wrapper, and :mod:`nbattn.cuda.fp8_wrapper`,
  the same with fp8 caches (``kv_data_type=``, ``run(k_scale=, v_scale=)``), exported here;
* :mod:`nbattn.cuda.prefill_wrapper`: the prefill wrapper.
"""
from __future__ import annotations

from .decode_wrapper import decode_plan_ctas
from .fp8_wrapper import BatchDecodeWithPagedKVCacheWrapper      # the decode wrapper, fp8 caches included
from .plan_run import PlanRunWrapper, WorkspaceLayout, default_num_ctas
from .prefill_wrapper import BatchPrefillWithPagedKVCacheWrapper

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
           "WorkspaceLayout", "default_num_ctas", "decode_plan_ctas", "PlanRunWrapper"]
