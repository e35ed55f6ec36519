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
# # 05 · The scheduler: plan once, run every layer
#
# **What you will learn**
#
# 1. The tile heuristic: how a batch picks its query tile (`nbattn.sched.choose_tile_q`).
# 2. The LPT planner (`nbattn.sched.plan`): cut each query tile's KV range into chunks of at
#    most `L` keys, then hand the largest chunks first to the least-loaded CTA.
# 3. The **reduction map**: which partial states are merged, in which fixed order.
# 4. Running a plan — with the golden model, then on the device with the decode and merge
#    kernels — and why a fixed order makes the output bitwise reproducible (no atomics).
# 5. Gantt charts of three policies — one request per CTA, FlashDecoding's fixed split, and
#    LPT — under the simulator's cost model (`nbattn.sched.simulate`), against the makespan
#    lower bound.
# 6. Why plan/run makes a step CUDA-graph capturable.
#
# The planner runs on the CPU; without a GPU the kernels run in numba's simulator. Only the
# CUDA-graph cell needs a real GPU (it says so and skips itself otherwise).

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
# ## 4. Plan once, run on the device, every layer
#
# The decode kernel of notebook 03 runs exactly this kind of work list: CSR queues over CTAs
# (`nbattn.cuda.decode.WorkList`), and the merge kernel folds slots by a CSR reduction map
# (`nbattn.cuda.merge.MergeMap`, `run_merge_partials`). The kernel covers all query heads of an
# item with its second grid dimension, so for the planner a decode request is one row
# (`tile_q = 1`).
#
# The run step below allocates its workspace **once**, sized by the planner's bound on partial states, and
# then serves two layers (two different KV caches) with the same plan, the same grid and the
# same buffer addresses. Only the data changes — which is what a CUDA graph needs to replay a
# captured step. (Capturing a graph needs a real GPU; the simulator has no graphs.)

# %%
from numba import cuda
from nbattn import layout as L
from nbattn.cuda import decode as dec
from nbattn.cuda.merge import MergeMap, run_merge_partials

B, Hq, Hkv, D, C = (4, 4, 2, 16, 4) if SMALL else (32, 32, 8, 128, 132)
kv_dev_lens = rng.integers(4, 24 if SMALL else 4096, size=B)
kv_dev_lens[0] *= 4                                    # one long request
pkv = L.PagedKV.allocate(kv_dev_lens, 4 if SMALL else 16, rng=rng)
table = (pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len)

# plan: once per step, on the CPU
step = sched.plan(np.ones(B, int), pkv.kv_lens, num_ctas=C, tile_q=1)
to_dev = lambda a: cuda.to_device(np.array(a, np.int32))
work = dec.WorkList(*(to_dev(a) for a in (step.cta_indptr, step.request, step.kv_start, step.kv_end, step.out_slot)))
merge_map = MergeMap(*(to_dev(a) for a in (step.merge_indptr, step.merge_request, step.merge_slots)))

# workspace: once, for any plan of C CTAs (2*C*T_q slots of H*(D+1) values)
slots = sched.partial_buffer_bound(C, 1, Hq, D) // (Hq * (D + 1))
part_o = cuda.device_array((slots, Hq, D), np.float32)
part_lse = cuda.device_array((slots, Hq), np.float32)
print(f"{step.num_items} items on {C} CTAs, {step.num_partials} partials (workspace holds {slots})")


# %%
def address(a):   # the device pointer on a GPU; the simulator has none, so the object's identity
    return a.device_ctypes_pointer.value if not SMALL else id(a)

start_address = address(part_o)
for layer in range(2):
    cache = rng.normal(size=(pkv.num_pages, 2, pkv.page_size, Hkv, D)).astype(np.float32)
    q_l = rng.normal(size=(B, Hq, D)).astype(np.float32)
    prob = dec.prepare_decode(q_l, cache, *table)
    dec.run_decode_work(prob, work, part_o, part_lse)                  # run: fixed grid of C CTAs
    run_merge_partials(part_o, part_lse, merge_map, prob.out_dev, prob.lse_dev, code=prob.code)
    o_dev = prob.out_dev.copy_to_host()
    err = np.abs(o_dev - ref.batch_decode_paged(q_l, cache, *table)).max()
    print(f"layer {layer}: max |device - golden| = {err:.1e}; workspace address unchanged: "
          f"{address(part_o) == start_address}")
    assert err < TOL

