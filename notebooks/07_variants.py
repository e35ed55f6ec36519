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
# # 07 · Variants as compiled Python functions, and the paper's figures
#
# **What you will learn**
#
# 1. The customization points of an attention kernel, in the package's words: a
#    `nbattn.variants.Variant` — soft-cap, sliding window (with sinks), ALiBi, sigmoid
#    attention, and your own `score_mod` / `mask_mod`.
# 2. The order they apply in: scale → ALiBi → soft-cap → `score_mod` → mask → softmax.
# 3. How one plain Python function serves twice: the golden model calls it with NumPy
#    arrays, and the kernel factory compiles it with numba into device code (numba's JIT
#    plays the role of FlashInfer's JIT templates).
# 4. How to rebuild the paper's figures from models and measured results (`nbattn.figures`).

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
from nbattn import reference as ref
from nbattn.reference.masks import keep_mask
from nbattn.variants import Variant, alibi_slopes
import nbattn.cuda as nbcuda

rng = np.random.default_rng(0)
Q, K, H, D = (8, 40, 2, 16) if SMALL else (128, 1024, 8, 64)
q = rng.normal(size=(Q, H, D)).astype(np.float32)
k = rng.normal(size=(K, H, D)).astype(np.float32)
v = rng.normal(size=(K, H, D)).astype(np.float32)

def compare(**variant):
    """Run the kernel and the golden model with the same variant; assert they agree
    within TOL (absolute and relative) and return the max |difference|."""
    o_kernel = np.asarray(nbcuda.single_prefill(q, k, v, **variant), np.float32)
    o_golden = ref.single_prefill(q, k, v, **variant)
    np.testing.assert_allclose(o_kernel, o_golden, atol=TOL, rtol=TOL, err_msg=str(variant))
    return float(np.abs(o_kernel - o_golden).max())


# %% [markdown]
# ## 1. One dataclass describes what is computed
#
# Every attention function — golden or kernel — takes the same keywords and turns them into
# a frozen, hashable `Variant`. Hashable matters: the kernel factory caches one compiled
# kernel per variant.

# %%
var = Variant(causal=True, logits_soft_cap=30.0, window_left=255, sink_size=4)
print(var)
print("needs positions:", var.needs_positions, "  hash usable as a cache key:", hash(var) == hash(Variant(**vars(var))))

# %% [markdown]
# ## 2. Logits soft-cap
#
# Gemma-style soft-capping squashes each (already scaled) score through `c·tanh(s/c)`:
# nearly the identity for `|s| ≪ c`, never beyond `±c`. It bounds how peaked the softmax
# can get.

# %%
s = np.linspace(-60, 60, 400)
fig, ax = plt.subplots(figsize=(5, 3))
for c in (10, 30):
    ax.plot(s, c * np.tanh(s / c), label=f"c = {c}")
ax.plot(s, s, "k:", lw=0.8, label="no cap")
ax.set_xlabel("scaled score s"); ax.set_ylabel("capped score"); ax.legend(); plt.tight_layout(); plt.show()
print("kernel vs golden, soft-cap 5, causal:", compare(causal=True, logits_soft_cap=5.0))

# %% [markdown]
# ## 3. Sliding window and attention sinks
#
# `window_left` is inclusive (FlashInfer's convention): query at position `i_pos` keeps key
# `j` iff `i_pos − j ≤ window_left` (−1 = no window). `sink_size` keeps the first keys
# visible whatever the window (StreamingLLM's "attention sinks"). Positions are bottom-right
# aligned: query `i` of `Q` sits at `K − Q + i`.

# %%
Qm, Km = 12, 20
q_pos, kv_pos = np.arange(Km - Qm, Km), np.arange(Km)
fig, axes = plt.subplots(1, 3, figsize=(10, 2.6))
for ax, (title, vv) in zip(axes, [("causal", Variant(causal=True)),
                                  ("causal, window_left=4", Variant(causal=True, window_left=4)),
                                  ("+ sink_size=2", Variant(causal=True, window_left=4, sink_size=2))]):
    ax.imshow(keep_mask(vv, 0, np.arange(1), q_pos, kv_pos)[0], cmap="Greens", vmin=0, vmax=1.3)
    ax.set_title(title, fontsize=9); ax.set_xlabel("key position"); ax.set_ylabel("query row")
