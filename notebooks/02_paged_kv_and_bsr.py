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
# # 02 · Paged KV cache, causal masks and BSR views
#
# **What you will learn**
#
# 1. How a paged KV cache stores requests in a pool of fixed-size pages, using the
#    three-request batch of the documentation's *Layouts* page (page size 4).
# 2. Bottom-right aligned causal masks for requests that append several tokens.
# 3. The same page table seen as a **block-sparse (BSR) matrix**: `nbattn.layout.page_table_to_bsr`,
#    `BSR.to_block_mask`, and attention over a BSR view (`nbattn.reference.block_sparse`).
# 4. Shared prefixes as **composable formats**: `nbattn.layout.cascade_decompose` splits one
#    page table into a shared-prefix view and a unique-suffix view, and the merge of notebook 01
#    puts the two back together.
#
# Only index arrays are built here; the KV data is never copied into a new layout. The
# kernels `nbattn.cuda.block_sparse` and `nbattn.cuda.cascade` read the very same views.

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
from nbattn import layout as L
from nbattn import reference as ref

# %% [markdown]
# ## 1. The three-request batch
#
# | request | prefix (already cached) | new tokens (queries) | KV length |
# |---|---|---|---|
# | R0 | 3 | 3 | 6 |
# | R1 | 1 | 1 | 2 |
# | R2 | 5 | 4 | 9 |
#
# Queries are *ragged*: packed back to back, row ranges given by `qo_indptr`.
# KV lives in pages of 4 slots; request `r` owns pages
# `kv_indices[kv_indptr[r]:kv_indptr[r+1]]` in logical order, and only
# `last_page_len[r]` slots of its last page are used. Pages need not be sorted.

# %%
page_size, num_pages = 4, 16
qo_indptr = np.array([0, 3, 4, 8], np.int32)
kv_indptr = np.array([0, 2, 3, 6], np.int32)
kv_indices = np.array([7, 2, 11, 3, 14, 6], np.int32)
last_page_len = np.array([2, 2, 1], np.int32)

pkv = L.PagedKV.validate(kv_indptr, kv_indices, last_page_len, page_size, num_pages)
print("kv lengths:", pkv.kv_lens, "  query lengths:", L.RaggedQ(qo_indptr).lengths)
print("R2 token 5 lives in (page, slot) =", [int(x) for x in pkv.locate(2, 5)])
print("R2 last token (8) lives in       =", [int(x) for x in pkv.locate(2, 8)])

# %% [markdown]
# Drawn: the pool of 16 pages × 4 slots. Each used slot shows `request:token`; grey slots
# are free or the unused tail of a last page.

# %%
colors = ["#1f77b4", "#2ca02c", "#d62728"]

def draw_pool(pkv, ax, title):
    ax.set_xlim(0, pkv.num_pages); ax.set_ylim(pkv.page_size, 0)
    ax.add_patch(plt.Rectangle((0, 0), pkv.num_pages, pkv.page_size, color="#eeeeee"))
    for r in range(pkv.batch_size):
        pages, slots = pkv.token_slots(r)
        for t, (p, s) in enumerate(zip(pages, slots)):
            ax.add_patch(plt.Rectangle((p, s), 1, 1, color=colors[r % len(colors)], alpha=0.75))
            ax.text(p + 0.5, s + 0.5, f"{r}:{t}", ha="center", va="center", fontsize=7, color="white")
    ax.set_xticks(np.arange(pkv.num_pages) + 0.5, range(pkv.num_pages), fontsize=7)
    ax.set_yticks(np.arange(pkv.page_size) + 0.5, range(pkv.page_size), fontsize=7)
    ax.set_xlabel("page id"); ax.set_ylabel("slot"); ax.set_title(title)

fig, ax = plt.subplots(figsize=(8, 2.2))
draw_pool(pkv, ax, "paged KV pool (request:token)")
plt.show()

# %% [markdown]
# The layout module rejects bad metadata *before* any kernel runs, naming the argument:

# %%
bad_cases = {
    "last_page_len 0": dict(paged_kv_last_page_len=np.array([2, 0, 1], np.int32)),
    "page id out of pool": dict(paged_kv_indices=np.array([7, 2, 11, 3, 14, 99], np.int32)),
    "int64 metadata": dict(paged_kv_indptr=kv_indptr.astype(np.int64)),
    "decreasing indptr": dict(paged_kv_indptr=np.array([0, 3, 2, 6], np.int32)),
}
good = dict(paged_kv_indptr=kv_indptr, paged_kv_indices=kv_indices, paged_kv_last_page_len=last_page_len)
for name, change in bad_cases.items():
    try:
        L.PagedKV.validate(**{**good, **change}, page_size=page_size, num_pages=num_pages)
    except L.LayoutError as e:
        print(f"{name:22s} -> {e}")

