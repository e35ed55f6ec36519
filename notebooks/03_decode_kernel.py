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
# # 03 · The decode kernel
#
# **What you will learn**
#
# 1. Why decode is about *reading bytes once*: one query row per request against its whole
#    KV history (notebook 04 puts a number on it).
# 2. **Shared-memory gather**: a CTA (cooperative thread array — a CUDA thread block) copies a tile of keys from scattered pages into
#    shared memory, then every thread computes from there. You will write the index math
#    of a small gather kernel in numba.cuda.
# 3. **GQA fusion**: the query heads that share a KV head are handled by one CTA, so each
#    KV tile is loaded once for the whole group.
# 4. **Split-KV** (FlashDecoding): long requests are cut into chunks whose partial states are
#    merged in a fixed order — the merge operator of notebook 01, on the device.
# 5. All of it checked against the golden model, here in the notebook.
#
# Kernels used: `nbattn.cuda.batch_decode_paged`, the building blocks of `nbattn.cuda.decode`
# (`prepare_decode`, `split_work`, `WorkList`, `run_decode_work`) and `nbattn.cuda.merge_states`.
# Without a GPU they run in numba's CUDA simulator (every thread is a Python thread), so the
# shapes stay small.

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

from numba import cuda, float32
from nbattn import layout as L
from nbattn import reference as ref
import nbattn.cuda as nbcuda
from nbattn.cuda import decode as dec
from nbattn.perf import roofline as rl

rng = np.random.default_rng(0)
# the three-request batch (notebook 02), as a decode step (one new query row per request)
page_size, num_pages = 4, 16
kv_indptr = np.array([0, 2, 3, 6], np.int32)
kv_indices = np.array([7, 2, 11, 3, 14, 6], np.int32)
last_page_len = np.array([2, 2, 1], np.int32)
pkv = L.PagedKV.validate(kv_indptr, kv_indices, last_page_len, page_size, num_pages)
print("kv lengths:", pkv.kv_lens)

# %% [markdown]
# ## 1. Shared-memory gather
#
# A request's keys are scattered over pages. A decode CTA walks its keys in tiles of `TILE`
# tokens: the threads first copy the tile from global memory into a `cuda.shared.array`
# (each thread one element; on a GPU each thread moves 16 bytes at a time), synchronize, and
# then compute scores and `p·V` from shared memory. The copy is where the page table is read.
#
# The toy kernel below does only the gather, for one head, and writes each tile back out
# contiguously so we can check it. Grid: one CTA per (request, tile); threads: (token in tile, element of
# `head_dim`).
#
# ### Exercise 1 — the index math
#
# Write the device function `locate(kv_indices, first_page, t)`: logical token `t` of a
# request whose page list starts at `kv_indices[first_page]` lives in which `(page, slot)`?
# (`PAGE_SIZE` is a global constant.)

# %%
PAGE_SIZE, TILE, DG = page_size, 4, 8           # DG: head_dim of this toy
cache_toy = rng.normal(size=(num_pages, 2, PAGE_SIZE, 1, DG)).astype(np.float32)


# %% tags=["exercise"]
@cuda.jit(device=True)
def locate(kv_indices, first_page, t):
    # your code here: return page, slot
    return 0, 0


# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
@cuda.jit(device=True)
def locate(kv_indices, first_page, t):
    return kv_indices[first_page + t // PAGE_SIZE], t % PAGE_SIZE


# %%
@cuda.jit
def gather_tiles(cache, kv_indptr, kv_indices, kv_lens, out, out_indptr):
    r, tile = cuda.blockIdx.x, cuda.blockIdx.y
    i, d = cuda.threadIdx.x, cuda.threadIdx.y
    smem = cuda.shared.array((TILE, DG), float32)       # one K tile
    t = tile * TILE + i
    if t < kv_lens[r]:
        page, slot = locate(kv_indices, kv_indptr[r], t)
        smem[i, d] = cache[page, 0, slot, 0, d]          # global -> shared
    cuda.syncthreads()                                   # the tile is complete
    if t < kv_lens[r]:
        out[out_indptr[r] + t, d] = smem[i, d]           # (a real kernel computes here)

kv_lens = pkv.kv_lens
out_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
out = np.zeros((int(kv_lens.sum()), DG), np.float32)
grid = (pkv.batch_size, int(-(-kv_lens.max() // TILE)))
gather_tiles[grid, (TILE, DG)](cache_toy, kv_indptr, kv_indices, kv_lens, out, out_indptr)
print("launched", grid, "blocks of", (TILE, DG), "threads")

# %% tags=["check"]
for r in range(pkv.batch_size):
    k_gold, _ = L.gather_kv(cache_toy, pkv, r)
    np.testing.assert_array_equal(out[out_indptr[r]:out_indptr[r + 1]], k_gold[:, 0],
                                  err_msg=f"request {r}: wrong page or slot")
print("✓ the kernel gathered every key of every request from the right page and slot")

# %% [markdown]
# ## 2. nbattn's decode kernel
#
# `nbattn.cuda.batch_decode_paged` takes exactly the golden model's arguments. Inside, a
# CTA owns one work item and a group of query heads; per KV tile it gathers K and V into
# shared memory, computes the scores of all its heads, runs the online softmax in base 2 and
# accumulates `p·V`. The kernel to read is `nbattn/cuda/kernels/decode_smem.py`: one screen,
# its math as comments under *compute qk*, *update m and l*, *update acc*, beside
# `nbattn.reference.attend`. On a GPU the faster warp and tensor-core paths run the same work
# list; `tuning=DECODE.replace(path="smem")` (from `nbattn.cuda.tuning`) asks for the teaching
# kernel anywhere. We use GQA with 4 query heads per KV head:

# %%
if SMALL:
    Hq, Hkv, D = 8, 2, 16
    big = pkv                                             # the three-request batch
else:
    Hq, Hkv, D = 32, 8, 128
    big = L.PagedKV.allocate(rng.integers(1, 4096, size=32), 16, rng=rng)
cache = rng.normal(size=(big.num_pages, 2, big.page_size, Hkv, D)).astype(np.float32)
q = rng.normal(size=(big.batch_size, Hq, D)).astype(np.float32)
table = (big.paged_kv_indptr, big.paged_kv_indices, big.paged_kv_last_page_len)

o_k, lse_k = nbcuda.batch_decode_paged(q, cache, *table, return_lse=True)
o_g, lse_g = ref.batch_decode_paged(q, cache, *table, return_lse=True)
print(f"batch {big.batch_size}, kv lengths up to {big.kv_lens.max()}, {Hq} q heads / {Hkv} kv heads, head_dim {D}")
print(f"kernel vs golden: max |Δo| = {np.abs(o_k - o_g).max():.1e}, max |Δlse| = {np.abs(lse_k - lse_g).max():.1e}")
assert np.allclose(o_k, o_g, atol=TOL, rtol=TOL) and np.allclose(lse_k, lse_g, atol=TOL, rtol=TOL)

# %% [markdown]
# How the kernel is configured for this call (`prepare_decode` validates everything and moves
# the arrays to the device; nothing launches yet):

# %%
prob = dec.prepare_decode(q, cache, *table, return_lse=True)
cfg = prob.config()
print(f"group = {prob.group}: heads per CTA = {cfg.heads_per_cta}, threads per CTA = {cfg.nthreads}, "
      f"tokens per KV tile = {cfg.tile_tokens}")

# %% [markdown]
# ### Exercise 2 — what GQA fusion saves
#
# If every query head were handled by its own CTA, each CTA would load its KV head's
# keys and values again: the KV traffic is multiplied by the group. Compute, for this batch
# in fp16 (`b = 2`), the minimal bytes of the performance model *with* fusion (`fused`) and the bytes
# a one-head-per-CTA kernel would move (`unfused`: as if there were `Hq` KV heads).

# %% tags=["exercise"]
fused, unfused = None, None   # your code here (bytes, summed over the batch)

# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
l = big.kv_lens.astype(np.int64)
fused = int(np.sum(2 * D * (Hq + 2 * l * Hkv + Hq)))
unfused = int(np.sum(2 * D * (Hq + 2 * l * Hq + Hq)))

# %% tags=["check"]
assert fused == int(np.sum(rl.attention_bytes(1, big.kv_lens, D, Hq, Hkv)))
assert unfused == int(np.sum(rl.attention_bytes(1, big.kv_lens, D, Hq, Hq)))
print(f"✓ {unfused / fused:.2f}x fewer bytes with fusion (→ group = {Hq // Hkv} for long contexts)")

# %% [markdown]
# ## 3. Split-KV: partial states and the merge
#
# With few requests, a decode step has too few CTAs to keep every SM busy. FlashDecoding
# cuts each long KV range into chunks, one work item each. Items of a split request write a
# **partial state** `(o, lse)` into a slot; a merge kernel then folds each request's slots
# in KV order. `split_work` builds that work list and its reduction map:

# %%
chunk = 4 if SMALL else 1024
(cta_indptr, request, kv_start, kv_end, out_slot,
 merge_indptr, merge_row, merge_slots, n_slots) = dec.split_work(big.kv_lens, chunk)
for i in range(min(len(request), 8)):
    dest = f"slot {out_slot[i]}" if out_slot[i] >= 0 else "final output"
    print(f"item {i}: request {request[i]} keys [{kv_start[i]}, {kv_end[i]}) -> {dest}")
print("reduction map:", [(int(merge_row[m]), merge_slots[merge_indptr[m]:merge_indptr[m + 1]].tolist())
                         for m in range(min(len(merge_row), 4))])

# %% [markdown]
# ### From work items to CTAs to SMs, drawn
#
# Each work item runs once per KV head: the decode grid is (work items) x (KV heads), one
# CTA per cell, and the CTA takes every query head of that KV head's group. The picture uses
# a small batch of its own (four requests of 9, 3, 14 and 6 keys, chunks of 4 keys, 2 KV
# heads) so that it reads the same with or without a GPU. Each box is one CTA: the keys it
# reads, its request and KV head. Its colour is the *wave* it would start in on a made-up
# GPU of 6 SMs that takes CTAs in launch order, and the label the SM it would land on. The
# short request is one CTA per KV head; the long one is four, which is the point of
# splitting: more CTAs, so more SMs pull its bytes at once. (A real GPU hands out CTAs as
# SMs free up, several per SM at a time; the H200 has 132 SMs.)

# %%
import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle
lens_pic, chunk_pic, hkv_pic, sms_pic = np.array([9, 3, 14, 6]), 4, 2, 6
items = dec.split_work(lens_pic, chunk_pic)
req_pic, start_pic, end_pic = items[1], items[2], items[3]
n_items = len(req_pic)
fig, ax = plt.subplots(figsize=(9, 4))
rows, labels = 0, []
for r in range(len(lens_pic)):
    for h in range(hkv_pic):
        for i in np.flatnonzero(req_pic == r):
            cta = h * n_items + i                      # blockIdx.x = item, blockIdx.y = KV head
            wave, sm = divmod(cta, sms_pic)
            ax.add_patch(Rectangle((start_pic[i], rows + 0.1), end_pic[i] - start_pic[i], 0.8,
                                   facecolor=plt.get_cmap("tab10")(wave), edgecolor="k"))
            ax.text((start_pic[i] + end_pic[i]) / 2, rows + 0.5, f"CTA {cta}\nSM {sm}", ha="center",
                    va="center", fontsize=7)
        labels.append(f"request {r}, KV head {h}")
        rows += 1
ax.set_xlim(0, lens_pic.max()); ax.set_ylim(rows, 0)
ax.set_yticks(np.arange(rows) + 0.5, labels); ax.set_xlabel("key position")
waves = -(-2 * n_items // sms_pic)
ax.legend(handles=[Patch(color=plt.get_cmap("tab10")(w), label=f"wave {w}") for w in range(waves)],
          loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
ax.set_title(f"{n_items} work items x {hkv_pic} KV heads = {hkv_pic * n_items} CTAs on {sms_pic} SMs")
fig.tight_layout()
plt.show()
assert int(np.sum(end_pic - start_pic)) == int(lens_pic.sum())      # every key in exactly one item


# %%
def run_items(prob):
    """Launch the decode kernel over the split work list; return partial states (host)."""
    work = dec.WorkList(*(cuda.to_device(a) for a in (cta_indptr, request, kv_start, kv_end, out_slot)))
    part_o = cuda.device_array((n_slots, Hq, D), np.float32)
    part_lse = cuda.device_array((n_slots, Hq), np.float32)
    dec.run_decode_work(prob, work, part_o, part_lse)
    return part_o.copy_to_host(), part_lse.copy_to_host()

prob = dec.prepare_decode(q, cache, *table, return_lse=True)
part_o, part_lse = run_items(prob)
direct = prob.out_dev.copy_to_host()        # rows of unsplit requests were written directly
print("partial states:", part_o.shape, part_lse.shape)

# %% [markdown]
# ### Exercise 3 — finish the split
#
# Build `o_split [batch, Hq, D]`: rows of unsplit requests come from `direct`; for each entry
# `m` of the reduction map, merge the slots `merge_slots[merge_indptr[m]:merge_indptr[m+1]]`
# **in that order** with `ref.merge_states` (shapes: `v [rows, num_states, H, D]`,
# `s [rows, num_states, H]`) and put the result in row `merge_row[m]`.

# %% tags=["exercise"]
o_split = None   # your code here

# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
o_split = direct.copy()
for m in range(len(merge_row)):
    slots = merge_slots[merge_indptr[m]:merge_indptr[m + 1]]
    o_split[merge_row[m]] = ref.merge_states(part_o[slots][None], part_lse[slots][None]).o[0]

# %% tags=["check"]
np.testing.assert_allclose(o_split, o_g, atol=TOL, rtol=TOL)
# the same fold on the device: nbattn.cuda.merge_states has the golden signature
m = 0
slots = merge_slots[merge_indptr[m]:merge_indptr[m + 1]]
dev = nbcuda.merge_states(part_o[slots][None], part_lse[slots][None])
np.testing.assert_allclose(dev.o[0], o_split[merge_row[m]], atol=TOL, rtol=TOL)
print(f"✓ {len(merge_row)} split requests merged from {n_slots} partial states; equals the golden model")

# %% [markdown]
# The fold order is fixed by the map, never by which CTA finishes first (no atomics), so
# running the same work twice gives **bitwise** the same partials:

# %%
again_o, again_lse = run_items(dec.prepare_decode(q, cache, *table, return_lse=True))
same = np.array_equal(again_o, part_o) and np.array_equal(again_lse, part_lse)
print("bitwise identical partial states:", same)
assert same

# %% [markdown]
# Why bother? A single long request is the worst case for an unsplit decode: a handful of
# CTAs pull every byte while the rest of the GPU idles. `benchmarks/gpu_decode.py` measured
# both on a GPU; when `benchmarks/results/decode.json` is present, here is the achieved
# bandwidth as a fraction of the device's copy bandwidth (the performance model's yardstick), unsplit vs split:

# %%
from nbattn.perf import results
try:
    measured = results.load_suite("decode")
except results.ResultFormatError as e:
    measured = None
    print("decode.json does not validate, left out:", e)
pairs = {}
for r in (measured.select("bw_fraction") if measured else []):
    key = (r.case.get("batch"), r.case.get("kv_len"), r.case.get("group"))
    pairs.setdefault(key, {})[r.case.get("split")] = r.value
pairs = {k: v for k, v in pairs.items() if "unsplit" in v and len(v) > 1}
if not pairs:
    print("no measured split/unsplit pair yet (benchmarks/results/decode.json)")
else:
    print(f"measured on {measured.gpu}, {measured.date}; copy bandwidth {measured.copy_bandwidth_GBps:.0f} GB/s")
    for (b, l, g), v in pairs.items():
        for name, x in v.items():
            if name != "unsplit":
                print(f"batch {b}, kv_len {l}, group {g}: unsplit {v['unsplit']:.3f} -> split ({name}) "
                      f"{x:.3f} of copy bandwidth, {x / v['unsplit']:.0f}x")

# %% [markdown]
# Split, the single request reaches most of the copy bandwidth, but not all of it. A
# memory-bound kernel's bandwidth is the bytes it keeps *in flight* divided by how long a
# load takes to come back (Little's law), and a kernel can only keep in flight what its
# registers (or shared memory) can receive. `benchmarks/gpu_read_floor.py` measured a
# kernel that does nothing but read the same 134 MB, with up to 8 loads of 16 bytes in flight
# per thread, over grids that hold more or fewer of them per SM:

# %%
floor = results.load_suite("decode_read_floor")     # None before the first GPU run
if floor is None:
    print("no bare-read measurement yet (benchmarks/results/decode_read_floor.json)")
SMS = 132          # the H200's SMs: 128 and 132 CTAs are one per SM, 264 two, 1056 eight
for r in (floor.select("latency_us") if floor else []):
    c = r.case
    if c["part"] != "read":
        continue
    per_sm = c["threads"] * c["unroll"] * 16 * -(-c["ctas"] // SMS)
    frac = c["bytes_read"] / (r.value * 1e-6) / 1e9 / floor.copy_bandwidth_GBps
    print(f"{c['ctas']:5d} CTAs x {c['threads']} threads: {per_sm // 1024:4d} KB in flight per SM -> "
          f"{r.value:6.1f} us, {frac:.2f} of copy bandwidth")

# %% [markdown]
# Drawn, with Little's law beside it: bandwidth = bytes in flight / latency. The dashed line
# is what the bandwidth would be if a load always came back as fast as it does at the
# smallest measured load (the latency that point implies); the dotted line is the copy
# bandwidth. Under more load the latency grows (requests queue in the memory system), so
# the points bend away from the line before they reach the copy bandwidth.

# %%
pts = []
for r in (floor.select("latency_us") if floor else []):
    c = r.case
    if c["part"] == "read":
        kb = c["threads"] * c["unroll"] * 16 * -(-c["ctas"] // SMS) / 1024
        pts.append((kb, c["bytes_read"] / (r.value * 1e-6) / 1e9, f"{c['ctas']} x {c['threads']}"))
if pts:
    pts.sort()
    kb0, bw0, _ = pts[0]
    lat0_us = SMS * kb0 * 1024 / (bw0 * 1e9) * 1e6           # Little's law at the smallest load
    copy = floor.copy_bandwidth_GBps
    xs = np.linspace(0, max(p[0] for p in pts) * 1.1, 50)
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.plot(xs, np.minimum(SMS * xs * 1024 / (lat0_us * 1e-6) / 1e9, 2 * copy) / copy, "--", color="gray",
            label=f"Little's law, latency {lat0_us:.1f} us")
    ax.axhline(1.0, ls=":", color="black", label=f"copy bandwidth ({copy:.0f} GB/s)")
    ax.scatter([p[0] for p in pts], [p[1] / copy for p in pts], color="C0", zorder=3,
               label="bare reads (measured)")
    for kb in sorted({p[0] for p in pts}):                  # one label per load: the grids that hold it
        at = [p for p in pts if p[0] == kb]
        ax.annotate("\n".join(p[2] for p in at), (kb, min(p[1] for p in at) / copy), textcoords="offset points",
                    xytext=(5, -8 - 8 * len(at)), fontsize=7)
    ax.axvline(64, color="C3", lw=1)
    ax.text(66, 0.1, "batch-1 tensor-core\ndecode (64 KB)", color="C3", fontsize=7)
    ax.set_xlabel("bytes in flight per SM (KB)"); ax.set_ylabel("fraction of copy bandwidth")
    ax.set_ylim(0, 1.3); ax.set_xlim(0, xs[-1])
    ax.set_title(f"Little's law on the {floor.gpu} (decode_read_floor.json, measured)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right"); plt.tight_layout(); plt.show()
    for kb, bw_, lab in pts:
        print(f"{lab:>10s} CTAs x threads: {kb:5.0f} KB per SM -> implied latency "
              f"{SMS * kb * 1024 / (bw_ * 1e9) * 1e6:.2f} us")

# %% [markdown]
# The tensor-core decode kernel of the batch-1 case keeps about 64 KB per SM in flight (8
# warps, each with one step of K and V, 16 tokens x 256 bytes each); its registers are
# nearly all used. Going further means staging loads in shared memory (`cp.async`), as
# FlashInfer does, rather than in registers.

# %% [markdown]
# ## 4. Variants ride along
#
# The decode kernel compiles the same variants as the prefill kernel (notebook 07). A
# soft-cap and a sliding window with sinks, checked once more against the golden model:

# %%
kw = dict(logits_soft_cap=8.0, window_left=5, sink_size=1)
diff = np.abs(nbcuda.batch_decode_paged(q, cache, *table, **kw) - ref.batch_decode_paged(q, cache, *table, **kw)).max()
print(f"kernel vs golden with {kw}: {diff:.1e}")
assert diff < TOL

# %% [markdown]
# ## Summary
#
# * A decode CTA gathers each KV tile from its pages into shared memory once and serves
#   every query head of its GQA group from it.
# * Split-KV trades a little extra traffic (partial states) for parallelism; the merge
#   operator makes the result exact, and a fixed fold order makes it reproducible.
# * Notebook 05 shows how the scheduler chooses the chunks (LPT) instead of a fixed size.