plt.tight_layout(); plt.show()
print("kernel vs golden, window 7 + 2 sinks:", compare(causal=True, window_left=7, sink_size=2))

# %% [markdown]
# ## 4. Sigmoid attention
#
# No softmax: `o = Σ_j sigmoid(s_ij + bias)·v_j`. There is no normalizer, hence no LSE, and
# partial outputs over disjoint key sets simply **add** (notebook 01). Asking for the LSE
# is an error:

# %%
print("kernel vs golden, sigmoid (bias -1):", compare(use_sigmoid=True, sigmoid_bias=-1.0))
try:
    ref.single_prefill(q, k, v, use_sigmoid=True, return_lse=True)
except ValueError as e:
    print("ValueError:", e)


# %% [markdown]
# ## 5. Your own functions: `score_mod` and `mask_mod`
#
# Write them with FlexAttention's argument order, in plain arithmetic and comparisons:
#
# ```python
# score_mod(score, b, h, q_idx, kv_idx) -> new score
# mask_mod(b, h, q_idx, kv_idx)         -> True to keep the key
# ```
#
# `b` is the request, `h` the query head, `q_idx`/`kv_idx` sequence positions. The golden
# model calls them once with broadcast NumPy arrays; the kernel compiles them with
# `numba.cuda.jit(device=True)` and calls them per (row, key) inside the tile loop. The
# same source, two executions:

# %%
def dilated(b, h, q_idx, kv_idx):          # keep every third key back from the query
    return (q_idx - kv_idx) % 3 == 0

def tilt(score, b, h, q_idx, kv_idx):      # a head-dependent linear bias
    return score - 0.05 * (h + 1) * (q_idx - kv_idx)

qi, kj = np.arange(4)[:, None], np.arange(6)[None, :]
print("golden model's call, one NumPy evaluation:\n", dilated(0, 0, qi + 2, kj).astype(int))
from numba import cuda
compiled = cuda.jit(device=True)(dilated)
print("numba device function:", type(compiled).__name__)
print("kernel vs golden, causal + dilated + tilt:", compare(causal=True, mask_mod=dilated, score_mod=tilt))

# %% [markdown]
# A mask can also arrive as *data*: one bit per (query row, key), decided at run time, as
# tree and speculative decoding need (docs: "Runtime custom masks"). `custom_mask` takes the
# `[Q, K]` booleans (or each request's block flattened, in the batch forms); the kernel reads
# the packed bits from device memory. Here every row keeps key 0 and a random half of the rest.

# %%
tree = rng.random((Q, K)) < 0.5
tree[:, 0] = True
print("kernel vs golden, a runtime custom mask:", compare(custom_mask=tree))


# %% [markdown]
# ### Exercise 1 — a built-in as your own mask
#
# Write `my_window(b, h, q_idx, kv_idx)` that, together with `causal=True`, reproduces
# `window_left=5, sink_size=2`. Use `|` and `&` (not `or`/`and`) so the golden model can
# evaluate it on arrays in one go. The check runs it **in the kernel**.

# %% tags=["exercise"]
def my_window(b, h, q_idx, kv_idx):
    # your code here
    raise NotImplementedError


# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
def my_window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= 5) | (kv_idx < 2)


# %% tags=["check"]
o_mine = nbcuda.single_prefill(q, k, v, causal=True, mask_mod=my_window)
o_builtin = ref.single_prefill(q, k, v, causal=True, window_left=5, sink_size=2)
np.testing.assert_allclose(np.asarray(o_mine, np.float32), o_builtin, atol=TOL, rtol=TOL)
print("✓ your compiled mask_mod equals the built-in window with sinks")


# %% [markdown]
# ### Exercise 2 — ALiBi as a `score_mod`
#
# ALiBi adds `−slope_h·(q_idx − kv_idx)` to each score, with geometric slopes per head
# (for `H` a power of two: `slope_h = 2^(−8(h+1)/H)`). Write `my_alibi` as a `score_mod` for
# our `H` heads and compare with the built-in `pos_encoding_mode="ALIBI"`. (`H` is a global
# here; numba freezes globals into the compiled function as constants.)

# %% tags=["exercise"]
def my_alibi(score, b, h, q_idx, kv_idx):
    # your code here
    raise NotImplementedError


# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
def my_alibi(score, b, h, q_idx, kv_idx):
    return score - 2.0 ** (-8.0 * (h + 1) / H) * (q_idx - kv_idx)


# %% tags=["check"]
assert H & (H - 1) == 0, "this closed form needs a power-of-two head count"
np.testing.assert_allclose(2.0 ** (-8.0 * (np.arange(H) + 1) / H), alibi_slopes(H), rtol=1e-6)
o_mine = nbcuda.single_prefill(q, k, v, causal=True, score_mod=my_alibi)
o_builtin = ref.single_prefill(q, k, v, causal=True, pos_encoding_mode="ALIBI")
np.testing.assert_allclose(np.asarray(o_mine, np.float32), o_builtin, atol=10 * TOL, rtol=10 * TOL)
print("✓ your compiled score_mod equals the built-in ALiBi")

# %% [markdown]
# ## 6. Reproducing the paper's figures
#
# `nbattn.figures` is a registry: each entry has a builder, a caption that puts the paper's
# number beside ours, and a data source. Builders draw the performance models and, where a
# result file exists in `benchmarks/results/`, the measured points; otherwise the figure
# says "no measured data yet". Nothing is fabricated: a result file that fails validation
# is left out and named below.

# %%
import nbattn.figures as figures
from nbattn.perf.results import default_results_root
for entry in figures.registry():
    print(f"{entry.name:26s} {entry.data_source}")

# %%
import warnings
warnings.filterwarnings("ignore", message="IProgress not found")   # tqdm without ipywidgets
import shutil
from nbattn.perf import results

readable = Path(tempfile.mkdtemp(prefix="nbattn-results-"))   # result files that validate
for path in sorted(default_results_root().glob("*.json")):
    try:
        results.load_suite(path.stem, default_results_root())
        shutil.copy(path, readable / path.name)
    except results.ResultFormatError as e:
        print(f"left out, does not validate: {e}")

outdir = Path(tempfile.mkdtemp(prefix="nbattn-figures-"))
names = ["shared_prefix_traffic", "split_kv_speedup", "amdahl"] if SMALL else None   # all of them on a GPU box
paths = figures.build_all(outdir, results_root=readable, progress=False,
                          names=[n for n in (names or figures.figure_names()) if n in figures.figure_names()])
for path in paths[:3]:
    print(figures.get(path.stem).caption)
    display(Image(filename=str(path)))
print(f"{len(paths)} figures written to {outdir}")

# %% [markdown]
# ### Exercise 3 — read a paper number through Amdahl's law
#
# The paper reports that switching SGLang's attention backend from Triton to FlashInfer took the
# end-to-end inter-token latency of Llama 3.1 8B on the Variable workload from 29.6 ms to
# 9.1 ms. If attention
# is a fraction `f` of a step and gets `k×` faster, the step gets
# `1 / ((1 − f) + f/k)` faster. Suppose, for this exercise, that the switch changed nothing
# but attention. Even with infinitely fast attention (`k → ∞`), what is the smallest `f`
# that explains the measured speedup? Store it in `f_min`.
#
# Read the answer as a statement about that supposition, not about the real step. A backend
# switch is more than a faster attention kernel: the backend also brings its own planning,
# its own CUDA-graph capture and its own kernels around attention. So part of the 3.3x may
# come from outside attention, and then attention's true share could be smaller than `f_min`.
# Amdahl's law bounds what a *pure* attention speedup can do; to split a whole-system number
# into its parts you need a profile of the step before and after.

# %% tags=["exercise"]
f_min = None   # your code here

# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
f_min = 1 - 9.1 / 29.6

# %% tags=["check"]
from nbattn.perf import roofline as rl
assert np.isclose(rl.amdahl_speedup(f_min, 1e12), 29.6 / 9.1, rtol=1e-6)
assert rl.amdahl_speedup(f_min - 0.01, 1e12) < 29.6 / 9.1
print(f"✓ if only attention changed, it was at least {f_min:.0%} of the step before the switch")