# %% [markdown]
# ## 2. Causal masks, bottom-right aligned
#
# A request's queries are its *last* `Q` tokens, so local query `i` may see key `j` iff
# `j <= K - Q + i`. For a decode step (`Q = 1`) that is every key.

# %%
kv_lens, qo_lens = pkv.kv_lens, np.diff(qo_indptr)
fig, axes = plt.subplots(1, 3, figsize=(9, 2.4))
for r, ax in enumerate(axes):
    Q, K = int(qo_lens[r]), int(kv_lens[r])
    i, j = np.arange(Q)[:, None], np.arange(K)[None, :]
    ax.imshow(j <= K - Q + i, cmap="Blues", vmin=0, vmax=1.3)
    ax.set_title(f"R{r}: Q={Q}, K={K}"); ax.set_xlabel("key j"); ax.set_ylabel("query i")
    ax.set_xticks(range(K)); ax.set_yticks(range(Q))
plt.tight_layout(); plt.show()


# %% [markdown]
# ### Exercise 1 — how many keys does each query row see?
#
# Write `visible(Q, K)` returning an array with the number of keys each of the `Q` query
# rows may see under the bottom-right causal mask. (R2's four rows should see 6, 7, 8, 9.)
#
# The check measures the answer with the golden model: with `q = 0` every score is equal,
# so attention is a plain mean over the visible keys; with value `v_j = j` that mean is
# `(n-1)/2`, and `n = 2·o + 1`.

# %% tags=["exercise"]
def visible(Q, K):
    # your code here
    raise NotImplementedError


# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
def visible(Q, K):
    return np.arange(K - Q + 1, K + 1)


# %% tags=["check"]
H, D = 1, 4
cache = np.zeros((num_pages, 2, page_size, H, D), np.float32)
for r in range(pkv.batch_size):                       # value of token t = t (every channel)
    pages, slots = pkv.token_slots(r)
    cache[pages, 1, slots] = np.arange(len(pages), dtype=np.float32)[:, None, None]
q0 = np.zeros((int(qo_indptr[-1]), H, D), np.float32)
o = ref.batch_prefill_paged(q0, cache, qo_indptr, kv_indptr, kv_indices, last_page_len, causal=True)
measured = np.rint(2 * o[:, 0, 0] + 1).astype(int)
for r in range(3):
    mine = np.asarray(visible(int(qo_lens[r]), int(kv_lens[r])))
    got = measured[qo_indptr[r]:qo_indptr[r + 1]]
    assert mine.tolist() == got.tolist(), f"R{r}: you said {mine}, the golden model sees {got}"
print("✓ rows see", measured.tolist(), "keys")

# %% [markdown]
# Paged or contiguous, the answer must be the same. Fill the cache with random K/V and compare
# `batch_prefill_paged` with `single_prefill` on each request's gathered keys:

# %%
rng = np.random.default_rng(0)
Hq, Hkv, D = 4, 2, 8                                   # GQA: two query heads per KV head
cache = rng.normal(size=(num_pages, 2, page_size, Hkv, D)).astype(np.float32)
q = rng.normal(size=(int(qo_indptr[-1]), Hq, D)).astype(np.float32)
o_paged = ref.batch_prefill_paged(q, cache, qo_indptr, kv_indptr, kv_indices, last_page_len, causal=True)
for r in range(3):
    k, v = L.gather_kv(cache, pkv, r)
    o_r = ref.single_prefill(q[qo_indptr[r]:qo_indptr[r + 1]], k, v, causal=True)
    np.testing.assert_allclose(o_paged[qo_indptr[r]:qo_indptr[r + 1]], o_r, rtol=1e-6, atol=1e-6)
print("paged == contiguous for all three requests")

# %% [markdown]
# ## 3. The page table as a BSR matrix
#
# Think of a matrix whose rows are query rows and whose columns are *all slots of the pool*
# (16 pages × 4 = 64 columns). A block of shape `(B_r, B_c) = (tile_q, page_size)` is
# non-zero when that query tile reads that page. This is block compressed sparse rows:
# `row_ptr`, `col_indices`, `block_shape`. Decode (`tile_q = 1`, one row per request):

