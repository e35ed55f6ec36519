"""Build the teaching notebooks of nbattn from this one reviewable Python file.

    .venv/bin/python notebooks/_build.py          # (re)write every notebook
    .venv/bin/python notebooks/_build.py --check  # exit 1 if a .ipynb is stale

Each notebook is a function returning a list of cells.  Cell helpers:

* ``md``        a markdown cell;
* ``code``      an ordinary code cell;
* ``exercise``  a code cell with a placeholder for the reader (tag ``exercise``);
* ``solution``  a worked solution, collapsed in Jupyter (tag ``solution``).
                The committed notebooks run it, so they pass top to bottom; a
                reader who wants to try skips it (or deletes it);
* ``check``     a cell that compares the reader's answer with the golden model
                or a closed form (tag ``check``).  It fails on a wrong answer.

The notebooks are written without outputs and with stable cell ids, so
regenerating them gives no diff unless this file changed.
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------
# Cell helpers
# ---------------------------------------------------------------------------

def _src(s: str) -> str:
    return textwrap.dedent(s).strip("\n")


def md(s: str):
    return new_markdown_cell(_src(s))


def code(s: str, tags=()):
    c = new_code_cell(_src(s))
    if tags:
        c.metadata["tags"] = list(tags)
    return c


def exercise(s: str):
    return code(s, tags=("exercise",))


def solution(s: str):
    c = code("# Worked solution (collapsed). Skip or delete this cell to try the exercise yourself.\n"
             + _src(s), tags=("solution",))
    c.metadata["jupyter"] = {"source_hidden": True}
    return c


def check(s: str):
    return code(s, tags=("check",))


SETUP = """
    import numpy as np
    import nbattn
    SMALL = nbattn.simulator_enabled()   # True on a laptop without a GPU: keep shapes small
    TOL = 1e-5 if SMALL else 2e-4        # kernel vs golden model, float32 (GPUs use a fast exp2)
    print(f"backend: {nbattn.BACKEND}  (small shapes: {SMALL})")
"""

GPU_NOTE = """
    The next cell says where the kernels run: numba's CUDA simulator without a GPU (tiny shapes,
    every GPU thread a Python thread), or the GPU. On a GPU, numba may print
    `NumbaPerformanceWarning: Grid size N will likely result in GPU under-utilization due to low
    occupancy` under some cells. The shapes here are small on purpose, so a kernel launches only a
    few CTAs and leaves most multiprocessors idle: the warning is about speed, not correctness, and
    the results are checked all the same.
