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
# # 04 · Prefill tiles and the roofline
#
# **What you will learn**
#
# 1. How a prefill kernel tiles the work: a `T_q × T_k` tile of scores at a time, online
#    softmax across KV tiles, and which tiles a causal mask lets it skip.
# 2. nbattn's prefill kernel (`nbattn.cuda.batch_prefill_paged`) on the paged batch of
#    notebook 02, checked against the golden model.
# 3. The roofline model (`nbattn.perf.roofline`): FLOPs, minimal bytes,
#    operational intensity — and why **decode is memory-bound** while **prefill is
#    compute-bound**.
# 4. Where measured numbers come from: `benchmarks/results/*.json`, read through
#    `nbattn.perf.results`; the roofline figure (`nbattn.plots.roofline`) places them when present.

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

import matplotlib.pyplot as plt
from nbattn import reference as ref
from nbattn.perf import roofline as rl, results, H200, GPUS


# %% [markdown]
# ## 1. A prefill tile loop in NumPy
#
# One head, `Q` queries, `K` keys. The kernel owns a tile of `T_q` query rows and walks
# the keys `T_k` at a time: scores for the tile, a running max `m`, a running sum `l`,
# an un-normalized accumulator — the online softmax of notebook 01, now for a whole block
# of rows. With a causal mask, a KV tile entirely to the right of the diagonal is never
# loaded, and tiles entirely left of it need no mask at all.

# %%
def tiled_prefill(q, k, v, T_q, T_k, causal=False):
    """q [Q, D], k/v [K, D]; returns (o, tiles_loaded). Positions are bottom-right aligned."""
    Q, D = q.shape; K = k.shape[0]
    o = np.zeros_like(q); loaded = 0
    for r0 in range(0, Q, T_q):
        rows = np.arange(r0, min(r0 + T_q, Q)); pos = K - Q + rows
        m = np.full(len(rows), -np.inf); l = np.zeros(len(rows)); acc = np.zeros((len(rows), D))
        for c0 in range(0, K, T_k):
            if causal and c0 > pos.max():
                break                                   # the rest of the row is masked: skip
            loaded += 1
            cols = np.arange(c0, min(c0 + T_k, K))
            s = q[rows] @ k[cols].T / np.sqrt(D)
            if causal:
                s = np.where(cols[None, :] <= pos[:, None], s, -np.inf)
            m_new = np.maximum(m, s.max(1))
            alpha = np.exp(np.where(np.isinf(m), -np.inf, m - m_new))
            p = np.exp(s - m_new[:, None])
            l = l * alpha + p.sum(1)
            acc = acc * alpha[:, None] + p @ v[cols]
            m = m_new
        o[rows] = acc / l[:, None]
    return o, loaded

rng = np.random.default_rng(0)
Q = K = 64 if SMALL else 256
D = 32
q1, k1, v1 = (rng.normal(size=(n, D)) for n in (Q, K, K))
o_tiled, loaded = tiled_prefill(q1, k1, v1, 16, 16, causal=True)
o_gold = ref.single_prefill(q1[:, None], k1[:, None], v1[:, None], causal=True, dtype=np.float64)[:, 0]
print(f"max |tiled - golden| = {np.abs(o_tiled - o_gold).max():.1e};  loaded {loaded} of {(Q // 16) * (K // 16)} tiles")
np.testing.assert_allclose(o_tiled, o_gold, rtol=1e-10, atol=1e-12)   # both float64


