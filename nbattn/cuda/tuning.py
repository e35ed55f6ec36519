"""Tuning kept as data: every performance switch of the kernels, in one place.

A kernel's *algorithm* (what it computes) lives in ``nbattn/cuda/kernels``; how it
is *shaped* for a GPU (warps per CTA, tile lengths, unroll factors, which path a
group size takes, whether a launch is programmatic) lives here, as frozen
dataclasses.  Each field says its default, why, and the result file that measured
it (``benchmarks/results/...``); a field with no result file is a limit, not a
measurement.

A switch enters a call through one argument, ``tuning=`` (as FlexAttention's
``kernel_options`` or FlashInfer's ``enable_pdl``)::

    from nbattn.cuda.tuning import DecodeTuning, DECODE
    out = nbattn.cuda.batch_decode_paged(..., tuning=DECODE.replace(path="warp"))

A tuning object is hashable and is part of every kernel-cache key, so two calls
with different tunings never share a compiled kernel.  Nothing here is changed
with ``setattr``: the dataclasses are frozen, and the module-level defaults
(:data:`DECODE`, :data:`MERGE`, :data:`PREFILL`, :data:`CASCADE`) are the ones
used when ``tuning`` is ``None``.  In numba's CUDA simulator the defaults are
smaller (one warp per CTA, the tile shapes a Python thread pool can run in
seconds), because every simulated thread is a Python thread.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .._compat import simulator_enabled

__all__ = ["DecodeTuning", "MergeTuning", "PrefillTuning", "CascadeTuning",
           "DECODE", "MERGE", "PREFILL", "CASCADE", "DECODE_PATHS", "PREFILL_POLICIES", "check_tuning"]

SIMULATOR = simulator_enabled()
DECODE_PATHS = ("auto", "warp", "smem", "tc")
PREFILL_POLICIES = ("rows", "keys")
STATIC_SMEM = 48 * 1024          # bytes of static shared memory a CTA may take without opting in


class _Tuning:
    """What every tuning dataclass shares: ``replace`` and the field checks."""

    def replace(self, **changes):
        """A copy with ``changes`` applied (``dataclasses.replace``), checked again."""
        return dataclasses.replace(self, **changes)

    def _nonneg(self, *names):
        for name in names:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{type(self).__name__}.{name} must be an int >= 0, got {v!r}")

    def _pair(self, name):
        v = getattr(self, name)
        if not (isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, int) and x > 0 for x in v)):
            raise ValueError(f"{type(self).__name__}.{name} must be a pair of ints > 0, got {v!r}")


@dataclass(frozen=True)
class MergeTuning(_Tuning):
    """How split-KV partial states are merged (``nbattn.cuda.kernels.merge``)."""

    #: Most partials per merge that the one-round form takes (two per lane of a warp).
    #: A limit of the form, not a measurement.
    few_partials: int = 64
    #: Whether a caller that knows its largest merge may pick the one-round form.
    #: GPU default on: batch 1 x 32k, the decode + merge call is fastest with it
    #: (benchmarks/results/decode_b1.json, case "merge").  Off in the simulator, where
    #: each shuffle costs two block barriers of Python threads.
    few_form: bool = not SIMULATOR
    #: Whether the one-round form is launched programmatically (it starts while the
    #: split decode that writes the partials runs, and waits for them).
    #: benchmarks/results/decode_b1.json, case "merge": "one_round_programmatic".
    few_programmatic: bool = not SIMULATOR
    def __post_init__(self):
        self._nonneg("few_partials")
        if self.few_partials > 64:
            raise ValueError(f"MergeTuning.few_partials must be <= 64 (two partials a lane), got {self.few_partials}")


@dataclass(frozen=True)
class DecodeTuning(_Tuning):
    """How the decode kernels are shaped (``nbattn.cuda.decode``)."""

    #: Which kernel runs: ``"auto"`` picks by dtype, head_dim, group and alignment;
    #: ``"smem"`` is the teaching kernel; ``"warp"`` and ``"tc"`` force a fast path
    #: (where it is not eligible, the call falls back to ``"smem"``).
    path: str = "auto"
    #: Static shared memory the teaching kernel may take (under the 48 KB default). A limit.
    smem_budget: int = 46 * 1024
    #: Query heads one CTA of the warp path holds (q and acc registers). 4 measured:
    #: benchmarks/results/experiments/decode_h200_2026-11-29.json, path "warp" (8 is
    #: opt-in and slower at group 8).
    warp_max_heads: int = 4
    #: Warps per CTA on the warp path. benchmarks/results/experiments/decode_h200_2026-11-29.json.
    warp_warps: int = 1 if SIMULATOR else 4
    #: Tokens per row per step on the warp path (0: chosen by heads per CTA).
    #: benchmarks/results/experiments/decode_h200_2026-11-29.json, field "unroll".
    warp_unroll: int = 0
    #: CTAs an SM the warp path's launch bounds ask for, which caps its registers a
    #: thread (0: 3 for CTAs of more than 4 heads, else 4; 4 caps at 128 registers).
    warp_min_blocks: int = 0
    #: Smallest GQA group that takes the tensor-core path on a GPU (0: never unless
    #: ``path="tc"``). benchmarks/results/decode.json, batch 64 x 4k-32k: group 8 on "tc"
    #: at 0.79-0.85 of copy bandwidth against 0.29-0.30 on "warp"; group 4 0.95-0.98
    #: against 0.54-0.56.
    tc_min_group: int = 4
    #: (warps a CTA, CTAs an SM) of the tensor-core path for CTAs of up to 4 heads: 168
    #: registers a thread (ptxas, sm_90) allow 12 warps an SM, and 6 x 2 gives batch 64 x 8 KV
    #: heads (512 CTAs) about two full waves. benchmarks/results/decode.json, path "tc".
    tc_shape: tuple = (6, 2)
    #: The same for CTAs of more than 4 heads (group 8: 256 CTAs, one wave either way):
    #: 4 x 3 at 0.97 of copy bandwidth against 0.83 for 6 x 2 at 4k (benchmarks/EXPERIMENTS.md).
    tc_shape_wide: tuple = (4, 3)
    #: (warps a CTA, CTAs an SM) of the tensor-core path for small batches that split
    #: into one wave. benchmarks/results/decode_b1.json, fields "warps", "min_blocks".
    tc_split_shape: tuple = (8, 1)
    #: Whether the one-wave split shape launches programmatically (FlashInfer's
    #: ``enable_pdl``). benchmarks/results/decode_b1.json, field "decode_programmatic".
    programmatic: bool = not SIMULATOR
    #: K/V steps of the first work item prefetched into L2 before the programmatic
    #: dependency wait, for CTAs of at most ``prefetch_max_heads`` heads.
    #: benchmarks/results/experiments/decode_b1_prefetch.json: 1 step is best for 4 heads,
    #: 0 for 8.
    prefetch_steps: int = 1
    prefetch_max_heads: int = 4
    #: The planner's fixed price of one decode work item, in KV tokens (``chunk_overhead``
    #: of ``nbattn.sched.plan``). Fitted on the H200 on 2026-11-29:
    #: benchmarks/results/experiments/sched_h200_2026-11-29.json, record "item_overhead_tokens"
    #: (63.7 warp path, 82.4 tensor-core path); benchmarks/results/cost_fit.json (2026-12-04)
    #: prices a tensor-core item at 3.7 us, 116 tokens, for plans made with ``cost=``.
    plan_chunk_overhead: float = 64.0
    #: Query heads one CTA of the warp path holds when the cache is fp8. A register
    #: limit, not a measurement: a lane holds 16 fp8 dims (one 16-byte load), so q and
    #: acc take 2 * heads * 16 floats, and 2 heads take what 4 take with fp16
    #: (benchmarks/gpu_fp8.py times it).
    fp8_warp_max_heads: int = 2
    #: How the split partials are merged.
    merge: MergeTuning = field(default_factory=lambda: MERGE)

    def __post_init__(self):
        if self.path not in DECODE_PATHS:
            raise ValueError(f"DecodeTuning.path must be one of {DECODE_PATHS}, got {self.path!r}")
        self._nonneg("smem_budget", "warp_max_heads", "warp_warps", "warp_unroll", "warp_min_blocks",
                     "tc_min_group", "prefetch_steps", "prefetch_max_heads", "fp8_warp_max_heads")
        if self.warp_warps < 1 or self.warp_max_heads < 1 or self.fp8_warp_max_heads < 1:
            raise ValueError("DecodeTuning.warp_warps, warp_max_heads and fp8_warp_max_heads must be >= 1")
        for name in ("tc_split_shape", "tc_shape", "tc_shape_wide"):
            self._pair(name)
        if not isinstance(self.merge, MergeTuning):
            raise TypeError(f"DecodeTuning.merge must be a MergeTuning, got {type(self.merge).__name__}")


@dataclass(frozen=True)
class PrefillTuning(_Tuning):
    """How the prefill tiles are shaped (``nbattn.cuda.prefill``)."""

    #: Lane grids (rows x columns of lanes in a warp) the CUDA-core tile may take:
    #: 4 x 8 (16 rows a warp) or 2 x 16 (half the O registers, a longer K/V tile).
    #: benchmarks/results/prefill_cuda_core.json.
    lane_grids: tuple = ((2, 4),) if SIMULATOR else ((4, 8), (2, 16))
    #: Query rows each lane holds. benchmarks/results/prefill_cuda_core.json.
    rows_per_lane: int = 4
    #: Shared memory a CUDA-core tile may take; past 48 KB the launch opts in to dynamic
    #: shared memory. 100 KB leaves room for two CTAs an SM (a limit; the simulator keeps
    #: to the static limit).
    smem_budget: int = (STATIC_SMEM - 1024) if SIMULATOR else 100 * 1024
    #: Longest K/V tile a shape may take (None: what fits ``smem_budget``).
    max_tile_k: int | None = None
    #: Which fitting CUDA-core shape wins: ``"rows"`` (most warps, then most keys a
    #: lane) or ``"keys"``. benchmarks/results/prefill_cuda_core.json.
    policy: str = "rows"
    #: Loop trips of the generated S and P V loops: (4-dim chunks, keys).
    #: benchmarks/results/prefill_cuda_core.json.
    unroll: tuple = (8, 4)
    #: Most 16-byte K (or V) chunks a thread prefetches into registers.
    #: benchmarks/results/prefill_cuda_core.json.
    prefetch_max_chunks: int = 4
    #: Whether the CUDA-core fast tile may be used (False: the teaching tile, the
    #: baseline its speed-up is measured against).
    cuda_core: bool = True
    #: Causal work items run longest first (fewer idle SMs at the end of the last wave).
    #: benchmarks/results/prefill_cuda_core.json.
    longest_first: bool = True
    #: Resident CTAs an SM the prefill wrapper plans for: its plan balances
    #: ``plan_ctas_per_sm * SMs // num_kv_heads`` queues per KV head, so that the
    #: persistent grid (queues x KV heads) is one wave.  2: the mixed steps of
    #: benchmarks/results/sched.json fit best with 264 resident slots on 132 SMs
    #: (``benchmarks/fit_cost.py --analyse``); gpu_sched.py records the launches' occupancy.
    plan_ctas_per_sm: int = 2

    def __post_init__(self):
        if self.policy not in PREFILL_POLICIES:
            raise ValueError(f"PrefillTuning.policy must be one of {PREFILL_POLICIES}, got {self.policy!r}")
        self._nonneg("rows_per_lane", "smem_budget", "prefetch_max_chunks")
        if not (isinstance(self.plan_ctas_per_sm, int) and self.plan_ctas_per_sm >= 1):
            raise ValueError(f"PrefillTuning.plan_ctas_per_sm must be an int >= 1, got {self.plan_ctas_per_sm!r}")
        if self.max_tile_k is not None:
            self._nonneg("max_tile_k")
        self._pair("unroll")
        if not (isinstance(self.lane_grids, tuple) and self.lane_grids
                and all(isinstance(g, tuple) and len(g) == 2 and all(isinstance(x, int) and x > 0 for x in g)
                        for g in self.lane_grids)):
            raise ValueError(f"PrefillTuning.lane_grids must be a tuple of (rows, cols) lane pairs, "
                             f"got {self.lane_grids!r}")


@dataclass(frozen=True)
class CascadeTuning(_Tuning):
    """How the cascade's levels are launched (``nbattn.cuda.cascade``)."""

    #: CTAs an SM each level kernel is built for (launch bounds). An unsplit level is
    #: latency-bound and wants no register cap. benchmarks/results/cascade.json.
    min_blocks: int = 2
    #: The same for a split level (a long shared prefix; compute-bound): a third CTA an
    #: SM, registers capped at 168. H200, batch 64 x prefix 32k: prefix pass 151 vs
    #: 173 us. benchmarks/results/cascade.json.
    min_blocks_split: int = 3
    #: Levels of single decode rows run as a batch decode (False: always the prefill tile).
    #: benchmarks/results/cascade.json.
    decode_levels: bool = True
    #: Fewest keys in a split chunk: below it a chunk's fixed cost (Q tile, first K load,
    #: one more state) dominates. A chosen floor, not swept.
    min_chunk: int = 256
    prefill: PrefillTuning = field(default_factory=lambda: PREFILL)
    decode: DecodeTuning = field(default_factory=lambda: DECODE)
    merge: MergeTuning = field(default_factory=lambda: MERGE)

    def __post_init__(self):
        self._nonneg("min_blocks", "min_blocks_split", "min_chunk")
        for name, cls in (("prefill", PrefillTuning), ("decode", DecodeTuning), ("merge", MergeTuning)):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"CascadeTuning.{name} must be a {cls.__name__}")


MERGE = MergeTuning()
DECODE = DecodeTuning()
PREFILL = PrefillTuning()
CASCADE = CascadeTuning()


def check_tuning(tuning, cls, default):
    """``tuning`` if it is a ``cls`` (``default`` when None); else a TypeError naming the argument."""
    if tuning is None:
        return default
    if not isinstance(tuning, cls):
        raise TypeError(f"tuning must be a nbattn.cuda.tuning.{cls.__name__} (or None), got {type(tuning).__name__}")
    return tuning