# %% [markdown]
# The package wraps this as FlashInfer's `BatchDecodeWithPagedKVCacheWrapper`
# (`nbattn.cuda`): the constructor cuts one preallocated device buffer into fixed
# regions (plan arrays, partial states), `plan()` runs LPT and copies the plan in, and
# `run()` only launches the decode and merge kernels — once per layer.

# %%
from nbattn.cuda import BatchDecodeWithPagedKVCacheWrapper

workspace = cuda.device_array(1 << 20 if SMALL else 128 << 20, np.uint8)   # allocated once
wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", num_ctas=C)
wrapper.plan(*table, Hq, Hkv, D, pkv.page_size, q_data_type="float32")      # once per step
print(f"plan() took {wrapper.plan_seconds * 1e3:.2f} ms: {wrapper.last_plan.num_items} items, "
      f"{wrapper.last_plan.num_merges} merged requests")
for layer in range(2):                                                       # run() per layer
    cache = rng.normal(size=(pkv.num_pages, 2, pkv.page_size, Hkv, D)).astype(np.float32)
    q_l = rng.normal(size=(B, Hq, D)).astype(np.float32)
    err = np.abs(wrapper.run(q_l, cache) - ref.batch_decode_paged(q_l, cache, *table)).max()
    print(f"layer {layer}: max |run() - golden| = {err:.1e}")
    assert err < TOL

# %% [markdown]
# ## 5. Policies compared: Gantt charts
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
# filling the load pipeline, writing its state): about 64 KV tokens' worth for nbattn's
# decode kernel on an H200 (`item_overhead_tokens` in `sched.json`). Equal lengths show
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
# The simulator is a model. `benchmarks/gpu_sched.py` times the real kernels on a GPU for the
# same kinds of steps and writes `benchmarks/results/sched.json`; when that file is present,
# here is what it measured (latency per step, relative to one request per CTA). Compare the
# skewed step with the constant one: balancing pays where the lengths are uneven, and costs a
# little (extra chunks, a merge pass) where they are not.

# %%
from nbattn.perf import results
try:
    measured = results.load_suite("sched")
except results.ResultFormatError as e:
    measured = None
    print("sched.json does not validate, left out:", e)
rows = {}
for r in (measured.select("latency_us") if measured else []):
    rows.setdefault(r.case.get("workload"), {})[r.case.get("policy")] = r.value
if not rows:
    print("no measured scheduler results yet (benchmarks/results/sched.json)")
else:
    print(f"measured on {measured.gpu}, {measured.date} ({measured.command})")
    pols = sorted({p for row in rows.values() for p in row}, key=lambda p: (p != "one_per_cta", p))
    fig, ax = plt.subplots(figsize=(9, 3))
    width = 0.8 / len(pols)
    for k, pol in enumerate(pols):
        rel = [rows[w].get(pol, np.nan) / rows[w]["one_per_cta"] for w in rows]
        ax.bar(np.arange(len(rows)) + (k - (len(pols) - 1) / 2) * width, rel, width, label=pol)
    ax.set_xticks(range(len(rows)), list(rows)); ax.set_yscale("log")
    ax.axhline(1, color="k", lw=0.8); ax.set_ylabel("latency / one_per_cta")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1)); plt.tight_layout(); plt.show()
    for r in measured.select("plan_us"):
        print(f"{r.case.get('workload'):14s} plan() {r.value:7.0f} us (planner alone "
              f"{r.peers.get('planner_only', float('nan')):.0f} us)")

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
# ## 6. Plan/run and CUDA graphs
#
# A CUDA graph replays a fixed sequence of kernel launches with fixed arguments. Plan/run
# is built for it: the plan is written into a **preallocated** device workspace (the bound
# above), the run kernel always launches the same grid of `C` CTAs and reads its work from
# the workspace, and the merge pass reads the reduction map from the same place. Per step,
# only the *contents* of the workspace change (a host-to-device copy before replay);
# every layer then replays the captured graph.
#
# On a GPU with a CUDA build of PyTorch, the cell below captures one `run()` in a graph,
# re-plans a step with **different lengths** (same batch size, pages from the same pool),
# and replays the graph unchanged: the result matches the golden model for the new lengths.
# Without a GPU it says so and does nothing.