# %% [markdown]
# ## 7. Three serving features in the golden model: RoPE, fp8 caches, learnable sinks
#
# These three change what goes *into* the scores or the softmax, not the mask. The golden
# model has all three (docs: "Rotary position embeddings", "fp8 KV caches" in "Layouts",
# "Learnable attention sinks"). The kernels take them too (RoPE in the warp decode path, the
# tensor-core prefill tile and the teaching kernels, fp8 caches in decode, sinks merged after
# the kernels); two cells below check the kernels' RoPE against the golden model, the rest of
# the section runs on NumPy and torch.
#
# ### RoPE: a score that only knows the distance
#
# RoPE turns every query and key by an angle proportional to its position, pair of
# dimensions by pair of dimensions. Turning both by the same extra angle leaves their dot
# product unchanged, so a score depends on `m - n`, how far apart the query (at `m`) and
# the key (at `n`) are, and not on where they are. Below, one query vector and one key
# vector are placed at every position from 0 to 23 and every pair is scored: the matrix is
# constant along its diagonals.
#
# That is also why a serving system may store keys *unrotated* and turn them when it
# attends (the Streaming-LLM case of the paper, Figure 9). After old tokens are evicted, a
# key's position in the cache is not its position in the original text; rotating at
# attention time with the cache position gives the scores of a fresh sequence.

# %%
from nbattn import reference as R
rng_r = np.random.default_rng(7)
N_r, D_r = 24, 16
q_vec, k_vec = (rng_r.standard_normal(D_r).astype(np.float32) for _ in range(2))
pos_r = np.arange(N_r, dtype=np.int32)
q_rows = np.tile(q_vec, (N_r, 1))[:, None, :]             # [24 rows, 1 head, 16]: one q at every position
k_rows = np.tile(k_vec, (N_r, 1))[:, None, :]
q_rot, k_rot = R.apply_rope_pos_ids(q_rows, k_rows, pos_r, rope_theta=100.0)
S_rope = np.einsum("md,nd->mn", q_rot[:, 0].astype(np.float64), k_rot[:, 0].astype(np.float64))
assert np.allclose(S_rope[1:, 1:], S_rope[:-1, :-1], atol=1e-4)   # shift both positions: same score
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
im = ax1.imshow(S_rope, cmap="RdBu_r"); fig.colorbar(im, ax=ax1, shrink=0.8)
ax1.set_xlabel("key position n"); ax1.set_ylabel("query position m")
ax1.set_title("q·k after RoPE (golden model)", fontsize=9)
ax2.plot(np.arange(N_r), S_rope[N_r - 1, ::-1], marker=".")
ax2.set_xlabel("distance m - n"); ax2.set_ylabel("score"); ax2.set_title("the last row, by distance", fontsize=9)
plt.tight_layout(); plt.show()

# %%
# The same rotation as a kernel of its own (nbattn.cuda.apply_rope_pos_ids: one thread per pair,
# float64 angles as in the golden model), for a cache that stores keys already rotated:
q_rot_gpu, k_rot_gpu = nbcuda.apply_rope_pos_ids(q_rows, k_rows, pos_r, rope_theta=100.0)
np.testing.assert_allclose(q_rot_gpu, q_rot, rtol=1e-6, atol=1e-6)
np.testing.assert_allclose(k_rot_gpu, k_rot, rtol=1e-6, atol=1e-6)
print("standalone RoPE kernel vs golden, largest |difference|:",
      float(np.abs(q_rot_gpu - q_rot).max()), float(np.abs(k_rot_gpu - k_rot).max()))

# %%
# The kernels turn q and every key inside attention as well (the teaching tile here; docs: "RoPE at
# attention time"), so the cache can hold keys unrotated:
print("kernel vs golden, RoPE at attention time:", compare(pos_encoding_mode="ROPE_LLAMA", rope_theta=100.0))
print("kernel vs golden, RoPE + causal:         ", compare(pos_encoding_mode="ROPE_LLAMA", causal=True))

