"""nbattn.cuda block_sparse and cascade against the golden model (docs/concepts/layouts.md, state.md)."""
import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn import _compat
from nbattn import layout as L
from nbattn import reference as R
from nbattn.cuda.cascade import cascade as cuda_cascade
from nbattn.cuda.sparse import block_sparse
from nbattn.cuda.tuning import CASCADE

from test_cuda_prefill import PATHS, check

SIM = _compat.simulator_enabled()


def qkv(rng, m, n, hq=4, hk=2, d=16, dtype=np.float16):
    return (rng.standard_normal((m, hq, d)).astype(dtype), rng.standard_normal((n, hk, d)).astype(dtype),
            rng.standard_normal((n, hk, d)).astype(dtype))


@pytest.mark.parametrize("tc", PATHS)
@pytest.mark.parametrize("block, kw", [((3, 3), dict()), ((2, 5), dict(causal=True)),
                                       ((4, 2), dict(use_sigmoid=True))])
def test_block_sparse_any_block_shape(tc, block, kw):
    rng = np.random.default_rng(11)
    m, n = 7, 12
    q, k, v = qkv(rng, m, n)
    b_r, b_c = block
    mask = rng.random((-(-m // b_r), -(-n // b_c))) < 0.5
    mask[1] = False                                   # an empty block row: o = 0, lse = -inf
    bsr = L.BSR.from_block_mask(mask, block, (m, n))
    lse = not kw.get("use_sigmoid")
    got = block_sparse(q, k, v, bsr, return_lse=lse, tensor_cores=tc, **kw)
    ref = R.block_sparse(q, k, v, bsr, return_lse=lse, **kw)
    check(got, ref)
    if lse:
        assert np.isneginf(got[1][b_r:2 * b_r]).all()


def test_block_sparse_keeps_column_order_and_rejects_bad_shape():
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, 4, 6)
    bsr = L.BSR.validate(np.array([0, 2, 3], np.int32), np.array([2, 0, 1], np.int32), (2, 2), (4, 6))
    check(block_sparse(q, k, v, bsr, return_lse=True), R.block_sparse(q, k, v, bsr, return_lse=True))
    with pytest.raises(ValueError, match="bsr"):
        block_sparse(q[:3], k, v, bsr)


def shared_prefix_batch(rng, prefix_pages, suffix_lens, qo_lens, page_size=4, hq=4, hk=2, d=16):
    """Requests that share their first `prefix_pages` pages, then own pages."""
    pool = prefix_pages + sum(-(-s // page_size) for s in suffix_lens) + 2
    ids = rng.permutation(pool).astype(np.int32)
    shared, rest = ids[:prefix_pages], list(ids[prefix_pages:])
    indptr, indices, last = [0], [], []
    for s in suffix_lens:
        own = [rest.pop() for _ in range(-(-s // page_size))]
        indices += list(shared) + own
        indptr.append(len(indices))
        last.append(s - (len(own) - 1) * page_size if own else page_size)
    pkv = L.PagedKV.validate(np.array(indptr, np.int32), np.array(indices, np.int32),
                             np.array(last, np.int32), page_size, pool)
    cache = rng.standard_normal((pool, 2, page_size, hk, d)).astype(np.float16)
    q = rng.standard_normal((sum(qo_lens), hq, d)).astype(np.float16)
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    return q, cache, qo, pkv


@pytest.mark.parametrize("tc", PATHS)
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, window_left=5, sink_size=2),
                                dict(use_sigmoid=True), dict(pos_encoding_mode="ALIBI", causal=True)])
def test_cascade_two_levels_matches_golden_and_flat(tc, kw):
    rng = np.random.default_rng(13)
    q, cache, qo, pkv = shared_prefix_batch(rng, 2, [3, 5, 1], [2, 1, 3])
    levels = L.cascade_decompose(qo, pkv)
    assert len(levels[0].paged_kv_indices) == 2       # the prefix is one block row
    lse = not kw.get("use_sigmoid")
    got = cuda_cascade(q, levels, cache, return_lse=lse, tensor_cores=tc, **kw)
    ref = R.cascade(q, levels, cache, return_lse=lse, **kw)
    check(got, ref)
    flat = R.batch_prefill_paged(q, cache, qo, pkv.paged_kv_indptr, pkv.paged_kv_indices,
                                 pkv.paged_kv_last_page_len, return_lse=lse, **kw)
    check(got, flat)


@pytest.mark.parametrize("tc", PATHS)
def test_cascade_three_levels_split_kv_and_empty_group(tc):
    rng = np.random.default_rng(14)
    q, cache, qo, pkv = shared_prefix_batch(rng, 3, [2, 6, 4, 1], [1, 2, 1, 1])
    two = L.cascade_decompose(qo, pkv)
    # level 0: everyone reads page 0; level 1: pages 1-2 for all (as two groups); level 2: own pages
    p = two[0].paged_kv_indices
    lv0 = L.CascadeLevel(np.array([0, 5], np.int32), np.array([0, 1], np.int32), p[:1], np.array([4], np.int32))
    lv1 = L.CascadeLevel(np.array([0, 3, 5], np.int32), np.array([0, 2, 2], np.int32), p[1:3],
                         np.array([4, 0], np.int32))   # the second group has no pages here
    lv2 = two[1]
    lv1b = L.CascadeLevel(np.array([0, 3, 5], np.int32), np.array([0, 2, 4], np.int32),
                          np.concatenate([p[1:3], p[1:3]]), np.array([4, 4], np.int32))
    levels = [lv0, lv1b, lv2]
    got = cuda_cascade(q, levels, cache, causal=True, return_lse=True, tensor_cores=tc, kv_chunk=3)
    check(got, R.cascade(q, levels, cache, causal=True, return_lse=True))
    levels = [lv0, lv1, lv2]
    got = cuda_cascade(q, levels, cache, return_lse=True, tensor_cores=tc)
    check(got, R.cascade(q, levels, cache, return_lse=True))


@pytest.mark.parametrize("kw", [dict(causal=True), dict(use_sigmoid=True)])
def test_cascade_split_merges_only_written_states(kw, monkeypatch):
    """With a KV split, groups have different chunk counts; the states a group
    does not have are never read (here every fresh device array starts as NaN)."""
    from numba import cuda

    def nan_array(shape, dtype=np.float64, stream=0, **_):
        fill = np.nan if np.dtype(dtype).kind == "f" else 0
        return cuda.to_device(np.full(shape, fill, dtype), stream=stream)

    monkeypatch.setattr(cuda, "device_array", nan_array)
    rng = np.random.default_rng(17)
    q, cache, qo, pkv = shared_prefix_batch(rng, 3, [2, 6, 4, 1], [1, 2, 1, 1])
    levels = L.cascade_decompose(qo, pkv)            # prefix: 12 keys; suffixes 2, 6, 4, 1 keys
    lse = not kw.get("use_sigmoid")
    got = cuda_cascade(q, levels, cache, return_lse=lse, kv_chunk=2, **kw)
    check(got, R.cascade(q, levels, cache, return_lse=lse, **kw))


@pytest.mark.parametrize("kw, as_decode", [(dict(), True), (dict(causal=True, logits_soft_cap=20.0), True),
                                            (dict(causal=True, window_left=4), False), (dict(use_sigmoid=True), False)])
def test_cascade_decode_step_levels(kw, as_decode, monkeypatch):
    """A decode step (one query row per request, GQA group 4): the suffix level
    is run by the batch-decode kernel unless a variant reads key positions (the
    prefix level, one group of four rows, by the prefill tile); both ways agree
    with the golden model and with flat attention.  Large logits, an empty
    suffix, a non-full last page."""
    import importlib

    C = importlib.import_module("nbattn.cuda.cascade")
    taken = []
    real = C.decode_level
    monkeypatch.setattr(C, "decode_level", lambda *a: taken.append(real(*a)) or taken[-1])
    rng = np.random.default_rng(18)
    q, cache, qo, pkv = shared_prefix_batch(rng, 3, [5, 0, 7, 2], [1, 1, 1, 1], hq=8, hk=2)
    q *= 30                                         # logits in the hundreds
    levels = L.cascade_decompose(qo, pkv)
    lse = not kw.get("use_sigmoid")
    got = cuda_cascade(q, levels, cache, return_lse=lse, **kw)
    check(got, R.cascade(q, levels, cache, return_lse=lse, **kw))
    flat = R.batch_prefill_paged(q, cache, qo, pkv.paged_kv_indptr, pkv.paged_kv_indices,
                                 pkv.paged_kv_last_page_len, return_lse=lse, **kw)
    check(got, flat)
    assert taken == [False, as_decode]
    # CascadeTuning.decode_levels off: every level on the prefill tile, the same result
    taken.clear()
    got = cuda_cascade(q, levels, cache, return_lse=lse, tuning=CASCADE.replace(decode_levels=False), **kw)
    check(got, R.cascade(q, levels, cache, return_lse=lse, **kw))
    assert taken == [False, False]


@pytest.mark.parametrize("call", ["cascade", "block_sparse", "split_kv"])
def test_tuning_is_checked_before_any_kernel(call, monkeypatch):
    """cascade (and split_kv) take a CascadeTuning, block_sparse a PrefillTuning; a wrong
    ``tuning`` is a TypeError naming it before anything is built."""
    from nbattn.cuda import prefill as P
    from nbattn.cuda.split import split_kv
    from nbattn.cuda.tuning import DECODE, PREFILL

    monkeypatch.setattr(P, "get_tile", lambda *a: pytest.fail("a tile was built"))
    rng = np.random.default_rng(19)
    q, k, v = qkv(rng, 4, 6)
    q2, cache, qo, pkv = shared_prefix_batch(rng, 1, [2, 2], [1, 1])
    if call == "block_sparse":
        bsr = L.BSR.from_block_mask(np.ones((2, 2), bool), (2, 3), (4, 6))
        run, want = (lambda t: block_sparse(q, k, v, bsr, tuning=t)), "PrefillTuning"
    elif call == "cascade":
        run, want = (lambda t: cuda_cascade(q2, L.cascade_decompose(qo, pkv), cache, tuning=t)), "CascadeTuning"
    else:
        run, want = (lambda t: split_kv(q, k, v, np.array([0, 3, 6], np.int32), tuning=t)), "CascadeTuning"
    for bad in (DECODE, PREFILL if want == "CascadeTuning" else CASCADE, 3):
        with pytest.raises(TypeError, match=f"tuning must be a nbattn.cuda.tuning.{want}"):
            run(bad)


def test_cascade_rejects_bad_levels():
    rng = np.random.default_rng(15)
    q, cache, qo, pkv = shared_prefix_batch(rng, 1, [2, 2], [1, 1])
    levels = L.cascade_decompose(qo, pkv)
    bad = L.CascadeLevel(np.array([0, 1, 2], np.int32), levels[0].paged_kv_indptr,
                         levels[0].paged_kv_indices, levels[0].paged_kv_last_page_len)
    with pytest.raises(ValueError, match="levels"):
        cuda_cascade(q, [bad, levels[1]], cache)


@pytest.mark.skipif(SIM, reason="needs a real GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_pipelined_sparse_and_cascade(d):
    """Block-sparse (missing keys past N, causal) and a split cascade (float32
    partial states) on the pipelined tensor-core kernel's head dims."""
    rng = np.random.default_rng(d)
    m, n = 150, 700
    q, k, v = qkv(rng, m, n, hq=8, hk=2, d=d)
    mask = rng.random((-(-m // 7), -(-n // 9))) < 0.5
    mask[1] = False
    bsr = L.BSR.from_block_mask(mask, (7, 9), (m, n))
    got = block_sparse(q, k, v, bsr, return_lse=True, tensor_cores=True, causal=True)
    check(got, R.block_sparse(q, k, v, bsr, return_lse=True, causal=True), tol=2e-2)
    q, cache, qo, pkv = shared_prefix_batch(rng, 40, [30, 70, 5], [3, 1, 20], page_size=4, hq=8, hk=2, d=d)
    levels = L.cascade_decompose(qo, pkv)
    got = cuda_cascade(q, levels, cache, causal=True, return_lse=True, tensor_cores=True, kv_chunk=64)
    check(got, R.cascade(q, levels, cache, causal=True, return_lse=True), tol=2e-2)



@pytest.mark.skipif(SIM, reason="needs a real GPU")
@pytest.mark.gpu
def test_gpu_rope_block_sparse_and_cascade():
    """RoPE in block_sparse (the teaching tile) and in a split cascade (fp16, head_dim 128:
    the pipelined tensor-core tile) on a GPU, keys at positions up to about 800, against
    the golden model."""
    rng = np.random.default_rng(128)
    kw = dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5, causal=True)
    m, n = 150, 700
    q, k, v = qkv(rng, m, n, hq=8, hk=2, d=128)
    bsr = L.BSR.from_block_mask(rng.random((-(-m // 7), -(-n // 9))) < 0.5, (7, 9), (m, n))
    check(block_sparse(q, k, v, bsr, return_lse=True, **kw), R.block_sparse(q, k, v, bsr, return_lse=True, **kw),
          tol=2e-2)
    q, cache, qo, pkv = shared_prefix_batch(rng, 160, [30, 70, 5], [3, 1, 20], page_size=4, hq=8, hk=2, d=128)
    levels = L.cascade_decompose(qo, pkv)
    got = cuda_cascade(q, levels, cache, return_lse=True, kv_chunk=128, **kw)
    check(got, R.cascade(q, levels, cache, return_lse=True, **kw), tol=2e-2)

def test_cascade_chunk_size_fills_one_wave_in_whole_tiles(monkeypatch):
    """The prefix split (GPU only): as many chunks as one wave of CTAs holds,
    each a whole number of KV tiles, never below CascadeTuning.min_chunk; no split
    when the unsplit level already fills the GPU."""
    import importlib

    from nbattn.cuda import prefill as P
    from nbattn.variants import Variant

    C = importlib.import_module("nbattn.cuda.cascade")     # the package exports the function under this name
    monkeypatch.setattr(C, "SIMULATOR", False)
    monkeypatch.setattr(C, "sm_count", lambda: 132)
    spec = P.KernelSpec("paged", "NHD", "f16", "f32", 128, 4, 32, Variant(), True, 64, 64, 128)

    def level(n_groups, rows_per_group, kv_len):
        qo = L.RaggedQ.validate(np.arange(n_groups + 1, dtype=np.int32) * rows_per_group)
        pages = -(-kv_len // 16)
        pkv = L.PagedKV.validate(np.arange(n_groups + 1, dtype=np.int32) * pages,
                                 np.zeros(n_groups * pages, np.int32), np.full(n_groups, 16, np.int32), 16, 1)
        return qo, pkv

    for tuning in (CASCADE, CASCADE.replace(min_blocks_split=2, min_chunk=512)):
        slots = tuning.min_blocks_split * 132
        for batch, prefix in ((64, 32768), (16, 32768), (16, 1024), (64, 1024)):
            qo, pkv = level(1, batch, prefix)
            chunk = C.chunk_size(qo, pkv, spec, 8, tuning)
            ctas = -(-batch * 4 // 64) * 8
            assert chunk % 64 == 0 and chunk >= tuning.min_chunk
            assert ctas * -(-prefix // chunk) <= slots or chunk == tuning.min_chunk
        assert C.chunk_size(*level(64, 1, 128), spec, 8, tuning) == 0          # 64 suffix groups x 8 heads: full
    causal = P.KernelSpec("paged", "NHD", "f16", "f32", 128, 4, 32, Variant(causal=True), True, 64, 64, 128)
    assert C.split_blocks(spec) == CASCADE.min_blocks_split and C.split_blocks(causal) == CASCADE.min_blocks
    assert C.split_blocks(spec, CASCADE.replace(min_blocks_split=4)) == 4


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, rope_scale=2.0, rope_theta=300.0)])
def test_cascade_with_rope_turns_each_key_by_its_position_in_its_request(kw):
    """RoPE at attention time in a cascade: a shared prefix's keys sit at positions 0.., each
    suffix's after them; two levels (a decode step's rows and a prefill's), three nested levels
    with a split, against the golden cascade and flat attention."""
    kw = dict(kw, pos_encoding_mode="ROPE_LLAMA")
    rng = np.random.default_rng(31)
    for suffix, qo_lens in (([3, 5, 1], [2, 1, 3]), ([5, 0, 7, 2], [1, 1, 1, 1])):
        q, cache, qo, pkv = shared_prefix_batch(rng, 2, suffix, qo_lens)
        levels = L.cascade_decompose(qo, pkv)
        got = cuda_cascade(q, levels, cache, return_lse=True, **kw)
        check(got, R.cascade(q, levels, cache, return_lse=True, **kw))
        check(got, R.batch_prefill_paged(q, cache, qo, pkv.paged_kv_indptr, pkv.paged_kv_indices,
                                         pkv.paged_kv_last_page_len, return_lse=True, **kw))
    q, cache, qo, pkv = shared_prefix_batch(rng, 3, [2, 6, 4, 1], [1, 2, 1, 1])
    p = L.cascade_decompose(qo, pkv)[0].paged_kv_indices
    lv0 = L.CascadeLevel(np.array([0, 5], np.int32), np.array([0, 1], np.int32), p[:1], np.array([4], np.int32))
    lv1 = L.CascadeLevel(np.array([0, 3, 5], np.int32), np.array([0, 2, 4], np.int32),
                         np.concatenate([p[1:3], p[1:3]]), np.array([4, 4], np.int32))
    levels = [lv0, lv1, L.cascade_decompose(qo, pkv)[1]]
    got = cuda_cascade(q, levels, cache, return_lse=True, kv_chunk=3, **kw)
    check(got, R.cascade(q, levels, cache, return_lse=True, **kw))


def test_cascade_with_rope_refuses_a_group_whose_requests_see_its_keys_at_different_positions():
    """Level 1's one group serves two requests whose level 0 held 8 and 4 keys: one turned copy
    of its keys cannot serve both.  Refused naming the level, before any kernel, out= unchanged;
    the golden model, which turns per request, takes it."""
    rng = np.random.default_rng(32)
    q, cache, qo, pkv = shared_prefix_batch(rng, 3, [1, 1], [1, 1])
    p = np.concatenate([pkv.paged_kv_indices[:3], pkv.paged_kv_indices[[3, 7]]])   # 3 shared, 2 own pages
    lv0 = L.CascadeLevel(np.array([0, 1, 2], np.int32), np.array([0, 2, 3], np.int32), p[[0, 1, 0]],
                         np.array([4, 4], np.int32))
    lv1 = L.CascadeLevel(np.array([0, 2], np.int32), np.array([0, 1], np.int32), p[2:3], np.array([4], np.int32))
    lv2 = L.CascadeLevel(np.array([0, 1, 2], np.int32), np.array([0, 1, 2], np.int32), p[3:5],
                         np.array([1, 1], np.int32))
    levels = [lv0, lv1, lv2]
    kw = dict(pos_encoding_mode="ROPE_LLAMA")
    R.cascade(q, levels, cache, **kw)
    out = np.full(q.shape, 7.0, q.dtype)
    with pytest.raises(NotImplementedError, match=r"^levels\[1\]: with pos_encoding_mode='ROPE_LLAMA' the requests "
                                                  r"of a group must find its keys at one position.* 4 and 8 keys"):
        cuda_cascade(q, levels, cache, out=out, **kw)
    assert np.all(out == 7.0)
    check(cuda_cascade(q, levels, cache, return_lse=True), R.cascade(q, levels, cache, return_lse=True))


@pytest.mark.parametrize("block, kw", [((3, 3), dict()), ((2, 5), dict(causal=True, rope_theta=50.0)),
                                       ((4, 2), dict(rope_scale=3.0))])
def test_block_sparse_with_rope_turns_rows_and_keys_by_their_positions(block, kw):
    """Query row i turns to N - M + i, key j to j: against the golden block_sparse, and a full
    block mask against the golden single_prefill; tensor_cores=True is refused."""
    kw = dict(kw, pos_encoding_mode="ROPE_LLAMA")
    rng = np.random.default_rng(19)
    m, n = 7, 12
    q, k, v = qkv(rng, m, n)
    mask = rng.random((-(-m // block[0]), -(-n // block[1]))) < 0.6
    bsr = L.BSR.from_block_mask(mask, block, (m, n))
    check(block_sparse(q, k, v, bsr, return_lse=True, **kw), R.block_sparse(q, k, v, bsr, return_lse=True, **kw))
    full = L.BSR.from_block_mask(np.ones_like(mask), block, (m, n))
    check(block_sparse(q, k, v, full, return_lse=True, **kw), R.single_prefill(q, k, v, return_lse=True, **kw))
    with pytest.raises(ValueError, match="^tensor_cores: pos_encoding_mode='ROPE_LLAMA'"):
        block_sparse(q, k, v, bsr, tensor_cores=True, **kw)
