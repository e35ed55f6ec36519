"""Plan/run wrappers over a preallocated workspace (docs/concepts/scheduler.md), shaped like
FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` and
``BatchPrefillWithPagedKVCacheWrapper``: one import for both.

* :mod:`nbattn.cuda.plan_run`: what both share (the workspace and its layout, the
  staging of a plan, run()'s checks), and why plan and run are two steps;
* :mod:`nbattn.cuda.decode_wrapper`: the decode wrapper, fp8 caches included
  (``plan(kv_data_type=torch.float8_e4m3fn)``, ``run(k_scale=, v_scale=)``);
* :mod:`nbattn.cuda.prefill_wrapper`: the prefill wrapper.
"""
from __future__ import annotations

from .decode_wrapper import BatchDecodeWithPagedKVCacheWrapper, decode_plan_ctas
from .plan_run import PlanRunWrapper, WorkspaceLayout, default_num_ctas
from .prefill_wrapper import BatchPrefillWithPagedKVCacheWrapper

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
           "WorkspaceLayout", "default_num_ctas", "decode_plan_ctas", "PlanRunWrapper"]