# %%
decode_qo = np.arange(4, dtype=np.int32)               # one query row per request
bsr = L.page_table_to_bsr(decode_qo, pkv, tile_q=1)
print("row_ptr    :", bsr.row_ptr)
print("col_indices:", bsr.col_indices, " block_shape:", bsr.block_shape, " shape:", bsr.shape)
fig, ax = plt.subplots(figsize=(8, 1.4))
ax.imshow(bsr.to_block_mask(), cmap="Greys", vmin=0, vmax=1.5, aspect="auto")
ax.set_xticks(range(num_pages)); ax.set_yticks(range(3), ["R0", "R1", "R2"])
ax.set_xlabel("page id (column block)"); ax.set_title("BSR.to_block_mask(): who reads which page")
plt.show()

# %% [markdown]
# A BSR block is all-or-nothing: it does not know that the last page of each request is
# only partly used. That is why the round trip back to a page table needs the KV lengths
# (`bsr_to_page_table(bsr, qo_indptr, kv_lens)`).
#
# ### Exercise 2 — what does the BSR view over-cover?
#
# Compute `over`, the number of pool slots that `bsr.to_element_mask()` marks as read but
# that hold no token of the reading request.

# %% tags=["exercise"]
over = None   # your code here

# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
over = int(np.sum(page_size - last_page_len))

# %% tags=["check"]
element = bsr.to_element_mask()                                   # [3 rows, 64 slots]
truth = np.zeros_like(element)
for r in range(3):
    pages, slots = pkv.token_slots(r)
    truth[r, pages * page_size + slots] = True
assert not (truth & ~element).any(), "BSR must cover every real token"
assert over == int((element & ~truth).sum()), f"you said {over}"
back = L.bsr_to_page_table(bsr, decode_qo, pkv.kv_lens)
assert np.array_equal(back.paged_kv_indices, kv_indices) and np.array_equal(back.paged_kv_last_page_len, last_page_len)
print(f"✓ {over} slots over-covered; the round trip with kv_lens restores the page table")

# %% [markdown]
# With `B_c = 1` (one column per slot) a BSR view is exact, and attention over it is
# attention over the page table. `block_sparse` reads the pool *as one long KV sequence*
# and lets the mask pick the keys — no gather, no copy:

# %%
k_pool = cache[:, 0].reshape(num_pages * page_size, Hkv, D)   # a view of the pool, not a copy
v_pool = cache[:, 1].reshape(num_pages * page_size, Hkv, D)
exact = L.BSR.from_block_mask(truth, (1, 1))
q_dec = rng.normal(size=(3, Hq, D)).astype(np.float32)
o_bsr = ref.block_sparse(q_dec, k_pool, v_pool, exact)
o_dec = ref.batch_decode_paged(q_dec, cache, kv_indptr, kv_indices, last_page_len)
print("block_sparse over the pool == batch_decode_paged:", np.allclose(o_bsr, o_dec, atol=1e-6))
np.testing.assert_allclose(o_bsr, o_dec, atol=1e-6, rtol=1e-6)

import nbattn.cuda as nbcuda            # the kernel reads the same BSR view (simulator without a GPU)
ok = np.allclose(nbcuda.block_sparse(q_dec, k_pool, v_pool, exact), o_bsr, atol=TOL, rtol=TOL)
print("kernel nbattn.cuda.block_sparse == golden:", ok)
assert ok

# %% [markdown]
# ## 4. Shared prefixes and composable formats
#
# Four requests share an 8-token system prompt (pages 0 and 1, both full) and each has its
# own suffix. In one flat page table every request lists the prefix pages again, so a
# decode kernel reads them four times. `cascade_decompose` finds the shared full pages and
# builds two page tables over the same pool:
#
# * **level 0**, the shared prefix: one block row for the whole group (large `B_r`);
# * **level 1**, the unique suffixes: one block row per request.
#
# Each level gives attention states; merging them (notebook 01) gives the exact answer.

# %%
n_req, P, S = 4, 8, np.array([3, 5, 2, 6])             # prefix tokens, suffix tokens per request
prefix_pages = [0, 1]
suffix_pages = [[2], [3, 4], [5], [6, 7]]
indptr = np.concatenate([[0], np.cumsum([len(prefix_pages) + len(s) for s in suffix_pages])]).astype(np.int32)
indices = np.concatenate([prefix_pages + s for s in suffix_pages]).astype(np.int32)
last = np.array([(S[r] - 1) % page_size + 1 for r in range(n_req)], np.int32)
shared = L.PagedKV.validate(indptr, indices, last, page_size, 10)
print("kv lengths:", shared.kv_lens)