# %% [markdown]
# ### Angles in turns: how the fast kernels keep RoPE exact at any position
#
# A key at position 100,000 turns its first pair by 100,000 radians. Only the angle modulo
# $2\pi$ matters, but a float32 angle that large is already off by up to $10^{-2}$ radians,
# and a float64 one is off by about $10^{-16}$ of the angle. Float64 would do, but on the GPU
# its cosines cost more than reading the key. The warp decode path and the tensor-core
# prefill tile count angles in *turns* instead ($2\pi$ is one turn): the host writes how far
# each pair turns per position as a 64-bit fixed-point fraction of a turn, whole turns
# dropped (`turns_per_position`), and the kernel multiplies the position by it in integers.
# The product's low 64 bits *are* the angle modulo one turn, exactly, for every int32
# position; its top 23 bits become a float32 angle in $[-\pi, \pi]$ for the GPU's fast
# cosine and sine. So the error stays at the 23 bits' $4 \cdot 10^{-7}$ radians wherever
# the key sits. The plot sets the three ways side by side on pair 1 (0.87 radians per
# position at theta 1e4), against the exact angle of the same table.

# %%
from nbattn.cuda.blocks.rope import turns_per_position
D_t, theta_t = 128, 1e4
turns = turns_per_position(D_t, 1.0, theta_t)
fixed = int(turns[1]) << 32 | int(turns[D_t // 2 + 1])   # pair 1: 64-bit fraction of a turn per position
freq1 = theta_t ** (-2.0 / D_t)                            # its radians per position
positions = np.unique(np.logspace(0, np.log10(2 ** 31 - 1), 60).astype(np.int64))
exact = np.array([(int(p) * fixed % 2 ** 64) / 2 ** 64 for p in positions])   # turns, from the same table


def off_by(turns_got):          # radians between two angles given in turns, the short way round
    d = (turns_got - exact) % 1.0
    return 2 * np.pi * np.minimum(d, 1.0 - d)


err32 = off_by((positions.astype(np.float32) * np.float32(freq1)).astype(np.float64) / (2 * np.pi))
err64 = off_by((positions.astype(np.float64) * freq1 % (2 * np.pi)) / (2 * np.pi))
top23 = np.array([(((int(p) * fixed % 2 ** 64) >> 32) + 2 ** 8 >> 9) / 2 ** 23 for p in positions])
errfx = off_by(top23)
fig, ax = plt.subplots(figsize=(6.5, 3.4))
for err, label in ((err32, "float32 radians"), (err64, "float64 radians"),
                   (errfx, "fixed-point turns, 23 bits kept")):
    ax.loglog(positions, np.maximum(err, 1e-18), marker=".", label=label)
ax.set_xlabel("position"); ax.set_ylabel("angle error (radians)")
ax.set_title("pair 1 of RoPE: how far off the angle is", fontsize=9); ax.legend(fontsize=8)
plt.tight_layout(); plt.show()
assert errfx.max() < 4e-7 and err32[positions > 10 ** 5].max() > 1e-3

# %% [markdown]
# ### fp8 KV caches: the scale decides what survives
#
# An fp8 cache stores `x / scale` in 8 bits and is read back as `stored * scale`
# (`k_scale`, `v_scale`; FlashInfer's names). `float8_e4m3fn` keeps 3 mantissa bits and
# reaches 448; `float8_e5m2` keeps 2 and reaches 57344. Too small a scale and the
# largest values saturate at the format's maximum (the left of each curve); too large a
# scale and the small ones fall into the few subnormals near zero (e4m3fn's rise at the
# right; e5m2's far wider range only gets there past this plot). The usual choice is `scale = max|x| / fmax`, the
# smallest scale that saturates nothing. The curves are the relative error of a V tensor
# with a few outliers, round-tripped through `nbattn.reference.fp8.quantize`, against the scale.

# %%
import torch
from nbattn.reference.fp8 import quantize
x_v = rng_r.standard_normal(4096)
x_v[:8] *= 20.0                                           # a few outliers, as real V caches have
amax = float(np.abs(x_v).max())
scales = np.geomspace(amax / 1e5, amax * 10, 80)
fig, ax = plt.subplots(figsize=(6.4, 3.4))
for fmt, fmax, color in (("float8_e4m3fn", 448.0, "C0"), ("float8_e5m2", 57344.0, "C1")):
    err = [np.linalg.norm(quantize(x_v, sc, fmt).to(torch.float64).numpy() * sc - x_v) / np.linalg.norm(x_v)
           for sc in scales]
    ax.plot(scales / amax, err, color=color, label=fmt)
    ax.axvline(1 / fmax, color=color, ls=":", lw=1)
ax.set_xscale("log"); ax.set_yscale("log")
ax.set_xlabel("scale / max|x|  (dotted: 1 / fmax)"); ax.set_ylabel("relative error after the round trip")
ax.set_title("fp8 round trip of a V tensor with outliers (golden model)", fontsize=9)
ax.legend(fontsize=8); plt.tight_layout(); plt.show()

# %% [markdown]
# The same choice inside attention: a decode over an fp8 cache, read by the golden model with
# the scales, against the same decode over the float32 values.

# %%
Kd, Hd, Dd = 64, 2, 16
q_d = rng_r.standard_normal((Hd, Dd)).astype(np.float32)
k_d, v_d = (rng_r.standard_normal((Kd, Hd, Dd)) for _ in range(2))
o_ref = R.single_decode(q_d, k_d.astype(np.float32), v_d.astype(np.float32))
for fmt, fmax in (("float8_e4m3fn", 448.0), ("float8_e5m2", 57344.0)):
    ks, vs = float(np.abs(k_d).max()) / fmax, float(np.abs(v_d).max()) / fmax
    o_fp8 = R.single_decode(torch.from_numpy(q_d), quantize(k_d, ks, fmt), quantize(v_d, vs, fmt),
                            k_scale=ks, v_scale=vs)
    print(f"{fmt}: max |o_fp8 - o_fp32| = {float(np.abs(np.asarray(o_fp8, np.float64) - o_ref).max()):.4f} "
          f"(outputs of size ~{float(np.abs(o_ref).max()):.2f})")

# %% [markdown]
# ### Learnable sinks: somewhere for the weight to go
#
# A learnable sink (GPT-OSS; FlashInfer's `sinks`) is one extra logit per query head in the
# softmax's denominator, with no value vector. The weight it takes is weight no key gets, so
# the output shrinks towards zero: `o_sink = o * (1 - w_sink)` with
# `w_sink = e^sink / (e^sink + sum_j e^s_j)`. The picture shows one row's weights without
# and with a sink logit of 2; the check reads `w_sink` off the golden model's LSE.

# %%
LOG2E_ = 1.4426950408889634
Ks = 12
q_s = rng_r.standard_normal((1, 1, Dd)).astype(np.float32)
k_s, v_s = (rng_r.standard_normal((Ks, 1, Dd)).astype(np.float32) for _ in range(2))
sink = np.array([2.0], np.float32)
o0, lse0 = R.single_prefill(q_s, k_s, v_s, return_lse=True)
o1 = R.single_prefill(q_s, k_s, v_s, sinks=sink)
w_sink = 1.0 / (1.0 + 2.0 ** (lse0[0, 0] - sink[0] * LOG2E_))   # e^sink / (e^sink + sum e^s)
np.testing.assert_allclose(o1, o0 * (1.0 - w_sink), rtol=1e-5, atol=1e-6)
s_row = (k_s[:, 0] @ q_s[0, 0]) / np.sqrt(Dd)
p_no = np.exp(s_row - s_row.max()); p_no /= p_no.sum()
p_yes = p_no * (1.0 - w_sink)
fig, ax = plt.subplots(figsize=(6.4, 3.0))
ax.bar(np.arange(Ks) - 0.2, p_no, 0.4, label="no sink (sums to 1)")
ax.bar(np.arange(Ks) + 0.2, p_yes, 0.4, label=f"sink logit 2 (sums to {1 - w_sink:.2f})")
ax.bar([Ks + 0.5], [w_sink], 0.6, color="gray", label="the sink's share")
ax.set_xlabel("key"); ax.set_ylabel("softmax weight"); ax.legend(fontsize=8)
ax.set_title("one row's weights, golden model", fontsize=9); plt.tight_layout(); plt.show()
print(f"the sink takes {w_sink:.2f} of the weight; o shrinks by that factor")

# %% [markdown]
# ## Summary
#
# * A `Variant` names every customization; golden model and kernels read the same one.
# * User functions are plain Python: NumPy evaluates them for the golden model, numba compiles
#   them into the kernel, and a hashable variant keys the kernel cache.
# * The figures are functions of models and result files; rerun them after a benchmark to see
#   measured points beside the paper's numbers.
# * RoPE makes a score a function of distance, so keys may be stored unrotated and turned at
#   attention time; an fp8 cache is only as good as its scale; a learnable sink gives the
#   softmax somewhere to put weight that no key deserves.