"""


# ---------------------------------------------------------------------------
# 01: online softmax and the merge operator
# ---------------------------------------------------------------------------

def nb01():
    return [
        md("""
        # 01 · Online softmax and the merge operator

        **What you will learn**

        1. What an *attention state* `(o, lse)` is, and why nbattn keeps the log-sum-exp in **base 2**.
        2. The merge operator that combines the states of two disjoint key sets, worked by hand
           on two small examples (the documentation's page *The attention state and its merge*).
        3. Why averaging partial outputs is wrong, and by how much.
        4. The corner cases every kernel must get right: empty key sets (`lse = -inf`) and
           huge logits (±1000) that overflow a naive `exp`.
        5. Online softmax as "merge one tile at a time", and how to convert a natural-log LSE.

        Everything here runs on the NumPy golden model (`nbattn.reference`); the last section runs
        the same operator as a numba.cuda kernel (in the simulator when there is no GPU).
        Exercises have a placeholder cell, a collapsed worked solution, and a check cell.
        """),
        md(GPU_NOTE),
        code(SETUP + """
    from nbattn.reference import (merge_state, merge_states, split_kv, single_decode,
                                  lse_natural_to_base2, lse_base2_to_natural)
    np.set_printoptions(precision=4, suppress=True)
    """),
        md("""
        ## 1. The attention state

        One query attends over a key set $A$ with scores $s_j$ and value vectors $v_j$.
        The result we keep is a pair:

        $$o_A = \\frac{\\sum_{j\\in A} e^{s_j} v_j}{\\sum_{j\\in A} e^{s_j}}, \\qquad
          \\mathrm{lse}_A = \\log_2 \\sum_{j \\in A} e^{s_j}.$$

        `o_A` is already normalized; `lse_A` remembers *how much softmax mass* the set carried.
        The scores use the natural `e`, the statistic is base 2: GPUs have a fast `exp2`
        instruction, so kernels fold $\\log_2 e$ into the scale once and work in base 2 throughout.

        Here is the state, written directly from the definition (float64, one query):
        """),
        code("""
    def state(scores, values):
        \"\"\"(o, lse) of one query over a key set; lse in base 2. Empty set -> (0, -inf).\"\"\"
        s = np.asarray(scores, dtype=np.float64)
        v = np.asarray(values, dtype=np.float64).reshape(len(s), -1)
        if len(s) == 0:
            return np.zeros(v.shape[1]), -np.inf
        m = s.max()                      # subtract the max: exp never overflows
        p = np.exp(s - m)
        o = (p[:, None] * v).sum(0) / p.sum()
        lse = (m + np.log(p.sum())) / np.log(2)
        return o, lse

    scores = np.array([1.0, 2.0, 3.0, 4.0])
    values = np.array([10.0, 20.0, 30.0, 40.0])
    o_all, lse_all = state(scores, values)
    print("o =", o_all, " lse =", lse_all)
    """),
        md("""
        ## 2. Merging two states

        For *disjoint* key sets $A$ and $B$:

        ```
        m = max(lse_A, lse_B);  a = 2^(lse_A - m);  b = 2^(lse_B - m)
        o = (a*o_A + b*o_B) / (a + b);   lse = m + log2(a + b)
        ```

        `a` and `b` are the two sets' softmax masses, rescaled so the larger is exactly 1
        (nothing overflows). **Worked example.** Merge `(o=[1,0], lse=2)` with `(o=[0,1], lse=1)`:
        `m = 2`, `a = 1`, `b = 0.5`, so `o = [1, 0.5] / 1.5 = [2/3, 1/3]` and
        `lse = 2 + log2(1.5) ≈ 2.585`. The golden model agrees:
        """),
        code("""
    o, lse = merge_state(np.array([1.0, 0.0]), np.array(2.0), np.array([0.0, 1.0]), np.array(1.0))
    print("o =", o, " lse =", lse)
    assert np.allclose(o, [2 / 3, 1 / 3]) and np.isclose(lse, 2 + np.log2(1.5))
    """),
        md("""
        **Second worked example.** Scores `[1, 2, 3, 4]`, values `[10, 20, 30, 40]`, split into
        halves. Each half is a small attention of its own:

        * first half: `10 + 10·e/(1+e) ≈ 17.31`, second half: `30 + 10·e/(1+e) ≈ 37.31`;
        * the second half carries `e²` times more mass, so the merge is
          `17.31 + 20·e²/(1+e²) ≈ 34.93`, exactly the answer over all four keys.
        """),
        code("""
    oA, lseA = state(scores[:2], values[:2])
    oB, lseB = state(scores[2:], values[2:])
    o_merged, lse_merged = merge_state(oA, np.array(lseA), oB, np.array(lseB))
    print(f"halves: {oA[0]:.2f}, {oB[0]:.2f}   merged: {o_merged[0]:.2f}   "
          f"all keys at once: {o_all[0]:.2f}   average: {(oA[0] + oB[0]) / 2:.2f}")
    assert np.isclose(o_merged[0], o_all[0]) and np.isclose(lse_merged, lse_all)
    """),
        md("""
        The golden model's FlashDecoding form `split_kv` does exactly this: attend each KV
        chunk separately, then merge the partial states in chunk order. With `head_dim = 1`,
        `q = 1` and `sm_scale = 1` the scores are the keys themselves:
        """),
        code("""
    q = np.ones((1, 1, 1), np.float32)                 # [rows, heads, head_dim]
    k = scores.astype(np.float32).reshape(4, 1, 1)     # [kv_len, kv_heads, head_dim]
    v = values.astype(np.float32).reshape(4, 1, 1)
    chunks = np.array([0, 2, 4], np.int32)             # two chunks: keys 0..1 and 2..3
    o, lse, (part_o, part_lse) = split_kv(q, k, v, chunks, sm_scale=1.0,
                                          return_lse=True, return_partials=True)
    print("partial outputs:", part_o.ravel(), " partial lse:", part_lse.ravel())
    print("merged:", o.ravel(), " lse:", lse.ravel())
    """),
        md("""
        ## 3. Why averaging is wrong

        Averaging gives each half weight ½. The right weights are the halves' shares of the
        softmax mass, `2^lse_A / (2^lse_A + 2^lse_B)`; here `1/(1+e²) ≈ 0.12` and `≈ 0.88`.
        The average (≈ 27.3) is off by more than 7.
        """),
        code("""
    w = 2.0 ** np.array([lseA, lseB])
    w /= w.sum()
    print("correct weights:", w, "-> weighted:", w @ [oA[0], oB[0]], "  averaged:", (oA[0] + oB[0]) / 2)
    """),
        md("""
        ### Exercise 1 — write the merge yourself

        Implement `my_merge(o_a, lse_a, o_b, lse_b)` for one query: `o_*` are vectors,
        `lse_*` floats (base 2). It must handle empty states (`lse = -inf`, `o = 0`): merging
        with an empty state returns the other one, and two empty states give an empty state,
        never NaN.
        """),
        exercise("""
    def my_merge(o_a, lse_a, o_b, lse_b):
        # your code here: return (o, lse)
        raise NotImplementedError
    """),
        solution("""
    def my_merge(o_a, lse_a, o_b, lse_b):
        m = max(lse_a, lse_b)
        if m == -np.inf:                       # both empty
            return np.zeros_like(o_a), -np.inf
        a, b = 2.0 ** (lse_a - m), 2.0 ** (lse_b - m)
        return (a * o_a + b * o_b) / (a + b), m + np.log2(a + b)
    """),
        check("""
    rng = np.random.default_rng(1)
    for trial in range(200):
        d = 4
        o_a, o_b = rng.normal(size=d), rng.normal(size=d)
        lse_a, lse_b = rng.normal(scale=30, size=2)
        if trial % 5 == 1: lse_a, o_a = -np.inf, np.zeros(d)
        if trial % 5 == 2: lse_b, o_b = -np.inf, np.zeros(d)
        if trial % 5 == 3: lse_a = lse_b = -np.inf; o_a = o_b = np.zeros(d)
        got_o, got_lse = my_merge(o_a, lse_a, o_b, lse_b)
        want_o, want_lse = merge_state(o_a, np.array(lse_a), o_b, np.array(lse_b))
        assert np.all(np.isfinite(got_o)), "NaN or inf in the output"
        np.testing.assert_allclose(got_o, want_o, rtol=1e-12, atol=1e-12)
        assert got_lse == want_lse or np.isclose(got_lse, want_lse, rtol=1e-12)
    print("✓ my_merge matches nbattn.reference.merge_state, empty states included")
    """),
        md("""
        ## 4. Empty states

        A chunk whose keys are all masked (or a request with no keys) has no softmax mass:
        `o = 0`, `lse = -inf`. The textbook formula then computes `-inf - (-inf)` and returns NaN;
        `merge_state` guards `m = -inf` and returns the other state unchanged.
        """),
        code("""
    empty_o, empty_lse = np.zeros(2), np.array(-np.inf)
    full_o, full_lse = np.array([3.0, 4.0]), np.array(5.0)
    with np.errstate(invalid="ignore"):
        m = np.maximum(empty_lse, empty_lse)
        naive = 2 ** (empty_lse - m)           # -inf - -inf = nan
    print("naive weight of two empties:", naive)
    print("empty + full  ->", merge_state(empty_o, empty_lse, full_o, full_lse))
    print("empty + empty ->", merge_state(empty_o, empty_lse, empty_o, empty_lse))
    """),
        md("""
        ## 5. Overflow: logits of ±1000

        `exp(1000)` overflows float32 and float64 alike, so softmax written literally returns NaN.
        Subtracting the maximum first (what `state` and the golden model do) keeps every
        exponent ≤ 0. The merge inherits this: it only ever evaluates `2^(lse - m) ≤ 1`.
        """),
        code("""
    big = np.array([1000.0, -1000.0, 999.0])
    vals = np.array([1.0, 2.0, 3.0])
    with np.errstate(over="ignore", invalid="ignore"):
        literal = (np.exp(big) * vals).sum() / np.exp(big).sum()
    o_big, lse_big = state(big, vals)
    print("literal softmax:", literal, "   max-subtracted:", o_big, "  lse:", lse_big)

    # the same keys through the golden model, and split in two chunks
    qb = np.ones((1, 1, 1), np.float32)
    kb = big.astype(np.float32).reshape(3, 1, 1)
    vb = vals.astype(np.float32).reshape(3, 1, 1)
    print("single_decode:", single_decode(qb[0], kb, vb, sm_scale=1.0).ravel(),
          "  split_kv:", split_kv(qb, kb, vb, np.array([0, 1, 3], np.int32), sm_scale=1.0).ravel())
    """),
        md("""
        ## 6. Online softmax is merging, one tile at a time

        A kernel cannot hold all `K` scores of a long context. It walks the keys in tiles and
        keeps a running state; absorbing a tile *is* a merge of the running state with the
        tile's state. Kernels usually keep an un-normalized accumulator `acc`, the running
        max `m` and denominator `d` (all base 2 here) and divide once at the end; it is the
        same algebra.

        ### Exercise 2 — online softmax over tiles

        Write `online_softmax(s, v, tile)` for one query: scores `s[K]`, values `v[K, D]`.
        Visit the keys `tile` at a time, keep `(m, d, acc)` and return `(o, lse)` with `lse` in
        base 2. Do not compute a max over all `K` keys up front.
        """),
        exercise("""
    def online_softmax(s, v, tile):
        # your code here: return (o, lse_base2)
        raise NotImplementedError
    """),
        solution("""
    def online_softmax(s, v, tile):
        log2e = 1.0 / np.log(2.0)
        m, d, acc = -np.inf, 0.0, np.zeros(v.shape[1])
        for start in range(0, len(s), tile):
            t = s[start:start + tile] * log2e            # base-2 scores of this tile
            m_new = max(m, t.max())
            scale = 2.0 ** (m - m_new) if m > -np.inf else 0.0
            p = 2.0 ** (t - m_new)
            d = d * scale + p.sum()
            acc = acc * scale + p @ v[start:start + tile]
            m = m_new
        return acc / d, m + np.log2(d)
    """),
        check("""
    rng = np.random.default_rng(2)
    for K, D, tile in [(1, 3, 4), (37, 8, 5), (64, 16, 64), (100, 4, 7)]:
        s_t = rng.normal(scale=8, size=K); v_t = rng.normal(size=(K, D))
        o, lse = online_softmax(s_t, v_t, tile)
        # golden model: q = e_0 and k[:, 0] = s make the scores q.k exactly s
        q_t = np.zeros((1, D)); q_t[0, 0] = 1.0
        k_t = np.zeros((K, 1, D)); k_t[:, 0, 0] = s_t
        want_o, want_lse = single_decode(q_t, k_t, v_t[:, None, :], sm_scale=1.0, return_lse=True,
                                         dtype=np.float64)
        np.testing.assert_allclose(o, want_o[0], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse[0], rtol=1e-12)
    print("✓ online_softmax matches single_decode for every tile size")
    """),
        md("""
        ## 7. Natural vs base-2 LSE

        PyTorch's `logsumexp` and most papers report `ln Σ e^s`. nbattn's states use
        `log2 Σ e^s = ln Σ e^s / ln 2`: divide once when importing a natural LSE
        (`lse_natural_to_base2`), multiply when exporting (`lse_base2_to_natural`). Mixing the
        two silently distorts the weights: a natural LSE is `ln 2 ≈ 0.69` times the base-2 one,
        so read as base 2 it shrinks that set's mass and the merge under-weights it.

        ### Exercise 3 — import a natural-log state

        The state `(oA_nat, lseA_nat)` below comes from a library that reports a natural-log LSE
        over keys 0..1.
        Merge it with the base-2 state of keys 2..3 so that the result equals attention over
        all four keys. Put the merged output into `o_fixed`.
        """),
        code("""
    oA_nat, lseA_nat = oA, lseA * np.log(2.0)        # what the other library hands you
    print(f"natural lse {lseA_nat:.4f}  vs base-2 lse {lseA:.4f}")
    o_wrong, _ = merge_state(oA_nat, np.array(lseA_nat), oB, np.array(lseB))
    print("merging without converting:", o_wrong, " (should be", o_all, ")")
    """),
        exercise("""
    o_fixed = None   # your code here: merge (oA_nat, lseA_nat) with (oB, lseB) correctly
    """),
        solution("""
    o_fixed, _ = merge_state(oA_nat, np.array(lse_natural_to_base2(lseA_nat)), oB, np.array(lseB))
    """),
        check("""
    assert o_fixed is not None, "set o_fixed"
    np.testing.assert_allclose(o_fixed, o_all, rtol=1e-12)
    assert np.isclose(lse_base2_to_natural(lse_all), np.log(np.exp(scores).sum()))
    print("✓ converted once, merged correctly:", o_fixed)
    """),
        md("""
        ## 8. Order, overlap and sigmoid

        * **Order.** The merge is associative and commutative in exact arithmetic, not in
          float32. The planner therefore fixes the order of every reduction (no atomics): the
          same lengths give bitwise the same output.
        * **Overlap.** Merging a state with itself keeps `o` but adds 1 to `lse` (the mass
          doubled). Key sets must be a *partition*, or keys are double-counted.
        * **Sigmoid attention** has no softmax and no LSE: its partial outputs simply add.
        """),
        code("""
    rng = np.random.default_rng(3)
    n = 64
    po = rng.normal(size=(1, n, 1, 8)).astype(np.float32)
    pl = (rng.normal(size=(1, n, 1)) * 10).astype(np.float32)
    fwd = merge_states(po, pl).o
    rev = merge_states(po[:, ::-1].copy(), pl[:, ::-1].copy()).o
    same = np.array_equal(fwd, merge_states(po, pl).o)
    print("same order twice bitwise equal:", same)
    assert same
    print("reversed order, max difference:", np.abs(fwd - rev).max(), "(float32 rounding)")
    np.testing.assert_allclose(fwd, rev, rtol=1e-5, atol=1e-6)     # equal up to float32 rounding

    o_dup, lse_dup = merge_state(oA, np.array(lseA), oA, np.array(lseA))
    print("A merged with itself: o unchanged", np.allclose(o_dup, oA), "; lse grew by", lse_dup - lseA)
    np.testing.assert_allclose(o_dup, oA, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(lse_dup - lseA, 1.0, rtol=1e-6)    # base 2: two equal halves add one

    o_sig = split_kv(q, k, v, chunks, sm_scale=1.0, use_sigmoid=True)
    o_sig_parts = sum(split_kv(q, k[a:b], v[a:b], np.array([0, b - a], np.int32), sm_scale=1.0,
                               use_sigmoid=True) for a, b in [(0, 2), (2, 4)])
    print("sigmoid: whole", o_sig.ravel(), " = sum of parts", o_sig_parts.ravel())
    """),
        md("""
        ## 9. The same operator on the device

        `nbattn.cuda.merge_state` / `merge_states` take the golden model's arguments and run as
        numba.cuda kernels (in the simulator here). The worked example, and a batch of awkward
        rows — a real state next to an empty one, LSEs of ±1000, nothing but empty states:
        """),
        code("""
    import nbattn.cuda as nbcuda
    o_dev, lse_dev = nbcuda.merge_state(np.array([[1, 0]], np.float32), np.array([2], np.float32),
                                        np.array([[0, 1]], np.float32), np.array([1], np.float32))
    print("device merge of the worked example:", o_dev, lse_dev)

    v = np.zeros((3, 2, 1, 4), np.float32)               # [rows, num_states, heads, head_dim]
    s = np.full((3, 2, 1), -np.inf, np.float32)          # every state empty to start with
    v[0, 0], s[0, 0] = 1.0, 3.0                          # row 0: a real state and an empty one
    v[1, 0], s[1, 0], v[1, 1], s[1, 1] = 5.0, -1000.0, 2.0, 1000.0   # row 1: extreme LSEs
    dev, gold = nbcuda.merge_states(v, s), merge_states(v, s)
    print("device o[:, head 0, 0]:", dev.o[:, 0, 0], " lse:", dev.lse[:, 0])
    assert np.allclose(dev.o, gold.o, atol=TOL, rtol=TOL) and np.array_equal(np.isneginf(dev.lse), np.isneginf(gold.lse))
    assert not np.isnan(dev.o).any()
    """),
        md("""
        ## Summary

        * A state is `(o, lse₂)`; merging two disjoint states weights them by their softmax mass.
        * Empty states are `(0, -inf)` and merge to the identity; max-subtraction keeps ±1000 safe.
        * Online softmax, split-KV (FlashDecoding) and cascade attention are all "compute states,
          then merge". Notebook 02 shows *which* key sets a batch produces; notebook 03 runs the
          merge on the GPU (or the simulator).
        """),
    ]


# ---------------------------------------------------------------------------
# 02: paged KV cache and BSR views
# ---------------------------------------------------------------------------

def nb02():
    return [
        md("""
        # 02 · Paged KV cache, causal masks and BSR views

        **What you will learn**

        1. How a paged KV cache stores requests in a pool of fixed-size pages, using the
           three-request batch of the documentation's *Layouts* page (page size 4).
        2. Bottom-right aligned causal masks for requests that append several tokens.
        3. The same page table seen as a **block-sparse (BSR) matrix**: `nbattn.layout.page_table_to_bsr`,
           `BSR.to_block_mask`, and attention over a BSR view (`nbattn.reference.block_sparse`).
        4. Shared prefixes as **composable formats**: `nbattn.layout.cascade_decompose` splits one
           page table into a shared-prefix view and a unique-suffix view, and the merge of notebook 01
           puts the two back together.

        Only index arrays are built here; the KV data is never copied into a new layout. The
        kernels `nbattn.cuda.block_sparse` and `nbattn.cuda.cascade` read the very same views.
        """),
        md(GPU_NOTE),
        code(SETUP + """
    import matplotlib.pyplot as plt
    from nbattn import layout as L
    from nbattn import reference as ref
    """),
        md("""
        ## 1. The three-request batch

        | request | prefix (already cached) | new tokens (queries) | KV length |
        |---|---|---|---|
        | R0 | 3 | 3 | 6 |
        | R1 | 1 | 1 | 2 |
        | R2 | 5 | 4 | 9 |

        Queries are *ragged*: packed back to back, row ranges given by `qo_indptr`.
        KV lives in pages of 4 slots; request `r` owns pages
        `kv_indices[kv_indptr[r]:kv_indptr[r+1]]` in logical order, and only
        `last_page_len[r]` slots of its last page are used. Pages need not be sorted.
        """),
        code("""
    page_size, num_pages = 4, 16
    qo_indptr = np.array([0, 3, 4, 8], np.int32)
    kv_indptr = np.array([0, 2, 3, 6], np.int32)
    kv_indices = np.array([7, 2, 11, 3, 14, 6], np.int32)
    last_page_len = np.array([2, 2, 1], np.int32)

    pkv = L.PagedKV.validate(kv_indptr, kv_indices, last_page_len, page_size, num_pages)
    print("kv lengths:", pkv.kv_lens, "  query lengths:", L.RaggedQ(qo_indptr).lengths)
    print("R2 token 5 lives in (page, slot) =", [int(x) for x in pkv.locate(2, 5)])
    print("R2 last token (8) lives in       =", [int(x) for x in pkv.locate(2, 8)])
    """),
        md("""
        Drawn: the pool of 16 pages × 4 slots. Each used slot shows `request:token`; grey slots
        are free or the unused tail of a last page.
        """),
        code("""
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
    """),
        md("""
        The layout module rejects bad metadata *before* any kernel runs, naming the argument:
        """),
        code("""
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
    """),
        md("""
        ## 2. Causal masks, bottom-right aligned

        A request's queries are its *last* `Q` tokens, so local query `i` may see key `j` iff
        `j <= K - Q + i`. For a decode step (`Q = 1`) that is every key.
        """),
        code("""
    kv_lens, qo_lens = pkv.kv_lens, np.diff(qo_indptr)
    fig, axes = plt.subplots(1, 3, figsize=(9, 2.4))
    for r, ax in enumerate(axes):
        Q, K = int(qo_lens[r]), int(kv_lens[r])
        i, j = np.arange(Q)[:, None], np.arange(K)[None, :]
        ax.imshow(j <= K - Q + i, cmap="Blues", vmin=0, vmax=1.3)
        ax.set_title(f"R{r}: Q={Q}, K={K}"); ax.set_xlabel("key j"); ax.set_ylabel("query i")
        ax.set_xticks(range(K)); ax.set_yticks(range(Q))
    plt.tight_layout(); plt.show()
    """),
        md("""
        ### Exercise 1 — how many keys does each query row see?

        Write `visible(Q, K)` returning an array with the number of keys each of the `Q` query
        rows may see under the bottom-right causal mask. (R2's four rows should see 6, 7, 8, 9.)

        The check measures the answer with the golden model: with `q = 0` every score is equal,
        so attention is a plain mean over the visible keys; with value `v_j = j` that mean is
        `(n-1)/2`, and `n = 2·o + 1`.
        """),
        exercise("""
    def visible(Q, K):
        # your code here
        raise NotImplementedError
    """),
        solution("""
    def visible(Q, K):
        return np.arange(K - Q + 1, K + 1)
    """),
        check("""
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
    """),
        md("""
        Paged or contiguous, the answer must be the same. Fill the cache with random K/V and compare
        `batch_prefill_paged` with `single_prefill` on each request's gathered keys:
        """),
        code("""
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
    """),
        md("""
        ## 3. The page table as a BSR matrix

        Think of a matrix whose rows are query rows and whose columns are *all slots of the pool*
        (16 pages × 4 = 64 columns). A block of shape `(B_r, B_c) = (tile_q, page_size)` is
        non-zero when that query tile reads that page. This is block compressed sparse rows:
        `row_ptr`, `col_indices`, `block_shape`. Decode (`tile_q = 1`, one row per request):
        """),
        code("""
    decode_qo = np.arange(4, dtype=np.int32)               # one query row per request
    bsr = L.page_table_to_bsr(decode_qo, pkv, tile_q=1)
    print("row_ptr    :", bsr.row_ptr)
    print("col_indices:", bsr.col_indices, " block_shape:", bsr.block_shape, " shape:", bsr.shape)
    fig, ax = plt.subplots(figsize=(8, 1.4))
    ax.imshow(bsr.to_block_mask(), cmap="Greys", vmin=0, vmax=1.5, aspect="auto")
    ax.set_xticks(range(num_pages)); ax.set_yticks(range(3), ["R0", "R1", "R2"])
    ax.set_xlabel("page id (column block)"); ax.set_title("BSR.to_block_mask(): who reads which page")
    plt.show()
    """),
        md("""
        A BSR block is all-or-nothing: it does not know that the last page of each request is
        only partly used. That is why the round trip back to a page table needs the KV lengths
        (`bsr_to_page_table(bsr, qo_indptr, kv_lens)`).

        ### Exercise 2 — what does the BSR view over-cover?

        Compute `over`, the number of pool slots that `bsr.to_element_mask()` marks as read but
        that hold no token of the reading request.
        """),
        exercise("""
    over = None   # your code here
    """),
        solution("""
    over = int(np.sum(page_size - last_page_len))
    """),
        check("""
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
    """),
        md("""
        With `B_c = 1` (one column per slot) a BSR view is exact, and attention over it is
        attention over the page table. `block_sparse` reads the pool *as one long KV sequence*
        and lets the mask pick the keys — no gather, no copy:
        """),
        code("""
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
    """),
        md("""
        ## 4. Shared prefixes and composable formats

        Four requests share an 8-token system prompt (pages 0 and 1, both full) and each has its
        own suffix. In one flat page table every request lists the prefix pages again, so a
        decode kernel reads them four times. `cascade_decompose` finds the shared full pages and
        builds two page tables over the same pool:

        * **level 0**, the shared prefix: one block row for the whole group (large `B_r`);
        * **level 1**, the unique suffixes: one block row per request.

        Each level gives attention states; merging them (notebook 01) gives the exact answer.
        """),
        code("""
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
    """),
        code("""
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
    """),
        code("""
    cache2 = rng.normal(size=(10, 2, page_size, Hkv, D)).astype(np.float32)
    q4 = rng.normal(size=(n_req, Hq, D)).astype(np.float32)
    o_flat = ref.batch_decode_paged(q4, cache2, indptr, indices, last)
    o_casc = ref.cascade(q4, levels, cache2)
    print("cascade (two levels, merged) == flat decode:", np.allclose(o_flat, o_casc, atol=1e-6))
    np.testing.assert_allclose(o_casc, o_flat, atol=1e-6, rtol=1e-6)
    ok = np.allclose(nbcuda.cascade(q4, levels, cache2), o_casc, atol=TOL, rtol=TOL)
    print("kernel nbattn.cuda.cascade == golden:", ok)
    assert ok
    """),
        md("""
        ### Exercise 3 — the traffic you save

        With reuse, the prefix is read once for the group instead of once per request. Compute
        `naive` (KV tokens read by the flat table) and `reuse` (read by the cascade) for the four
        requests above, then the ratio for the paper's large case: 64 requests, a 32768-token
        prefix, 128-token suffixes (`ratio_big`).
        """),
        exercise("""
    naive, reuse, ratio_big = None, None, None   # your code here
    """),
        solution("""
    naive = int(n_req * P + S.sum())
    reuse = int(P + S.sum())
    ratio_big = 64 * (32768 + 128) / (32768 + 64 * 128)
    """),
        check("""
    from nbattn.perf import roofline as rl
    assert naive == int(shared.kv_lens.sum()), "naive: every request reads its full kv length"
    assert reuse == int(lv0.kv_lens.sum() + lv1.kv_lens.sum()), "reuse: what the two levels read"
    assert np.isclose(ratio_big, rl.prefix_traffic_ratio(64, 32768, 128))
    print(f"✓ {naive} -> {reuse} tokens here; {ratio_big:.1f}x less traffic at batch 64 / prefix 32k "
          "(the paper measured a 16x kernel speedup)")
    """),
        md("""
        ## Summary

        * A paged cache is index arrays over a pool: `kv_indptr`, `kv_indices`, `last_page_len`.
        * Causal masks align to the bottom right: query `i` of `Q` sees keys `j <= K - Q + i`.
        * A page table *is* a BSR matrix with `B_c = page_size`; only the last page's fill needs
          the KV lengths on the side.
        * Shared prefixes become a second, coarser BSR view of the same pages; the merge operator
          recombines the views exactly.
        """),
    ]


# ---------------------------------------------------------------------------
# 03: the decode kernel
# ---------------------------------------------------------------------------

def nb03():
    return [
        md("""
        # 03 · The decode kernel

        **What you will learn**

        1. Why decode is about *reading bytes once*: one query row per request against its whole
           KV history (notebook 04 puts a number on it).
        2. **Shared-memory gather**: a CTA (cooperative thread array — a CUDA thread block) copies a tile of keys from scattered pages into
           shared memory, then every thread computes from there. You will write the index math
           of a small gather kernel in numba.cuda.
        3. **GQA fusion**: the query heads that share a KV head are handled by one CTA, so each
           KV tile is loaded once for the whole group.
        4. **Split-KV** (FlashDecoding): long requests are cut into chunks whose partial states are
           merged in a fixed order — the merge operator of notebook 01, on the device.
        5. All of it checked against the golden model, here in the notebook.

        Kernels used: `nbattn.cuda.batch_decode_paged`, the building blocks of `nbattn.cuda.decode`
        (`prepare_decode`, `split_work`, `WorkList`, `run_decode_work`) and `nbattn.cuda.merge_states`.
        Without a GPU they run in numba's CUDA simulator (every thread is a Python thread), so the
        shapes stay small.
        """),
        md(GPU_NOTE),
        code(SETUP + """
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
    """),
        md("""
        ## 1. Shared-memory gather

        A request's keys are scattered over pages. A decode CTA walks its keys in tiles of `TILE`
        tokens: the threads first copy the tile from global memory into a `cuda.shared.array`
        (each thread one element; on a GPU each thread moves 16 bytes at a time), synchronize, and
        then compute scores and `p·V` from shared memory. The copy is where the page table is read.

        The toy kernel below does only the gather, for one head, and writes each tile back out
        contiguously so we can check it. Grid: one CTA per (request, tile); threads: (token in tile, element of
        `head_dim`).

        ### Exercise 1 — the index math

        Write the device function `locate(kv_indices, first_page, t)`: logical token `t` of a
        request whose page list starts at `kv_indices[first_page]` lives in which `(page, slot)`?
        (`PAGE_SIZE` is a global constant.)
        """),
        code("""
    PAGE_SIZE, TILE, DG = page_size, 4, 8           # DG: head_dim of this toy
    cache_toy = rng.normal(size=(num_pages, 2, PAGE_SIZE, 1, DG)).astype(np.float32)
    """),
        exercise("""
    @cuda.jit(device=True)
    def locate(kv_indices, first_page, t):
        # your code here: return page, slot
        return 0, 0
    """),
        solution("""
    @cuda.jit(device=True)
    def locate(kv_indices, first_page, t):
        return kv_indices[first_page + t // PAGE_SIZE], t % PAGE_SIZE
    """),
        code("""
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
    """),
        check("""
    for r in range(pkv.batch_size):
        k_gold, _ = L.gather_kv(cache_toy, pkv, r)
        np.testing.assert_array_equal(out[out_indptr[r]:out_indptr[r + 1]], k_gold[:, 0],
                                      err_msg=f"request {r}: wrong page or slot")
    print("✓ the kernel gathered every key of every request from the right page and slot")
    """),
        md("""
        ## 2. nbattn's decode kernel

        `nbattn.cuda.batch_decode_paged` takes exactly the golden model's arguments. Inside, a
        CTA owns one work item and a group of query heads; per KV tile it gathers K and V into
        shared memory, computes the scores of all its heads, runs the online softmax in base 2 and
        accumulates `p·V`. We use GQA with 4 query heads per KV head:
        """),
        code("""
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
    """),
        md("""
        How the kernel is configured for this call (`prepare_decode` validates everything and moves
        the arrays to the device; nothing launches yet):
        """),
        code("""
    prob = dec.prepare_decode(q, cache, *table, return_lse=True)
    cfg = prob.config()
    print(f"group = {prob.group}: heads per CTA = {cfg.heads_per_cta}, threads per CTA = {cfg.nthreads}, "
          f"tokens per KV tile = {cfg.tile_tokens}")
    """),
        md("""
        ### Exercise 2 — what GQA fusion saves

        If every query head were handled by its own CTA, each CTA would load its KV head's
        keys and values again: the KV traffic is multiplied by the group. Compute, for this batch
        in fp16 (`b = 2`), the minimal bytes of the performance model *with* fusion (`fused`) and the bytes
        a one-head-per-CTA kernel would move (`unfused`: as if there were `Hq` KV heads).
        """),
        exercise("""
    fused, unfused = None, None   # your code here (bytes, summed over the batch)
    """),
        solution("""
    l = big.kv_lens.astype(np.int64)
    fused = int(np.sum(2 * D * (Hq + 2 * l * Hkv + Hq)))
    unfused = int(np.sum(2 * D * (Hq + 2 * l * Hq + Hq)))
    """),
        check("""
    assert fused == int(np.sum(rl.attention_bytes(1, big.kv_lens, D, Hq, Hkv)))
    assert unfused == int(np.sum(rl.attention_bytes(1, big.kv_lens, D, Hq, Hq)))
    print(f"✓ {unfused / fused:.2f}x fewer bytes with fusion (→ group = {Hq // Hkv} for long contexts)")
    """),
        md("""
        ## 3. Split-KV: partial states and the merge

        With few requests, a decode step has too few CTAs to keep every SM busy. FlashDecoding
        cuts each long KV range into chunks, one work item each. Items of a split request write a
        **partial state** `(o, lse)` into a slot; a merge kernel then folds each request's slots
        in KV order. `split_work` builds that work list and its reduction map:
        """),
        code("""
    chunk = 4 if SMALL else 1024
    (cta_indptr, request, kv_start, kv_end, out_slot,
     merge_indptr, merge_row, merge_slots, n_slots) = dec.split_work(big.kv_lens, chunk)
    for i in range(min(len(request), 8)):
        dest = f"slot {out_slot[i]}" if out_slot[i] >= 0 else "final output"
        print(f"item {i}: request {request[i]} keys [{kv_start[i]}, {kv_end[i]}) -> {dest}")
    print("reduction map:", [(int(merge_row[m]), merge_slots[merge_indptr[m]:merge_indptr[m + 1]].tolist())
                             for m in range(min(len(merge_row), 4))])
    """),
        code("""
    def run_items(prob):
        \"\"\"Launch the decode kernel over the split work list; return partial states (host).\"\"\"
        work = dec.WorkList(*(cuda.to_device(a) for a in (cta_indptr, request, kv_start, kv_end, out_slot)))
        part_o = cuda.device_array((n_slots, Hq, D), np.float32)
        part_lse = cuda.device_array((n_slots, Hq), np.float32)
        dec.run_decode_work(prob, work, part_o, part_lse)
        return part_o.copy_to_host(), part_lse.copy_to_host()

    prob = dec.prepare_decode(q, cache, *table, return_lse=True)
    part_o, part_lse = run_items(prob)
    direct = prob.out_dev.copy_to_host()        # rows of unsplit requests were written directly
    print("partial states:", part_o.shape, part_lse.shape)
    """),
        md("""
        ### Exercise 3 — finish the split

        Build `o_split [batch, Hq, D]`: rows of unsplit requests come from `direct`; for each entry
        `m` of the reduction map, merge the slots `merge_slots[merge_indptr[m]:merge_indptr[m+1]]`
        **in that order** with `ref.merge_states` (shapes: `v [rows, num_states, H, D]`,
        `s [rows, num_states, H]`) and put the result in row `merge_row[m]`.
        """),
        exercise("""
    o_split = None   # your code here
    """),
        solution("""
    o_split = direct.copy()
    for m in range(len(merge_row)):
        slots = merge_slots[merge_indptr[m]:merge_indptr[m + 1]]
        o_split[merge_row[m]] = ref.merge_states(part_o[slots][None], part_lse[slots][None]).o[0]
    """),
        check("""
    np.testing.assert_allclose(o_split, o_g, atol=TOL, rtol=TOL)
    # the same fold on the device: nbattn.cuda.merge_states has the golden signature
    m = 0
    slots = merge_slots[merge_indptr[m]:merge_indptr[m + 1]]
    dev = nbcuda.merge_states(part_o[slots][None], part_lse[slots][None])
    np.testing.assert_allclose(dev.o[0], o_split[merge_row[m]], atol=TOL, rtol=TOL)
    print(f"✓ {len(merge_row)} split requests merged from {n_slots} partial states; equals the golden model")
    """),
        md("""
        The fold order is fixed by the map, never by which CTA finishes first (no atomics), so
        running the same work twice gives **bitwise** the same partials:
        """),
        code("""
    again_o, again_lse = run_items(dec.prepare_decode(q, cache, *table, return_lse=True))
    same = np.array_equal(again_o, part_o) and np.array_equal(again_lse, part_lse)
    print("bitwise identical partial states:", same)
    assert same
    """),
        md("""
        Why bother? A single long request is the worst case for an unsplit decode: a handful of
        CTAs pull every byte while the rest of the GPU idles. `benchmarks/gpu_decode.py` measured
        both on a GPU; when `benchmarks/results/decode.json` is present, here is the achieved
        bandwidth as a fraction of the device's copy bandwidth (the performance model's yardstick), unsplit vs split:
        """),
        code("""
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
    """),
        md("""
        Split, the single request reaches most of the copy bandwidth, but not all of it. A
        memory-bound kernel's bandwidth is the bytes it keeps *in flight* divided by how long a
        load takes to come back (Little's law), and a kernel can only keep in flight what its
        registers (or shared memory) can receive. `benchmarks/gpu_read_floor.py` measured a
        kernel that does nothing but read the same 134 MB, with up to 8 loads of 16 bytes in flight
        per thread, over grids that hold more or fewer of them per SM:
        """),
        code("""
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
    """),
        md("""
        The tensor-core decode kernel of the batch-1 case keeps about 64 KB per SM in flight (8
        warps, each with one step of K and V, 16 tokens x 256 bytes each); its registers are
        nearly all used. Going further means staging loads in shared memory (`cp.async`), as
        FlashInfer does, rather than in registers.

        """),
        md("""
        ## 4. Variants ride along

        The decode kernel compiles the same variants as the prefill kernel (notebook 06). A
        soft-cap and a sliding window with sinks, checked once more against the golden model:
        """),
        code("""
    kw = dict(logits_soft_cap=8.0, window_left=5, sink_size=1)
    diff = np.abs(nbcuda.batch_decode_paged(q, cache, *table, **kw) - ref.batch_decode_paged(q, cache, *table, **kw)).max()
    print(f"kernel vs golden with {kw}: {diff:.1e}")
    assert diff < TOL
    """),
        md("""
        ## Summary

        * A decode CTA gathers each KV tile from its pages into shared memory once and serves
          every query head of its GQA group from it.
        * Split-KV trades a little extra traffic (partial states) for parallelism; the merge
          operator makes the result exact, and a fixed fold order makes it reproducible.
        * Notebook 05 shows how the scheduler chooses the chunks (LPT) instead of a fixed size.
        """),
    ]


# ---------------------------------------------------------------------------
# 04: prefill tiles and the roofline
# ---------------------------------------------------------------------------

def nb04():
    return [
        md("""
        # 04 · Prefill tiles and the roofline

        **What you will learn**

        1. How a prefill kernel tiles the work: a `T_q × T_k` tile of scores at a time, online
           softmax across KV tiles, and which tiles a causal mask lets it skip.
        2. nbattn's prefill kernel (`nbattn.cuda.batch_prefill_paged`) on the paged batch of
           notebook 02, checked against the golden model.
        3. The roofline model (`nbattn.perf.roofline`): FLOPs, minimal bytes,
           operational intensity — and why **decode is memory-bound** while **prefill is
           compute-bound**.
        4. Where measured numbers come from: `benchmarks/results/*.json`, read through
           `nbattn.perf.results`; the roofline figure (`nbattn.plots.roofline`) places them when present.
        """),
        md(GPU_NOTE),
        code(SETUP + """
    import matplotlib.pyplot as plt
    from nbattn import reference as ref
    from nbattn.perf import roofline as rl, results, H200, GPUS
    """),
        md("""
        ## 1. A prefill tile loop in NumPy

        One head, `Q` queries, `K` keys. The kernel owns a tile of `T_q` query rows and walks
        the keys `T_k` at a time: scores for the tile, a running max `m`, a running sum `l`,
        an un-normalized accumulator — the online softmax of notebook 01, now for a whole block
        of rows. With a causal mask, a KV tile entirely to the right of the diagonal is never
        loaded, and tiles entirely left of it need no mask at all.
        """),
        code("""
    def tiled_prefill(q, k, v, T_q, T_k, causal=False):
        \"\"\"q [Q, D], k/v [K, D]; returns (o, tiles_loaded). Positions are bottom-right aligned.\"\"\"
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
    """),
        code("""
    def tile_kinds(Q, K, T_q, T_k):
        \"\"\"0 = skipped, 1 = needs the mask (diagonal), 2 = fully visible.\"\"\"
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
    """),
        md("""
        ### Exercise 1 — how many tiles does a causal prefill load?

        For `Q = K = N` and square tiles `T_q = T_k = T` with `T` dividing `N`, give a closed form
        `loaded_tiles(N, T)` for the number of tiles a causal kernel loads. The check compares it
        with the tile loop above.
        """),
        exercise("""
    def loaded_tiles(N, T):
        # your code here
        raise NotImplementedError
    """),
        solution("""
    def loaded_tiles(N, T):
        n = N // T
        return n * (n + 1) // 2
    """),
        check("""
    for N, T in [(16, 16), (64, 16), (96, 32), (128, 8)]:
        qn, kn, vn = (rng.normal(size=(N, 4)) for _ in range(3))
        _, got = tiled_prefill(qn, kn, vn, T, T, causal=True)
        assert loaded_tiles(N, T) == got, f"N={N}, T={T}: you said {loaded_tiles(N, T)}, the loop loads {got}"
    print("✓ about half the tiles: causal prefill does ~half the FLOPs (rl.causal_visible_pairs counts them)")
    """),
        md("""
        ## 2. nbattn's prefill kernel

        `nbattn.cuda.batch_prefill_paged` takes the golden model's arguments. Each
        CTA owns one tile of fused rows (GQA heads folded in) and one KV head; it gathers each
        KV tile from the pages into shared memory once and uses it for the whole group. On a GPU
        with fp16/bf16 it runs the tensor-core path; in the simulator the CUDA-core path with
        small tiles. Here is the three-request batch of notebook 02, causal:
        """),
        code("""
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
    """),
        md("""
        ## 3. The roofline

        The performance model counts what attention cannot avoid. Per query head:
        FLOPs `≈ 4·l_q·l_kv·d` (two matmuls), and minimal bytes
        `b·d·(l_q·H_qo + 2·l_kv·H_kv + l_q·H_qo)` (read Q, read K and V once, write O).
        Their ratio, the **operational intensity**, decides which roof a kernel hits:
        below the GPU's ridge point it is limited by memory bandwidth, above it by compute.
        """),
        code("""
    shapes = {
        "decode, MHA, l_kv 4k":        dict(l_q=1,    l_kv=4096, num_qo_heads=32, num_kv_heads=32),
        "decode, GQA group 8, l_kv 4k": dict(l_q=1,    l_kv=4096, num_qo_heads=32, num_kv_heads=4),
        "prefill 512 on 4k, GQA 4":    dict(l_q=512,  l_kv=4096, num_qo_heads=32, num_kv_heads=8),
        "prefill 4k x 4k, MHA":        dict(l_q=4096, l_kv=4096, num_qo_heads=32, num_kv_heads=32),
    }
    ridge = H200.ridge_intensity()
    print(f"H200 ridge point: {H200.tensor_tflops} TFLOP/s / {H200.copy_bandwidth_GBps:.0f} GB/s = {ridge:.0f} FLOP/byte\\n")
    for name, kw in shapes.items():
        I = rl.operational_intensity(head_dim=128, **kw)
        roof = rl.attainable_tflops(I, H200.tensor_tflops, H200.copy_bandwidth_GBps)
        bound = "memory-bound" if I < ridge else "compute-bound"
        print(f"{name:30s} intensity {I:8.1f} FLOP/B -> at most {roof:6.1f} TFLOP/s ({bound})")
    """),
        md("""
        Decode reads every key once for a single query row: about `2/b` FLOPs per byte per query
        head sharing the KV head, i.e. ≈ `group` for fp16. Prefill reuses each key for `l_q`
        rows: the intensity grows like `l_q·l_kv/(l_q+l_kv)`.

        ### Exercise 2 — where does prefill cross the ridge?

        MHA, fp16 (`b = 2`), `l_kv = 4096`, head_dim 128. Using the closed form
        `(2/b)·l_q·l_kv/(l_q+l_kv)`, find the smallest integer `l_q` whose intensity reaches the
        H200 ridge (`ridge` above). Store it in `l_q_cross`.
        """),
        exercise("""
    l_q_cross = None   # your code here
    """),
        solution("""
    l_kv = 4096
    l_q_cross = int(np.ceil(ridge * l_kv / (l_kv - ridge)))      # solve l_q*l_kv/(l_q+l_kv) = ridge
    """),
        check("""
    I = lambda lq: rl.operational_intensity(lq, 4096, head_dim=128, num_qo_heads=32, num_kv_heads=32)
    assert I(l_q_cross) >= ridge > I(l_q_cross - 1), f"l_q={l_q_cross}: intensity {I(l_q_cross):.1f} vs ridge {ridge:.1f}"
    print(f"✓ from l_q = {l_q_cross} queries on, a 4k-context prefill is compute-bound on an H200")
    """),
        md("""
        ## 4. Measured points

        Measured numbers enter only through result files in `benchmarks/results/`
        (one JSON per suite; format and validation in `nbattn.perf.results`). Nothing is made up:
        a missing file means no point, and a file that fails validation is reported and left out
        (never patched up). Here is what this checkout has; the files that validate are copied to
        a scratch folder that the figures below read:
        """),
        code("""
    import shutil, tempfile
    from pathlib import Path

    def readable_results():
        \"\"\"A scratch results folder holding the result files that validate; reports the others.\"\"\"
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
    """),
        code("""
    from nbattn.plots import roofline as roofline_plots
    pts = roofline_plots.measured_points(root)
    print("measured roofline points:", [(p["suite"], p["impl"], len(p["x"])) for p in pts] or "none yet "
          "(they come from decode.json / prefill.json, written by the GPU benchmarks)")
    fig = roofline_plots.roofline_figure(root)
    display(fig)
    """),
        md("""
        How far below its roof does a measured prefill sit? For each `tflops` record of
        `prefill.json` (when present), the shape gives the intensity, the intensity and the GPU
        named in the file give the roof, and the ratio is what is left on the table:
        """),
        code("""
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
    """),
        md("""
        The golden model has a CPU benchmark of its own (`golden_cpu.json`, when present): a
        reminder that a NumPy prefill is itself compute-bound — it reaches a good fraction of
        what NumPy's matmul does on the same machine.
        """),
        code("""
    gold = results.load_suite("golden_cpu", root)
    if gold is None:
        print("golden_cpu.json not present")
    else:
        for r in gold.select("gflops"):
            peers = ", ".join(f"{k} {v:.1f}" for k, v in r.peers.items() if v is not None)
            print(f"case {dict(r.case)}: golden model {r.value:.1f} {r.unit} ({peers})")
    """),
        md("""
        ## 5. Why decode needs split-KV

        A memory-bound kernel is only as fast as the number of SMs pulling data. A decode step
        with a small batch launches `batch × H_kv` CTAs — often fewer than the SMs. Splitting
        each KV range into chunks (FlashDecoding; notebook 03) puts every SM to work, at the
        price of writing partial states and merging them. The model
        `rl.split_kv_speedup_model` makes the assumptions explicit (see its docstring):
        """),
        code("""
    l_kv = np.geomspace(256, 131072, 40)
    fig, ax = plt.subplots(figsize=(6, 3.3))
    for batch in (1, 4, 16, 64):
        ax.plot(l_kv, rl.split_kv_speedup_model(batch, l_kv), label=f"batch {batch}")
    ax.set_xscale("log", base=2); ax.set_xlabel("KV length"); ax.set_ylabel("modelled speedup of split-KV")
    ax.set_title("H200 model, 32 q / 8 kv heads"); ax.legend(); plt.tight_layout(); plt.show()
    """),
        md("""
        ## Summary

        * Prefill kernels tile queries and keys; causal masks skip about half the tiles.
        * Intensity decides the roof: decode ≈ `group` FLOP/byte (memory-bound), prefill grows with
          length (compute-bound past a few hundred queries on an H200).
        * Decode is therefore reported as a fraction of measured copy bandwidth, prefill as a
          fraction of peak FLOP/s; measured points come only from `benchmarks/results`.
        """),
    ]


# ---------------------------------------------------------------------------
# 05: the scheduler
# ---------------------------------------------------------------------------

def nb05():
    return [
        md("""
        # 05 · The scheduler: plan once, run every layer

        **What you will learn**

        1. The tile heuristic: how a batch picks its query tile (`nbattn.sched.choose_tile_q`).
        2. The LPT planner (`nbattn.sched.plan`): cut each query tile's KV range into chunks of at
           most `L` keys, then hand the largest chunks first to the least-loaded CTA.
        3. The **reduction map**: which partial states are merged, in which fixed order.
        4. Running a plan — with the golden model, then on the device with the decode and merge
           kernels — and why a fixed order makes the output bitwise reproducible (no atomics).
        5. Gantt charts of three policies — one request per CTA, FlashDecoding's fixed split, and
           LPT — under the simulator's cost model (`nbattn.sched.simulate`), against the makespan
           lower bound.
        6. Why plan/run makes a step CUDA-graph capturable.

        The planner runs on the CPU; without a GPU the kernels run in numba's simulator. Only the
        CUDA-graph cell needs a real GPU (it says so and skips itself otherwise).
        """),
        md(GPU_NOTE),
        code(SETUP + """
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
    """),
        md("""
        ## 1. Choosing the query tile

        A kernel processes a *query tile* of rows against a stream of KV tiles. With GQA the
        `group` query heads that share a KV head are fused into rows, so a decode request
        already has `group` rows. The heuristic picks the smallest tile in
        `{1, 16, 32, 64, 128}` that is at least the batch's average `l_qo * group`.
        Tile 1 is the CUDA-core decode path.
        """),
        code("""
    for qo_lens, group in [([1] * 8, 1), ([1] * 8, 4), ([3, 1, 4], 1), ([100, 300], 1), ([512] * 2, 8)]:
        print(f"l_qo = {qo_lens!s:22s} group {group}: tile_q = {sched.choose_tile_q(qo_lens, group)}")
    """),
        md("""
        ## 2. A plan, by hand and by the planner

        Four decode requests with KV lengths 700, 100, 120, 80 on `C = 4` CTAs, `tile_q = 1`.
        Total work `W = Σ_r ceil(l_qo/T_q)·l_kv = 1000` key-rows, so the chunk limit is
        `L = ceil(W / C) = 250`. Request 0 is cut into chunks of 250, 250 and 200 keys; the
        others fit in one chunk. Every chunk costs `alpha·l_q + beta·l_kv` (both 1 by default).
        Largest first, each to the least-loaded CTA:
        """),
        code("""
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
    """),
        md("""
        The `->out` items are unsplit tiles: they write the final output directly. Split tiles
        write **partial states** into slots; the reduction map lists, per split tile, its slots
        in increasing `kv_start` order:
        """),
        code("""
    for m in range(p.num_merges):
        slots = p.merge_slots[p.merge_indptr[m]:p.merge_indptr[m + 1]]
        print(f"output of request {p.merge_request[m]}, tile {p.merge_qo_tile[m]} = merge of slots {slots.tolist()}")
    show(sched_plots.reduction_map, p, name="reduction_map.png")
    """),
        md("""
        ### Exercise 1 — the chunk limit

        For the three-request batch of notebook 02 (query lengths `[3, 1, 4]`, KV lengths `[6, 2, 9]`) with
        `tile_q = 16` and `C = 4` CTAs, compute the planner's chunk limit `L` from its formula
        `W = Σ_r ceil(l_qo[r] / T_q) · l_kv[r]`, `L = max(1, ceil(W / C))`.
        """),
        exercise("""
    L_mine = None   # your code here
    """),
        solution("""
    qo, kv, T_q, C = np.array([3, 1, 4]), np.array([6, 2, 9]), 16, 4
    W = int(np.sum(-(-qo // T_q) * kv))
    L_mine = max(1, -(-W // C))
    """),
        check("""
    p4 = sched.plan([3, 1, 4], [6, 2, 9], num_ctas=4, tile_q=16)
    assert L_mine == p4.chunk_limit, f"you said {L_mine}, the planner uses {p4.chunk_limit}"
    print("✓ L =", L_mine)
    """),
        md("""
        ### Exercise 2 — LPT yourself

        Below are the planner's chunks in their stable order (request, tile, chunk) with their
        costs. Write `lpt(costs, C)` returning the final load of every CTA: sort by cost, largest
        first (ties keep the given order), and give each chunk to the least-loaded CTA, the
        lowest id among equals (a min-heap of `(load, cta)`). Your loads must equal the
        planner's `cta_cost` exactly.
        """),
        code("""
    wl = sched.make_workload("variable", batch=12, seed=1)
    big = sched.plan(wl.qo_lens, wl.kv_lens, num_ctas=16)
    order = np.lexsort((big.kv_start, big.qo_tile, big.request))   # (request, tile, chunk) order
    chunk_costs = big.item_cost()[order]
    print(len(chunk_costs), "chunks; first costs:", chunk_costs[:6])
    """),
        exercise("""
    def lpt(costs, C):
        # your code here: return an array of C loads
        raise NotImplementedError
    """),
        solution("""
    import heapq

    def lpt(costs, C):
        heap = [(0.0, c) for c in range(C)]
        loads = np.zeros(C)
        for i in sorted(range(len(costs)), key=lambda i: -costs[i]):   # stable: ties keep order
            load, c = heapq.heappop(heap)
            loads[c] = load + costs[i]
            heapq.heappush(heap, (loads[c], c))
        return loads
    """),
        check("""
    mine = np.asarray(lpt(chunk_costs, big.num_ctas))
    np.testing.assert_array_equal(mine, big.cta_cost)
    bound = max(chunk_costs.sum() / big.num_ctas, chunk_costs.max())
    print(f"✓ same loads as the planner; makespan {mine.max():.0f} vs bound max(Σt/C, max t) = {bound:.1f}")
    """),
        md("""
        ## 3. Running a plan (with the golden model)

        The *run* step is a fixed grid of `C` CTAs. CTA `c` walks its queue; each item attends
        its query tile to keys `[kv_start, kv_end)` and writes either the output or a partial
        slot. A second pass merges each split tile's slots in the reduction map's order.
        Here is that executor in NumPy, with `nbattn.reference.attend` standing in for a CTA
        (MHA, `group = 1`, so a tile's rows are query positions and every head rides along):
        """),
        code("""
    from nbattn.variants import Variant

    def run_plan(p, q, ks, vs):
        \"\"\"q: [batch, H, D] (decode); ks/vs: per request [kv_len, H, D].\"\"\"
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
    """),
        code("""
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
    """),
        md("""
        ### Exercise 3 — determinism

        Same lengths in, bitwise-same output out. Check it: plan the step twice and run both,
        and compare the runs **bitwise** (`np.array_equal`). Then plan with a different `C`
        (the split points move) and measure how far the result drifts. Set `same` to the bitwise
        comparison and `drift` to the max absolute difference.
        """),
        exercise("""
    same, drift = None, None   # your code here
    """),
        solution("""
    again = run_plan(sched.plan(np.ones(batch, int), kv_lens, num_ctas=8), q, ks, vs)
    same = np.array_equal(o_plan, again)
    other = run_plan(sched.plan(np.ones(batch, int), kv_lens, num_ctas=5), q, ks, vs)
    drift = float(np.abs(other - o_plan).max())
    """),
        check("""
    assert same is True or same == np.True_, "two runs of the same plan must agree bitwise"
    p_a = sched.plan(np.ones(batch, int), kv_lens, num_ctas=8)
    for field in ("cta_indptr", "request", "kv_start", "kv_end", "out_slot", "merge_slots"):
        assert np.array_equal(getattr(p_a, field), getattr(p_run, field)), field
    assert 0 <= drift < 1e-5, "another C changes the order, so only rounding may differ"
    print(f"✓ bitwise reproducible for one plan; another C drifts by {drift:.1e} (float32 rounding)")
    """),
        md("""
        ## 4. Plan once, run on the device, every layer

        The decode kernel of notebook 03 runs exactly this kind of work list: CSR queues over CTAs
        (`nbattn.cuda.decode.WorkList`), and the merge kernel folds slots by a CSR reduction map
        (`nbattn.cuda.merge.MergeMap`, `run_merge_partials`). The kernel covers all query heads of an
        item with its second grid dimension, so for the planner a decode request is one row
        (`tile_q = 1`).

        The run step below allocates its workspace **once**, sized by the planner's bound on partial states, and
        then serves two layers (two different KV caches) with the same plan, the same grid and the
        same buffer addresses. Only the data changes — which is what a CUDA graph needs to replay a
        captured step. (Capturing a graph needs a real GPU; the simulator has no graphs.)
        """),
        code("""
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
    """),
        code("""
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
    """),
        md("""
        The package wraps this as FlashInfer's `BatchDecodeWithPagedKVCacheWrapper`
        (`nbattn.cuda`): the constructor cuts one preallocated device buffer into fixed
        regions (plan arrays, partial states), `plan()` runs LPT and copies the plan in, and
        `run()` only launches the decode and merge kernels — once per layer.
        """),
        code("""
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
    """),
        md("""
        ## 5. Policies compared: Gantt charts

        The simulator places chunks on CTAs under a cost model
        (`chunk_overhead + alpha·l_q + beta·l_kv`, plus a merge pass) and reports the makespan,
        the utilization and a lower bound that no policy can beat. The skewed step — one long
        request among short ones — is where balancing matters: with one request per CTA, the
        long request's CTA works alone while the others idle. (FlashDecoding's fixed split only
        splits when there are fewer tiles than CTAs: here 24 tiles ≥ 16 CTAs, so it does nothing.)
        """),
        code("""
    C = 16
    wl = sched.make_workload("skewed", batch=24, long_len=8192 if not SMALL else 4096, short_len=512)
    results = {pol: sched.simulate(wl.qo_lens, wl.kv_lens, C, pol, workload=wl.name)
               for pol in sched.POLICIES}
    for pol, res in results.items():
        print(f"{pol:12s} makespan {res.makespan:7.0f}  utilization {res.utilization:.2f}  "
              f"makespan/bound {res.makespan_over_bound:.2f}  partials {res.num_partials}")
    """),
        code("""
    show(sched_plots.gantt, results["one_per_cta"], name="gantt_one.png")
    show(sched_plots.gantt, results["lpt"], name="gantt_lpt.png")
    """),
        code("""
    workloads = [sched.make_workload(name, batch=32, seed=0) for name in sched.WORKLOADS]
    show(sched_plots.policy_utilization, sched.compare_policies(workloads, 32), name="policies.png")
    """),
        md("""
        ### The price of a work item

        The planner cuts chunks at `L = ceil(W / C)`. That is perfect when a chunk costs only
        its keys, but on a GPU every work item also pays a fixed price (reading its queue entry,
        filling the load pipeline, writing its state): about 64 KV tokens' worth for nbattn's
        decode kernel on an H200 (`item_overhead_tokens` in `sched.json`). Equal lengths show
        the trap: with one CTA more than requests, `L` falls just short of a request, so every
        request leaves a short tail, and the spare CTA runs all the tails. `chunk_overhead` puts
        the price into the cost; `chunk_limit="auto"` also tries "no split" and the longest
        request cut in 2-4, and keeps the plan with the smallest makespan. The decode wrapper
        plans this way.
        """),
        code("""
    for rule in (None, "auto"):
        pp = sched.plan([1] * 16, [4096] * 16, 17, 1, chunk_overhead=64, chunk_limit=rule)
        print(f"chunk_limit={str(rule):5s} L={pp.chunk_limit:5d}  items {pp.num_items:3d}  "
              f"partials {pp.num_partials:3d}  makespan {pp.makespan:6.0f}  (bound {pp.lower_bound:.0f})")
    """),
        md("""
        The simulator is a model. `benchmarks/gpu_sched.py` times the real kernels on a GPU for the
        same kinds of steps and writes `benchmarks/results/sched.json`; when that file is present,
        here is what it measured (latency per step, relative to one request per CTA). Compare the
        skewed step with the constant one: balancing pays where the lengths are uneven, and costs a
        little (extra chunks, a merge pass) where they are not.
        """),
        code("""
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
    """),
        md("""
        ### Exercise 4 — the partial buffer fits, always

        The run step preallocates the partial buffer once (for CUDA graphs, addresses must not
        change). The planner bounds it by `2·C·T_q·H_qo·(head_dim+1)` elements. Find the
        largest `p.partial_elements(H_qo, head_dim)` over 200 random decode and prefill steps and
        store it as a fraction of `sched.partial_buffer_bound(...)` in `worst` (a float).
        """),
        exercise("""
    worst = None   # your code here
    """),
        solution("""
    rng2 = np.random.default_rng(5)
    worst = 0.0
    for _ in range(200):
        b = int(rng2.integers(1, 20))
        qo = rng2.integers(1, 300, size=b) if rng2.random() < 0.5 else np.ones(b, int)
        kv = qo + rng2.integers(0, 5000, size=b)
        C, H_qo, d = int(rng2.integers(1, 64)), 8, 64
        pp = sched.plan(qo, kv, C)
        worst = max(worst, pp.partial_elements(H_qo, d) / sched.partial_buffer_bound(C, pp.tile_q, H_qo, d))
    """),
        check("""
    assert worst is not None and 0 < worst <= 1.0, f"worst fraction {worst} should be in (0, 1]"
    print(f"✓ the fullest plan used {worst:.0%} of the bound")
    """),
        md("""
        ## 6. Plan/run and CUDA graphs

        A CUDA graph replays a fixed sequence of kernel launches with fixed arguments. Plan/run
        is built for it: the plan is written into a **preallocated** device workspace (the bound
        above), the run kernel always launches the same grid of `C` CTAs and reads its work from
        the workspace, and the merge pass reads the reduction map from the same place. Per step,
        only the *contents* of the workspace change (a host-to-device copy before replay);
        every layer then replays the captured graph.

        On a GPU with a CUDA build of PyTorch, the cell below captures one `run()` in a graph,
        re-plans a step with **different lengths** (same batch size, pages from the same pool),
        and replays the graph unchanged: the result matches the golden model for the new lengths.
        Without a GPU it says so and does nothing.
        """),
        code("""
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
    """),
        md("""
        The break-even of planning (the performance model): with `L` layers, per-layer times `u`
        (no plan) and `v` (with plan), plan cost `p` and integration cost `h`, planning pays
        when `L·(u − v) > p + h`:
        """),
        code("""
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
    """),
        md("""
        ## Summary

        * The plan is computed once per step on the CPU and reused by every layer.
        * LPT over chunks of at most `L = ceil(W/C)` keys keeps the makespan near
          `max(Σt/C, max t)`; unsplit tiles write directly, split ones merge in a fixed order.
        * A fixed order (never atomics) makes results bitwise reproducible for given lengths.
        * A fixed grid and a preallocated workspace make the run step graph-capturable.
        """),
    ]


# ---------------------------------------------------------------------------
# 06: variants as compiled Python functions, and the paper's figures
# ---------------------------------------------------------------------------

def nb06():
    return [
        md("""
        # 06 · Variants as compiled Python functions, and the paper's figures

        **What you will learn**

        1. The customization points of an attention kernel, in the package's words: a
           `nbattn.variants.Variant` — soft-cap, sliding window (with sinks), ALiBi, sigmoid
           attention, and your own `score_mod` / `mask_mod`.
        2. The order they apply in: scale → ALiBi → soft-cap → `score_mod` → mask → softmax.
        3. How one plain Python function serves twice: the golden model calls it with NumPy
           arrays, and the kernel factory compiles it with numba into device code (numba's JIT
           plays the role of FlashInfer's JIT templates).
        4. How to rebuild the paper's figures from models and measured results (`nbattn.figures`).
        """),
        md(GPU_NOTE),
        code(SETUP + """
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
        \"\"\"Run the kernel and the golden model with the same variant; assert they agree
        within TOL (absolute and relative) and return the max |difference|.\"\"\"
        o_kernel = np.asarray(nbcuda.single_prefill(q, k, v, **variant), np.float32)
        o_golden = ref.single_prefill(q, k, v, **variant)
        np.testing.assert_allclose(o_kernel, o_golden, atol=TOL, rtol=TOL, err_msg=str(variant))
        return float(np.abs(o_kernel - o_golden).max())
    """),
        md("""
        ## 1. One dataclass describes what is computed

        Every attention function — golden or kernel — takes the same keywords and turns them into
        a frozen, hashable `Variant`. Hashable matters: the kernel factory caches one compiled
        kernel per variant.
        """),
        code("""
    var = Variant(causal=True, logits_soft_cap=30.0, window_left=255, sink_size=4)
    print(var)
    print("needs positions:", var.needs_positions, "  hash usable as a cache key:", hash(var) == hash(Variant(**vars(var))))
    """),
        md("""
        ## 2. Logits soft-cap

        Gemma-style soft-capping squashes each (already scaled) score through `c·tanh(s/c)`:
        nearly the identity for `|s| ≪ c`, never beyond `±c`. It bounds how peaked the softmax
        can get.
        """),
        code("""
    s = np.linspace(-60, 60, 400)
    fig, ax = plt.subplots(figsize=(5, 3))
    for c in (10, 30):
        ax.plot(s, c * np.tanh(s / c), label=f"c = {c}")
    ax.plot(s, s, "k:", lw=0.8, label="no cap")
    ax.set_xlabel("scaled score s"); ax.set_ylabel("capped score"); ax.legend(); plt.tight_layout(); plt.show()
    print("kernel vs golden, soft-cap 5, causal:", compare(causal=True, logits_soft_cap=5.0))
    """),
        md("""
        ## 3. Sliding window and attention sinks

        `window_left` is inclusive (FlashInfer's convention): query at position `i_pos` keeps key
        `j` iff `i_pos − j ≤ window_left` (−1 = no window). `sink_size` keeps the first keys
        visible whatever the window (StreamingLLM's "attention sinks"). Positions are bottom-right
        aligned: query `i` of `Q` sits at `K − Q + i`.
        """),
        code("""
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
    """),
        md("""
        ## 4. Sigmoid attention

        No softmax: `o = Σ_j sigmoid(s_ij + bias)·v_j`. There is no normalizer, hence no LSE, and
        partial outputs over disjoint key sets simply **add** (notebook 01). Asking for the LSE
        is an error:
        """),
        code("""
    print("kernel vs golden, sigmoid (bias -1):", compare(use_sigmoid=True, sigmoid_bias=-1.0))
    try:
        ref.single_prefill(q, k, v, use_sigmoid=True, return_lse=True)
    except ValueError as e:
        print("ValueError:", e)
    """),
        md("""
        ## 5. Your own functions: `score_mod` and `mask_mod`

        Write them with FlexAttention's argument order, in plain arithmetic and comparisons:

        ```python
        score_mod(score, b, h, q_idx, kv_idx) -> new score
        mask_mod(b, h, q_idx, kv_idx)         -> True to keep the key
        ```

        `b` is the request, `h` the query head, `q_idx`/`kv_idx` sequence positions. The golden
        model calls them once with broadcast NumPy arrays; the kernel compiles them with
        `numba.cuda.jit(device=True)` and calls them per (row, key) inside the tile loop. The
        same source, two executions:
        """),
        code("""
    def dilated(b, h, q_idx, kv_idx):          # keep every third key back from the query
        return (q_idx - kv_idx) % 3 == 0

    def tilt(score, b, h, q_idx, kv_idx):      # a head-dependent linear bias
        return score - 0.05 * (h + 1) * (q_idx - kv_idx)

    qi, kj = np.arange(4)[:, None], np.arange(6)[None, :]
    print("golden model's call, one NumPy evaluation:\\n", dilated(0, 0, qi + 2, kj).astype(int))
    from numba import cuda
    compiled = cuda.jit(device=True)(dilated)
    print("numba device function:", type(compiled).__name__)
    print("kernel vs golden, causal + dilated + tilt:", compare(causal=True, mask_mod=dilated, score_mod=tilt))
    """),
        md("""
        ### Exercise 1 — a built-in as your own mask

        Write `my_window(b, h, q_idx, kv_idx)` that, together with `causal=True`, reproduces
        `window_left=5, sink_size=2`. Use `|` and `&` (not `or`/`and`) so the golden model can
        evaluate it on arrays in one go. The check runs it **in the kernel**.
        """),
        exercise("""
    def my_window(b, h, q_idx, kv_idx):
        # your code here
        raise NotImplementedError
    """),
        solution("""
    def my_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= 5) | (kv_idx < 2)
    """),
        check("""
    o_mine = nbcuda.single_prefill(q, k, v, causal=True, mask_mod=my_window)
    o_builtin = ref.single_prefill(q, k, v, causal=True, window_left=5, sink_size=2)
    np.testing.assert_allclose(np.asarray(o_mine, np.float32), o_builtin, atol=TOL, rtol=TOL)
    print("✓ your compiled mask_mod equals the built-in window with sinks")
    """),
        md("""
        ### Exercise 2 — ALiBi as a `score_mod`

        ALiBi adds `−slope_h·(q_idx − kv_idx)` to each score, with geometric slopes per head
        (for `H` a power of two: `slope_h = 2^(−8(h+1)/H)`). Write `my_alibi` as a `score_mod` for
        our `H` heads and compare with the built-in `pos_encoding_mode="ALIBI"`. (`H` is a global
        here; numba freezes globals into the compiled function as constants.)
        """),
        exercise("""
    def my_alibi(score, b, h, q_idx, kv_idx):
        # your code here
        raise NotImplementedError
    """),
        solution("""
    def my_alibi(score, b, h, q_idx, kv_idx):
        return score - 2.0 ** (-8.0 * (h + 1) / H) * (q_idx - kv_idx)
    """),
        check("""
    assert H & (H - 1) == 0, "this closed form needs a power-of-two head count"
    np.testing.assert_allclose(2.0 ** (-8.0 * (np.arange(H) + 1) / H), alibi_slopes(H), rtol=1e-6)
    o_mine = nbcuda.single_prefill(q, k, v, causal=True, score_mod=my_alibi)
    o_builtin = ref.single_prefill(q, k, v, causal=True, pos_encoding_mode="ALIBI")
    np.testing.assert_allclose(np.asarray(o_mine, np.float32), o_builtin, atol=10 * TOL, rtol=10 * TOL)
    print("✓ your compiled score_mod equals the built-in ALiBi")
    """),
        md("""
        ## 6. Reproducing the paper's figures

        `nbattn.figures` is a registry: each entry has a builder, a caption that puts the paper's
        number beside ours, and a data source. Builders draw the performance models and, where a
        result file exists in `benchmarks/results/`, the measured points; otherwise the figure
        says "no measured data yet". Nothing is fabricated: a result file that fails validation
        is left out and named below.
        """),
        code("""
    import nbattn.figures as figures
    from nbattn.perf.results import default_results_root
    for entry in figures.registry():
        print(f"{entry.name:26s} {entry.data_source}")
    """),
        code("""
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
    """),
        md("""
        ### Exercise 3 — read a paper number through Amdahl's law

        The paper reports that switching SGLang's attention backend from Triton to FlashInfer took the
        end-to-end inter-token latency of Llama 3.1 8B on the Variable workload from 29.6 ms to
        9.1 ms. If attention
        is a fraction `f` of a step and gets `k×` faster, the step gets
        `1 / ((1 − f) + f/k)` faster. Even with infinitely fast attention (`k → ∞`), what is the
        smallest `f` that explains the measured speedup? Store it in `f_min`.
        """),
        exercise("""
    f_min = None   # your code here
    """),
        solution("""
    f_min = 1 - 9.1 / 29.6
    """),
        check("""
    from nbattn.perf import roofline as rl
    assert np.isclose(rl.amdahl_speedup(f_min, 1e12), 29.6 / 9.1, rtol=1e-6)
    assert rl.amdahl_speedup(f_min - 0.01, 1e12) < 29.6 / 9.1
    print(f"✓ attention must have been at least {f_min:.0%} of the step before the switch")
    """),
        md("""
        ## Summary

        * A `Variant` names every customization; golden model and kernels read the same one.
        * User functions are plain Python: NumPy evaluates them for the golden model, numba compiles
          them into the kernel, and a hashable variant keys the kernel cache.
        * The figures are functions of models and result files; rerun them after a benchmark to see
          measured points beside the paper's numbers.
        """),
    ]


NOTEBOOKS = {
    "01_online_softmax_and_merge.ipynb": nb01,
    "02_paged_kv_and_bsr.ipynb": nb02,
    "03_decode_kernel.ipynb": nb03,
    "04_prefill_and_roofline.ipynb": nb04,
    "05_scheduler.ipynb": nb05,
    "06_variants.ipynb": nb06,
}


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------

def make(name: str, cells_fn) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    stem = name.split("_")[0]
    for i, cell in enumerate(cells_fn()):
        cell["id"] = f"nb{stem}-{i:03d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(nb) -> str:
    return nbformat.writes(nb) + "\n"


def student_edition(nb) -> nbformat.NotebookNode:
    """A copy of ``nb`` without its worked solutions (cells tagged ``solution``):
    the exercise cells keep their placeholders, so every check fails until the
    student answers it."""
    out = nbformat.reads(nbformat.writes(nb), as_version=4)
    out.cells = [c for c in out.cells if "solution" not in c.get("metadata", {}).get("tags", [])]
    return out


def write_student(outdir: Path) -> list[Path]:
    """Write the student edition of every notebook into ``outdir``."""
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fn in NOTEBOOKS.items():
        path = outdir / name
        path.write_text(render(student_edition(make(name, fn))))
        paths.append(path)
    return paths


def main(argv: list[str]) -> int:
    if "--student" in argv:   # --student DIR: the edition without solutions (make student)
        i = argv.index("--student")
        outdir = Path(argv[i + 1]) if i + 1 < len(argv) else HERE.parent / "student-notebooks"
        for path in write_student(outdir):
            print("wrote", path)
        return 0
    stale = []
    for name, fn in NOTEBOOKS.items():
        path = HERE / name
        text = render(make(name, fn))
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print("wrote", path.relative_to(HERE.parent))
    if stale:
        print("stale notebooks (run notebooks/_build.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