dec_qo = np.arange(n_req + 1, dtype=np.int32)
levels = L.cascade_decompose(dec_qo, shared)
for i, lv in enumerate(levels):
    print(f"level {i}: qo_indptr {lv.qo_indptr}, kv_indptr {lv.paged_kv_indptr}, "
          f"kv_indices {lv.paged_kv_indices}, last_page_len {lv.paged_kv_last_page_len}")

# %%
fig, axes = plt.subplots(1, 3, figsize=(10, 2), gridspec_kw=dict(width_ratios=[1, 1, 1]))
flat = L.page_table_to_bsr(dec_qo, shared).to_block_mask()
axes[0].imshow(flat, cmap="Greys", vmin=0, vmax=1.5); axes[0].set_title("flat: prefix read 4x")
lv0 = L.PagedKV.validate(levels[0].paged_kv_indptr, levels[0].paged_kv_indices,
                         levels[0].paged_kv_last_page_len, page_size, 10)
m0 = L.page_table_to_bsr(np.array([0, 1], np.int32), lv0).to_block_mask()
axes[1].imshow(np.repeat(m0, n_req, axis=0), cmap="Blues", vmin=0, vmax=1.5)
axes[1].set_title("level 0: one block row, B_r = 4")
lv1 = L.PagedKV.validate(levels[1].paged_kv_indptr, levels[1].paged_kv_indices,
                         levels[1].paged_kv_last_page_len, page_size, 10)
axes[2].imshow(L.page_table_to_bsr(dec_qo, lv1).to_block_mask(), cmap="Reds", vmin=0, vmax=1.5)
axes[2].set_title("level 1: unique suffixes")
for ax in axes:
    ax.set_xlabel("page id"); ax.set_ylabel("request")
plt.tight_layout(); plt.show()

# %%
cache2 = rng.normal(size=(10, 2, page_size, Hkv, D)).astype(np.float32)
q4 = rng.normal(size=(n_req, Hq, D)).astype(np.float32)
o_flat = ref.batch_decode_paged(q4, cache2, indptr, indices, last)
o_casc = ref.cascade(q4, levels, cache2)
print("cascade (two levels, merged) == flat decode:", np.allclose(o_flat, o_casc, atol=1e-6))
np.testing.assert_allclose(o_casc, o_flat, atol=1e-6, rtol=1e-6)
ok = np.allclose(nbcuda.cascade(q4, levels, cache2), o_casc, atol=TOL, rtol=TOL)
print("kernel nbattn.cuda.cascade == golden:", ok)
assert ok

# %% [markdown]
# ### Exercise 3 — the traffic you save
#
# With reuse, the prefix is read once for the group instead of once per request. Compute
# `naive` (KV tokens read by the flat table) and `reuse` (read by the cascade) for the four
# requests above, then the ratio for the paper's large case: 64 requests, a 32768-token
# prefix, 128-token suffixes (`ratio_big`).

# %% tags=["exercise"]
naive, reuse, ratio_big = None, None, None   # your code here

# %% jupyter={"source_hidden": true} tags=["solution"]
# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.
naive = int(n_req * P + S.sum())
reuse = int(P + S.sum())
ratio_big = 64 * (32768 + 128) / (32768 + 64 * 128)

# %% tags=["check"]
from nbattn.perf import roofline as rl
assert naive == int(shared.kv_lens.sum()), "naive: every request reads its full kv length"
assert reuse == int(lv0.kv_lens.sum() + lv1.kv_lens.sum()), "reuse: what the two levels read"
assert np.isclose(ratio_big, rl.prefix_traffic_ratio(64, 32768, 128))
print(f"✓ {naive} -> {reuse} tokens here; {ratio_big:.1f}x less traffic at batch 64 / prefix 32k "
      "(the paper measured a 16x kernel speedup)")

# %% [markdown]
# ## Summary
#
# * A paged cache is index arrays over a pool: `kv_indptr`, `kv_indices`, `last_page_len`.
# * Causal masks align to the bottom right: query `i` of `Q` sees keys `j <= K - Q + i`.
# * A page table *is* a BSR matrix with `B_c = page_size`; only the last page's fill needs
#   the KV lengths on the side.
# * Shared prefixes become a second, coarser BSR view of the same pages; the merge operator
#   recombines the views exactly.