# %%
try:
    import torch
    have_graphs = (not SMALL) and torch.cuda.is_available()
except ImportError:
    have_graphs = False

if not have_graphs:
    print("CUDA graphs need a real GPU and a CUDA build of torch: skipped here")
else:
    hq, hk, d, page = 32, 8, 128, 16
    lens1, lens2 = [4096, 100, 700, 3000], [50, 3900, 1200, 17]
    pool = sum(-(-n // page) for n in lens1) + sum(-(-n // page) for n in lens2)
    def table_for(lens):
        n = [-(-x // page) for x in lens]
        indices = rng.permutation(pool)[:sum(n)].astype(np.int32)
        indptr = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
        last = np.array([x - (k - 1) * page for x, k in zip(lens, n)], np.int32)
        return indptr, indices, last
    cache_t = torch.randn(pool, 2, page, hk, d, dtype=torch.float16, device="cuda")
    q_t = torch.randn(len(lens1), hq, d, dtype=torch.float16, device="cuda")
    out_t = torch.empty_like(q_t)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), num_ctas=16)
    w.plan(*table_for(lens1), hq, hk, d, page)
    w.run(q_t, cache_t, out=out_t)                 # compile before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q_t, cache_t, out=out_t)
    t2 = table_for(lens2)
    w.plan(*t2, hq, hk, d, page)                   # new lengths: only workspace contents change
    q_t.copy_(torch.randn_like(q_t))
    g.replay()
    torch.cuda.synchronize()
    want = ref.batch_decode_paged(q_t.cpu().numpy(), cache_t.cpu().numpy(), *t2)
    err = np.abs(out_t.float().cpu().numpy() - want).max()
    print(f"graph replayed after a re-plan: max |replay - golden| = {err:.1e}")
    assert err < 4e-3 * (1 + np.abs(want).max())

# %% [markdown]
# The break-even of planning (the performance model): with `L` layers, per-layer times `u`
# (no plan) and `v` (with plan), plan cost `p` and integration cost `h`, planning pays
# when `L·(u − v) > p + h`:

# %%
from nbattn.perf import roofline as rl
import time
wl = sched.make_workload("variable", batch=64, seed=0)
t0 = time.perf_counter(); sched.plan(wl.qo_lens, wl.kv_lens, 132); plan_us = (time.perf_counter() - t0) * 1e6
u = sched.simulate(wl.qo_lens, wl.kv_lens, 132, "one_per_cta").makespan
v = sched.simulate(wl.qo_lens, wl.kv_lens, 132, "lpt").makespan
print(f"plan cost on this CPU: {plan_us:.0f} us; simulated per-layer makespan {u:.0f} -> {v:.0f} units")
for unit_ns in (5, 14, 50):          # what one cost unit is worth in time (the planner's cost model: ~14 ns)
    gain_us = (u - v) * unit_ns / 1000
    print(f"  1 unit = {unit_ns:2d} ns: saves {gain_us:6.1f} us/layer -> pays after "
          f"{rl.planning_breakeven_layers(u * unit_ns / 1000, v * unit_ns / 1000, plan_us):.0f} layers")

# %% [markdown]
# ## Summary
#
# * The plan is computed once per step on the CPU and reused by every layer.
# * LPT over chunks of at most `L = ceil(W/C)` keys keeps the makespan near
#   `max(Σt/C, max t)`; unsplit tiles write directly, split ones merge in a fixed order.
# * A fixed order (never atomics) makes results bitwise reproducible for given lengths.
# * A fixed grid and a preallocated workspace make the run step graph-capturable.