# %%
def tile_kinds(Q, K, T_q, T_k):
    """0 = skipped, 1 = needs the mask (diagonal), 2 = fully visible."""
    i = np.arange(Q)[:, None]; j = np.arange(K)[None, :]
    vis = j <= K - Q + i
    nq, nk = -(-Q // T_q), -(-K // T_k)
    kinds = np.zeros((nq, nk), int)
    for a in range(nq):
        for b in range(nk):
            blk = vis[a * T_q:(a + 1) * T_q, b * T_k:(b + 1) * T_k]
            kinds[a, b] = 2 if blk.all() else (1 if blk.any() else 0)
    return kinds

fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
for ax, (Qx, Kx) in zip(axes, [(128, 128), (32, 128)]):
    ax.imshow(tile_kinds(Qx, Kx, 16, 16), cmap="Blues", vmin=0, vmax=2.4)
    ax.set_title(f"causal, Q={Qx}, K={Kx}, 16×16 tiles"); ax.set_xlabel("KV tile"); ax.set_ylabel("query tile")
plt.suptitle("white: skipped · light: masked diagonal · dark: no mask needed", fontsize=9)
plt.tight_layout(); plt.show()


# %% [markdown]
# ### Exercise 1 — how many tiles does a causal prefill load?
#
# For `Q = K = N` and square tiles `T_q = T_k = T` with `T` dividing `N`, give a closed form
# `loaded_tiles(N, T)` for the number of tiles a causal kernel loads. The check compares it
# with the tile loop above.

# %% tags=["exercise"]
def loaded_tiles(N, T):
    # your code here
    raise NotImplementedError


# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
def loaded_tiles(N, T):
    n = N // T
    return n * (n + 1) // 2


# %% tags=["check"]
for N, T in [(16, 16), (64, 16), (96, 32), (128, 8)]:
    qn, kn, vn = (rng.normal(size=(N, 4)) for _ in range(3))
    _, got = tiled_prefill(qn, kn, vn, T, T, causal=True)
    assert loaded_tiles(N, T) == got, f"N={N}, T={T}: you said {loaded_tiles(N, T)}, the loop loads {got}"
print("✓ about half the tiles: causal prefill does ~half the FLOPs (rl.causal_visible_pairs counts them)")

# %% [markdown]
# ## 2. nbattn's prefill kernel
#
# `nbattn.cuda.batch_prefill_paged` takes the golden model's arguments. Each
# CTA owns one tile of fused rows (GQA heads folded in) and one KV head; it gathers each
# KV tile from the pages into shared memory once and uses it for the whole group. On a GPU
# with fp16/bf16 it runs the tensor-core path; in the simulator the CUDA-core path with
# small tiles. The tile to read is `nbattn/cuda/kernels/prefill_core.py` (the fast tiles beside
# it say how they differ). Here is the three-request batch of notebook 02, causal:

# %%
import nbattn.cuda as nbcuda

qo_indptr = np.array([0, 3, 4, 8], np.int32)
kv_indptr = np.array([0, 2, 3, 6], np.int32)
kv_indices = np.array([7, 2, 11, 3, 14, 6], np.int32)
last_page_len = np.array([2, 2, 1], np.int32)
Hq, Hkv, D = (4, 2, 16) if SMALL else (32, 8, 128)
dtype = np.float32 if SMALL else np.float16
cache = rng.normal(size=(16, 2, 4, Hkv, D)).astype(dtype)
q = rng.normal(size=(8, Hq, D)).astype(dtype)
args = (q, cache, qo_indptr, kv_indptr, kv_indices, last_page_len)
o_k, lse_k = nbcuda.batch_prefill_paged(*args, causal=True, return_lse=True)
o_r, lse_r = ref.batch_prefill_paged(*args, causal=True, return_lse=True)
tol = 1e-5 if SMALL else 2e-2
print(f"kernel vs golden: max |Δo| = {np.abs(np.asarray(o_k, np.float32) - o_r).max():.1e}, "
      f"max |Δlse| = {np.abs(lse_k - lse_r).max():.1e}")
assert np.allclose(np.asarray(o_k, np.float32), o_r, atol=tol) and np.allclose(lse_k, lse_r, atol=tol)

# %% [markdown]
# ## 3. The roofline
#
# The performance model counts what attention cannot avoid. Per query head:
# FLOPs `≈ 4·l_q·l_kv·d` (two matmuls), and minimal bytes
# `b·d·(l_q·H_qo + 2·l_kv·H_kv + l_q·H_qo)` (read Q, read K and V once, write O).
# Their ratio, the **operational intensity**, decides which roof a kernel hits:
# below the GPU's ridge point it is limited by memory bandwidth, above it by compute.

# %%
shapes = {
    "decode, MHA, l_kv 4k":        dict(l_q=1,    l_kv=4096, num_qo_heads=32, num_kv_heads=32),
    "decode, GQA group 8, l_kv 4k": dict(l_q=1,    l_kv=4096, num_qo_heads=32, num_kv_heads=4),
    "prefill 512 on 4k, GQA 4":    dict(l_q=512,  l_kv=4096, num_qo_heads=32, num_kv_heads=8),
    "prefill 4k x 4k, MHA":        dict(l_q=4096, l_kv=4096, num_qo_heads=32, num_kv_heads=32),
}
ridge = H200.ridge_intensity()
print(f"H200 ridge point: {H200.tensor_tflops} TFLOP/s / {H200.copy_bandwidth_GBps:.0f} GB/s = {ridge:.0f} FLOP/byte\n")
for name, kw in shapes.items():
    I = rl.operational_intensity(head_dim=128, **kw)
    roof = rl.attainable_tflops(I, H200.tensor_tflops, H200.copy_bandwidth_GBps)
    bound = "memory-bound" if I < ridge else "compute-bound"
    print(f"{name:30s} intensity {I:8.1f} FLOP/B -> at most {roof:6.1f} TFLOP/s ({bound})")

# %% [markdown]
# Decode reads every key once for a single query row: about `2/b` FLOPs per byte per query
# head sharing the KV head, i.e. ≈ `group` for fp16. Prefill reuses each key for `l_q`
# rows: the intensity grows like `l_q·l_kv/(l_q+l_kv)`.
#
# ### Exercise 2 — where does prefill cross the ridge?
#
# MHA, fp16 (`b = 2`), `l_kv = 4096`, head_dim 128. Using the closed form
# `(2/b)·l_q·l_kv/(l_q+l_kv)`, find the smallest integer `l_q` whose intensity reaches the
# H200 ridge (`ridge` above). Store it in `l_q_cross`.

# %% tags=["exercise"]
l_q_cross = None   # your code here

# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
l_kv = 4096
l_q_cross = int(np.ceil(ridge * l_kv / (l_kv - ridge)))      # solve l_q*l_kv/(l_q+l_kv) = ridge

# %% tags=["check"]
I = lambda lq: rl.operational_intensity(lq, 4096, head_dim=128, num_qo_heads=32, num_kv_heads=32)
assert I(l_q_cross) >= ridge > I(l_q_cross - 1), f"l_q={l_q_cross}: intensity {I(l_q_cross):.1f} vs ridge {ridge:.1f}"
print(f"✓ from l_q = {l_q_cross} queries on, a 4k-context prefill is compute-bound on an H200")

# %% [markdown]
# ## 4. Measured points
#
# Measured numbers enter only through result files in `benchmarks/results/`
# (one JSON per suite; format and validation in `nbattn.perf.results`). Nothing is made up:
# a missing file means no point, and a file that fails validation is reported and left out
# (never patched up). Here is what this checkout has; the files that validate are copied to
# a scratch folder that the figures below read:

# %%
import shutil, tempfile
from pathlib import Path

def readable_results():
    """A scratch results folder holding the result files that validate; reports the others."""
    root, ok = results.default_results_root(), Path(tempfile.mkdtemp(prefix="nbattn-results-"))
    for path in sorted(root.glob("*.json")) if root.exists() else []:
        try:
            s = results.load_suite(path.stem, root)
        except results.ResultFormatError as e:
            print(f"{path.name:22s} NOT READ: {e}")
            continue
        shutil.copy(path, ok / path.name)
        print(f"{path.name:22s} gpu={s.gpu!r:16s} date={s.date}  {len(s.records):3d} records  metrics={s.metrics()}")
    return ok

root = readable_results()
if not any(root.iterdir()):
    print("no result files yet: the roofline below shows the model only")

# %%
from nbattn.plots import roofline as roofline_plots
pts = roofline_plots.measured_points(root)
print("measured roofline points:", [(p["suite"], p["impl"], len(p["x"])) for p in pts] or "none yet "
      "(they come from decode.json / prefill.json, written by the GPU benchmarks)")
fig = roofline_plots.roofline_figure(root)
display(fig)

# %% [markdown]
# How far below its roof does a measured prefill sit? For each `tflops` record of
# `prefill.json` (when present), the shape gives the intensity, the intensity and the GPU
# named in the file give the roof, and the ratio is what is left on the table:

# %%
from nbattn.perf import match_gpu
pre = results.load_suite("prefill", root)
if pre is None:
    print("no prefill.json yet: run the GPU prefill benchmark to fill this in")
else:
    gpu = match_gpu(pre.gpu) or H200
    bw = pre.copy_bandwidth_GBps or gpu.copy_bandwidth_GBps
    for r in pre.select("tflops"):
        sh = results.attention_shape(r.case)
        I = rl.operational_intensity(sh["l_q"], sh["l_kv"], sh["head_dim"], sh["num_qo_heads"],
                                     sh["num_kv_heads"], sh["bytes_per_elem"], causal=sh["causal"])
        roof = rl.attainable_tflops(I, gpu.tensor_tflops, bw)
        label = ", ".join(f"{k}={v}" for k, v in r.case.items() if k in ("q_len", "causal", "path", "kv"))
        print(f"{label:55s} {r.value:7.1f} TFLOP/s = {r.value / roof:5.1%} of the {roof:.0f} TFLOP/s roof ({gpu.name})")

# %% [markdown]
# The golden model has a CPU benchmark of its own (`golden_cpu.json`, when present): a
# reminder that a NumPy prefill is itself compute-bound — it reaches a good fraction of
# what NumPy's matmul does on the same machine.

# %%
gold = results.load_suite("golden_cpu", root)
if gold is None:
    print("golden_cpu.json not present")
else:
    for r in gold.select("gflops"):
        peers = ", ".join(f"{k} {v:.1f}" for k, v in r.peers.items() if v is not None)
        print(f"case {dict(r.case)}: golden model {r.value:.1f} {r.unit} ({peers})")

# %% [markdown]
# ### Exercise 4 — place your own point
#
# That point was measured on some other CPU. Put one of your own on *this* machine's
# roofline. The next cell times the golden model's prefill here, and measures this machine's
# two roofs the same way the benchmark does: NumPy's matmul (the compute roof a NumPy
# prefill can hope for) and a large NumPy copy (the memory roof, read plus write).
#
# Fill in the FLOPs of the timed run, its minimal bytes in float32 (`bytes_per_elem=4`),
# the operational intensity and the GFLOP/s it reached. `rl.attention_flops` and
# `rl.attention_bytes` count one request; the batch has `B_` equal ones. Then read the
# figure: is the golden model compute-bound or memory-bound here, and how far below its
# roof does it sit?

# %%
import time

def best_seconds(fn, n=3):
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter(); fn(); best = min(best, time.perf_counter() - t)
    return best

B_, N_, H_, D_ = 4, 512, 4, 64                # requests, tokens (queries = keys), heads, head_dim
rng_cpu = np.random.default_rng(4)
qc, kc, vc = (rng_cpu.standard_normal((B_ * N_, H_, D_)).astype(np.float32) for _ in range(3))
ind = np.arange(0, B_ * N_ + 1, N_, dtype=np.int32)
t_golden = best_seconds(lambda: ref.batch_prefill_ragged(qc, kc, vc, ind, ind))
a_mm = rng_cpu.standard_normal((H_, N_, D_)).astype(np.float32)
b_mm = rng_cpu.standard_normal((H_, D_, N_)).astype(np.float32)
matmul_gflops = 2.0 * H_ * N_ * D_ * N_ / best_seconds(lambda: np.matmul(a_mm, b_mm), 5) / 1e9
src = np.ones(1 << 24, np.float32); dst = np.empty_like(src)          # 64 MB each
copy_GBps = 2 * src.nbytes / best_seconds(lambda: np.copyto(dst, src), 5) / 1e9
print(f"golden prefill {B_} x {N_} x {N_}, {H_} heads, d {D_}: {t_golden * 1e3:.1f} ms; "
      f"this machine: matmul {matmul_gflops:.0f} GFLOP/s, copy {copy_GBps:.1f} GB/s")

# %% tags=["exercise"]
my_flops = None        # your code here: FLOPs of the timed run (the whole batch)
my_bytes = None        # minimal bytes of the timed run in float32
my_intensity = None    # FLOP per byte
my_gflops = None       # GFLOP/s the golden model reached

# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
my_flops = B_ * rl.attention_flops(N_, N_, D_, H_)
my_bytes = B_ * rl.attention_bytes(N_, N_, D_, H_, H_, bytes_per_elem=4)
my_intensity = my_flops / my_bytes
my_gflops = my_flops / t_golden / 1e9

# %% tags=["check"]
assert np.isclose(my_flops, 4.0 * B_ * N_ * N_ * D_ * H_), "two matmuls of 2*N*N*D FLOPs per head and request"
assert np.isclose(my_bytes, B_ * 4 * D_ * (2 * N_ * H_ + 2 * N_ * H_)), "read Q, K, V once and write O once"
assert np.isclose(my_intensity, rl.operational_intensity(N_, N_, D_, H_, H_, bytes_per_elem=4))
assert np.isclose(my_gflops, my_flops / t_golden / 1e9)
ridge = matmul_gflops / copy_GBps                               # FLOP per byte where the roofs meet
print(f"your point: {my_intensity:.0f} FLOP/B, {my_gflops:.1f} GFLOP/s; ridge of this machine "
      f"{ridge:.1f} FLOP/B -> {'compute' if my_intensity > ridge else 'memory'}-bound, "
      f"{my_gflops / min(matmul_gflops, my_intensity * copy_GBps):.0%} of its roof")

# %%
I_axis = np.geomspace(0.1, 1e3, 200)
fig, ax = plt.subplots(figsize=(6, 3.6))
ax.plot(I_axis, np.minimum(matmul_gflops, I_axis * copy_GBps), color="black", label="this machine's roofline")
ax.scatter([my_intensity], [my_gflops], color="C3", zorder=3, label="your golden prefill (measured here)")
if gold is not None:
    for r in gold.select("gflops"):
        c = r.case
        I_c = rl.operational_intensity(c["q_len"], c["kv_len"], c["head_dim"], c["heads"], c["heads"],
                                       bytes_per_elem=4)
        ax.scatter([I_c], [r.value], marker="s", color="C0", zorder=3,
                   label=f"golden_cpu.json (another CPU; its matmul {r.peers['numpy_matmul']:.0f} GFLOP/s)")
ax.set_xscale("log"); ax.set_yscale("log")
ax.set_xlabel("operational intensity (FLOP/byte, float32)"); ax.set_ylabel("GFLOP/s")
ax.set_title("The golden model on a CPU roofline (measured)", fontsize=9)
ax.legend(fontsize=7, loc="lower right"); plt.tight_layout(); plt.show()

# %% [markdown]
# ## 5. Why decode needs split-KV
#
# A memory-bound kernel is only as fast as the number of SMs pulling data. A decode step
# with a small batch launches `batch × H_kv` CTAs — often fewer than the SMs. Splitting
# each KV range into chunks (FlashDecoding; notebook 03) puts every SM to work, at the
# price of writing partial states and merging them. The model
# `rl.split_kv_speedup_model` makes the assumptions explicit (see its docstring):

# %%
l_kv = np.geomspace(256, 131072, 40)
fig, ax = plt.subplots(figsize=(6, 3.3))
for batch in (1, 4, 16, 64):
    ax.plot(l_kv, rl.split_kv_speedup_model(batch, l_kv), label=f"batch {batch}")
ax.set_xscale("log", base=2); ax.set_xlabel("KV length"); ax.set_ylabel("modelled speedup of split-KV")
ax.set_title("H200 model, 32 q / 8 kv heads"); ax.legend(); plt.tight_layout(); plt.show()

# %% [markdown]
# ## Summary
#
# * Prefill kernels tile queries and keys; causal masks skip about half the tiles.
# * Intensity decides the roof: decode ≈ `group` FLOP/byte (memory-bound), prefill grows with
#   length (compute-bound past a few hundred queries on an H200).
# * Decode is therefore reported as a fraction of measured copy bandwidth, prefill as a
#   fraction of peak FLOP/s; measured points come only from `benchmarks/results`.
