# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · The scheduler, part 1: planning
#
# **What you will learn**
#
# 1. The tile heuristic: how a batch picks its query tile (`nbattn.sched.choose_tile_q`).
# 2. The LPT planner (`nbattn.sched.plan`): cut each query tile's KV range into chunks of at
#    most `L` keys, then hand the largest chunks first to the least-loaded CTA.
# 3. The **reduction map**: which partial states are merged, in which fixed order.
# 4. Running a plan with the golden model, and why a fixed order makes the output bitwise
#    reproducible (no atomics).
# 5. Gantt charts of three policies — one request per CTA, FlashDecoding's fixed split, and
#    LPT — under the simulator's cost model (`nbattn.sched.simulate`), against the makespan
#    lower bound, and the bound on the partial-state buffer.
#
# Everything here runs on the CPU. Part 2 (`06_scheduler_on_the_gpu`) runs plans on the
# device, replays them in CUDA graphs, and compares the policies as the GPU measured them,
# which is not always what the model predicts.

# %% [markdown]
# The next cell says where the kernels run: numba's CUDA simulator without a GPU (tiny shapes,
# every GPU thread a Python thread), or the GPU. On a GPU, numba may print
# `NumbaPerformanceWarning: Grid size N will likely result in GPU under-utilization due to low
# occupancy` under some cells. The shapes here are small on purpose, so a kernel launches only a
# few CTAs and leaves most multiprocessors idle: the warning is about speed, not correctness, and
# the results are checked all the same.

# %%
import numpy as np
import nbattn
SMALL = nbattn.simulator_enabled()   # True on a laptop without a GPU: keep shapes small
TOL = 1e-5 if SMALL else 2e-4        # kernel vs golden model, float32 (GPUs use a fast exp2)
print(f"backend: {nbattn.BACKEND}  (small shapes: {SMALL})")

import tempfile
from pathlib import Path
import matplotlib.pyplot as plt
from IPython.display import Image, display
from nbattn import sched
from nbattn.plots import sched as sched_plots
from nbattn import reference as ref

FIGS = Path(tempfile.mkdtemp(prefix="nbattn-05-"))   # figures are written here, then shown
def show(fig_fn, *args, name="fig.png", **kw):
    fig_fn(*args, FIGS / name, **kw)
    display(Image(filename=str(FIGS / name)))


# %% [markdown]
# ## 1. Choosing the query tile
#
# A kernel processes a *query tile* of rows against a stream of KV tiles. With GQA the
# `group` query heads that share a KV head are fused into rows, so a decode request
# already has `group` rows. The heuristic picks the smallest tile in
# `{1, 16, 32, 64, 128}` that is at least the batch's average `l_qo * group`.
# Tile 1 is the CUDA-core decode path.

# %%
for qo_lens, group in [([1] * 8, 1), ([1] * 8, 4), ([3, 1, 4], 1), ([100, 300], 1), ([512] * 2, 8)]:
    print(f"l_qo = {qo_lens!s:22s} group {group}: tile_q = {sched.choose_tile_q(qo_lens, group)}")

# %% [markdown]
# ## 2. A plan, by hand and by the planner
#
# Four decode requests with KV lengths 700, 100, 120, 80 on `C = 4` CTAs, `tile_q = 1`.
# Total work `W = Σ_r ceil(l_qo/T_q)·l_kv = 1000` key-rows, so the chunk limit is
# `L = ceil(W / C) = 250`. Request 0 is cut into chunks of 250, 250 and 200 keys; the
# others fit in one chunk. Every chunk costs `alpha·l_q + beta·l_kv` (both 1 by default).
# Largest first, each to the least-loaded CTA:

# %%
p = sched.plan([1, 1, 1, 1], [700, 100, 120, 80], num_ctas=4)
print(f"tile_q={p.tile_q}  chunk limit L={p.chunk_limit}  items={p.num_items}  "
      f"partials={p.num_partials}  merges={p.num_merges}")
cost = p.item_cost()
for c in range(p.num_ctas):
    items = range(p.cta_indptr[c], p.cta_indptr[c + 1])
    queue = ", ".join(f"r{p.request[i]}[{p.kv_start[i]},{p.kv_end[i]})"
                      + (f"->slot {p.out_slot[i]}" if p.out_slot[i] != sched.DIRECT else "->out")
                      for i in items)
    print(f"CTA {c}: load {p.cta_cost[c]:5.0f}  {queue}")
print(f"makespan {p.makespan:.0f}, lower bound {p.lower_bound:.1f}")

# %% [markdown]
# The `->out` items are unsplit tiles: they write the final output directly. Split tiles
# write **partial states** into slots; the reduction map lists, per split tile, its slots
# in increasing `kv_start` order:

# %%
for m in range(p.num_merges):
    slots = p.merge_slots[p.merge_indptr[m]:p.merge_indptr[m + 1]]
    print(f"output of request {p.merge_request[m]}, tile {p.merge_qo_tile[m]} = merge of slots {slots.tolist()}")
show(sched_plots.reduction_map, p, name="reduction_map.png")

# %% [markdown]
# ### Exercise 1 — the chunk limit
#
# For the three-request batch of notebook 02 (query lengths `[3, 1, 4]`, KV lengths `[6, 2, 9]`) with
# `tile_q = 16` and `C = 4` CTAs, compute the planner's chunk limit `L` from its formula
# `W = Σ_r ceil(l_qo[r] / T_q) · l_kv[r]`, `L = max(1, ceil(W / C))`.

# %% tags=["exercise"]
L_mine = None   # your code here

# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
qo, kv, T_q, C = np.array([3, 1, 4]), np.array([6, 2, 9]), 16, 4
W = int(np.sum(-(-qo // T_q) * kv))
L_mine = max(1, -(-W // C))

# %% tags=["check"]
p4 = sched.plan([3, 1, 4], [6, 2, 9], num_ctas=4, tile_q=16)
assert L_mine == p4.chunk_limit, f"you said {L_mine}, the planner uses {p4.chunk_limit}"
print("✓ L =", L_mine)

# %% [markdown]
# ### Exercise 2 — LPT yourself
#
# Below are the planner's chunks in their stable order (request, tile, chunk) with their
# costs. Write `lpt(costs, C)` returning the final load of every CTA: sort by cost, largest
# first (ties keep the given order), and give each chunk to the least-loaded CTA, the
# lowest id among equals (a min-heap of `(load, cta)`). Your loads must equal the
# planner's `cta_cost` exactly.

# %%
wl = sched.make_workload("variable", batch=12, seed=1)
big = sched.plan(wl.qo_lens, wl.kv_lens, num_ctas=16)
order = np.lexsort((big.kv_start, big.qo_tile, big.request))   # (request, tile, chunk) order
chunk_costs = big.item_cost()[order]
print(len(chunk_costs), "chunks; first costs:", chunk_costs[:6])


# %% tags=["exercise"]
def lpt(costs, C):
    # your code here: return an array of C loads
    raise NotImplementedError


# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
import heapq

def lpt(costs, C):
    heap = [(0.0, c) for c in range(C)]
    loads = np.zeros(C)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):   # stable: ties keep order
        load, c = heapq.heappop(heap)
        loads[c] = load + costs[i]
        heapq.heappush(heap, (loads[c], c))
    return loads


# %% tags=["check"]
mine = np.asarray(lpt(chunk_costs, big.num_ctas))
np.testing.assert_array_equal(mine, big.cta_cost)
bound = max(chunk_costs.sum() / big.num_ctas, chunk_costs.max())
print(f"✓ same loads as the planner; makespan {mine.max():.0f} vs bound max(Σt/C, max t) = {bound:.1f}")

# %% [markdown]
# ## 3. Running a plan (with the golden model)
#
# The *run* step is a fixed grid of `C` CTAs. CTA `c` walks its queue; each item attends
# its query tile to keys `[kv_start, kv_end)` and writes either the output or a partial
# slot. A second pass merges each split tile's slots in the reduction map's order.
# Here is that executor in NumPy, with `nbattn.reference.attend` standing in for a CTA
# (MHA, `group = 1`, so a tile's rows are query positions and every head rides along):

# %%
from nbattn.variants import Variant

def run_plan(p, q, ks, vs):
    """q: [batch, H, D] (decode); ks/vs: per request [kv_len, H, D]."""
    out = np.zeros_like(q)
    part_o = np.zeros((p.num_partials,) + q.shape[1:], q.dtype)
    part_lse = np.full((p.num_partials, q.shape[1]), -np.inf, q.dtype)
    var = Variant()                                    # plain softmax attention
    for c in range(p.num_ctas):                        # every CTA, in any order
        for i in range(p.cta_indptr[c], p.cta_indptr[c + 1]):
            r, a, b = p.request[i], p.kv_start[i], p.kv_end[i]
            st = ref.attend(q[r:r + 1], ks[r][a:b], vs[r][a:b], np.array([ks[r].shape[0] - 1]),
                            np.arange(a, b), var)
            if p.out_slot[i] == sched.DIRECT:
                out[r] = st.o[0]
            else:
                part_o[p.out_slot[i]], part_lse[p.out_slot[i]] = st.o[0], st.lse[0]
    for m in range(p.num_merges):                      # the reduction map, in its fixed order
        s = p.merge_slots[p.merge_indptr[m]:p.merge_indptr[m + 1]]
        o, _ = ref.merge_states(part_o[s][None], part_lse[s][None])
        out[p.merge_request[m]] = o[0]
    return out


# %%
rng = np.random.default_rng(0)
batch, H, D = (6, 2, 16) if SMALL else (32, 8, 64)
kv_lens = rng.integers(1, 400, size=batch)
kv_lens[0] = 3000                                      # one long request: it will be split
q = rng.normal(size=(batch, H, D)).astype(np.float32)
ks = [rng.normal(size=(n, H, D)).astype(np.float32) for n in kv_lens]
vs = [rng.normal(size=(n, H, D)).astype(np.float32) for n in kv_lens]

p_run = sched.plan(np.ones(batch, int), kv_lens, num_ctas=8)
o_plan = run_plan(p_run, q, ks, vs)
o_ref = np.stack([ref.single_decode(q[r], ks[r], vs[r]) for r in range(batch)])
print(f"{p_run.num_partials} partials, {p_run.num_merges} merged tiles; "
      f"max |plan - golden| = {np.abs(o_plan - o_ref).max():.2e}")
np.testing.assert_allclose(o_plan, o_ref, atol=1e-5, rtol=1e-5)       # float32 partials merged

# %% [markdown]
# ### Exercise 3 — determinism
#
# Same lengths in, bitwise-same output out. Check it: plan the step twice and run both,
# and compare the runs **bitwise** (`np.array_equal`). Then plan with a different `C`
# (the split points move) and measure how far the result drifts. Set `same` to the bitwise
# comparison and `drift` to the max absolute difference.

# %% tags=["exercise"]
same, drift = None, None   # your code here

# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
again = run_plan(sched.plan(np.ones(batch, int), kv_lens, num_ctas=8), q, ks, vs)
same = np.array_equal(o_plan, again)
other = run_plan(sched.plan(np.ones(batch, int), kv_lens, num_ctas=5), q, ks, vs)
drift = float(np.abs(other - o_plan).max())

# %% tags=["check"]
assert same is True or same == np.True_, "two runs of the same plan must agree bitwise"
p_a = sched.plan(np.ones(batch, int), kv_lens, num_ctas=8)
for field in ("cta_indptr", "request", "kv_start", "kv_end", "out_slot", "merge_slots"):
    assert np.array_equal(getattr(p_a, field), getattr(p_run, field)), field
assert 0 <= drift < 1e-5, "another C changes the order, so only rounding may differ"
print(f"✓ bitwise reproducible for one plan; another C drifts by {drift:.1e} (float32 rounding)")

# %% [markdown]
# ## 4. Policies compared: Gantt charts (simulated)
#
# The simulator places chunks on CTAs under a cost model
# (`chunk_overhead + alpha·l_q + beta·l_kv`, plus a merge pass) and reports the makespan,
# the utilization and a lower bound that no policy can beat. The skewed step — one long
# request among short ones — is where balancing matters: with one request per CTA, the
# long request's CTA works alone while the others idle. (FlashDecoding's fixed split only
# splits when there are fewer tiles than CTAs: here 24 tiles ≥ 16 CTAs, so it does nothing.)

# %%
C = 16
wl = sched.make_workload("skewed", batch=24, long_len=8192 if not SMALL else 4096, short_len=512)
results = {pol: sched.simulate(wl.qo_lens, wl.kv_lens, C, pol, workload=wl.name)
           for pol in sched.POLICIES}
for pol, res in results.items():
    print(f"{pol:12s} makespan {res.makespan:7.0f}  utilization {res.utilization:.2f}  "
          f"makespan/bound {res.makespan_over_bound:.2f}  partials {res.num_partials}")

# %%
show(sched_plots.gantt, results["one_per_cta"], name="gantt_one.png")
show(sched_plots.gantt, results["lpt"], name="gantt_lpt.png")

# %%
workloads = [sched.make_workload(name, batch=32, seed=0) for name in sched.WORKLOADS]
show(sched_plots.policy_utilization, sched.compare_policies(workloads, 32), name="policies.png")

# %% [markdown]
# ### The price of a work item
#
# The planner cuts chunks at `L = ceil(W / C)`. That is perfect when a chunk costs only
# its keys, but on a GPU every work item also pays a fixed price (reading its queue entry,
# filling the load pipeline, writing its state): about 64-116 KV tokens' worth for nbattn's
# decode kernel on an H200 (`item_overhead_tokens` of the 2026-11-29 sweep in
# `benchmarks/results/experiments/`; 3.7 us in `cost_fit.json`, 2026-12-04). Equal lengths show
# the trap: with one CTA more than requests, `L` falls just short of a request, so every
# request leaves a short tail, and the spare CTA runs all the tails. `chunk_overhead` puts
# the price into the cost; `chunk_limit="auto"` also tries "no split" and the longest
# request cut in 2-4, and keeps the plan with the smallest makespan. The decode wrapper
# plans this way.

# %%
for rule in (None, "auto"):
    pp = sched.plan([1] * 16, [4096] * 16, 17, 1, chunk_overhead=64, chunk_limit=rule)
    print(f"chunk_limit={str(rule):5s} L={pp.chunk_limit:5d}  items {pp.num_items:3d}  "
          f"partials {pp.num_partials:3d}  makespan {pp.makespan:6.0f}  (bound {pp.lower_bound:.0f})")

# %% [markdown]
# ### Exercise 4 — the partial buffer fits, always
#
# The run step preallocates the partial buffer once (for CUDA graphs, addresses must not
# change). The planner bounds it by `2·C·T_q·H_qo·(head_dim+1)` elements. Find the
# largest `p.partial_elements(H_qo, head_dim)` over 200 random decode and prefill steps and
# store it as a fraction of `sched.partial_buffer_bound(...)` in `worst` (a float).

# %% tags=["exercise"]
worst = None   # your code here

# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
rng2 = np.random.default_rng(5)
worst = 0.0
for _ in range(200):
    b = int(rng2.integers(1, 20))
    qo = rng2.integers(1, 300, size=b) if rng2.random() < 0.5 else np.ones(b, int)
    kv = qo + rng2.integers(0, 5000, size=b)
    C, H_qo, d = int(rng2.integers(1, 64)), 8, 64
    pp = sched.plan(qo, kv, C)
    worst = max(worst, pp.partial_elements(H_qo, d) / sched.partial_buffer_bound(C, pp.tile_q, H_qo, d))

# %% tags=["check"]
assert worst is not None and 0 < worst <= 1.0, f"worst fraction {worst} should be in (0, 1]"
print(f"✓ the fullest plan used {worst:.0%} of the bound")

# %% [markdown]
# ### What was measured, and the cost model fitted to it
#
# The numbers below are read from `benchmarks/results/sched.json` and
# `benchmarks/results/cost_fit.json`: for every measured step, LPT's kernel time over the
# best fixed policy of the same run (above 1: LPT was slower). The planner can take a cost
# model fitted on the GPU (`sched.plan(..., cost=model)`, `nbattn.sched.cost`): it then
# prices the merge pass and the tail of the wave, and picks among its own plans and the
# fixed splits it can express the one the model predicts fastest. On an H100 (2026-12-06)
# that plan is at most 1.03x the best fixed policy on 12 of the 15 steps (and the fastest on
# 10 of them), and slower than that on 3: the skewed and constant steps at batch 16
# (1.072x, 1.056x) and the mixed prefill + decode step at batch 256 (1.040x).
# Part 2 shows the measurement; docs/concepts/scheduler.md says why.

# %%
from pathlib import Path
from nbattn.perf.results import load_suite
from nbattn.sched.cost import DEFAULT_FIT, load_cost_fit

suite = load_suite("sched")
rows = {}
for r in (suite.records if suite else []):
    if r.metric == "latency_us" and r.case.get("policy"):
        rows.setdefault((r.case["workload"], r.case.get("batch")), {})[r.case["policy"]] = r.value
for (w, b), t in rows.items():
    fixed = {k: v for k, v in t.items() if k == "one_per_cta" or k.startswith("split_")}
    if "lpt" in t and fixed:
        best = min(fixed, key=fixed.get)
        print(f"{w:14s} batch {b}: lpt {t['lpt']:8.1f} us, best fixed {best} {fixed[best]:8.1f} us, "
              f"lpt / best = {t['lpt'] / fixed[best]:.3f}")
fit_file = Path(suite.path).parent / "cost_fit.json" if suite and suite.path else None
fit = load_cost_fit(fit_file) if fit_file and fit_file.is_file() else DEFAULT_FIT
print("cost model:", "fitted on " + fit.gpu + " at " + fit.commit if fit.measured else
      "defaults (no GPU fit committed yet)", "\n", fit.decode_tc)

# %% [markdown]
# ## Summary
#
# * The plan is computed once per step on the CPU and reused by every layer.
# * LPT over chunks of at most `L = ceil(W/C)` keys keeps the *modelled* makespan near
#   `max(Σt/C, max t)`; unsplit tiles write directly, split ones merge in a fixed order.
# * A fixed order (never atomics) makes results bitwise reproducible for given lengths.
# * The partial-state buffer has a bound that depends only on `C`, `T_q`, the heads and
#   `head_dim`, so it can be allocated once.
# * The simulator is a model. Part 2 (`06_scheduler_on_the_gpu`) runs plans on the GPU and
#   shows where the GPU agrees with it and where it does not.
