"""nbattn.cuda prefill kernels against the golden model (docs/concepts/layouts.md, masks.md, state.md).

Under the simulator (CI) the CUDA-core path runs on tiny shapes; on a GPU the
same cases also run the tensor-core path (``gpu`` marks the real-size ones).
"""
import os

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn import _compat
from nbattn import layout as L
from nbattn import reference as R
from nbattn.cuda import prefill as P
from nbattn.cuda.host import prefill_launch as PL
from nbattn.cuda.tuning import PREFILL
from nbattn.variants import Variant

SIM = _compat.simulator_enabled()
# tensor_cores off / on; NBATTN_TEST_PATHS=tc runs only the tensor-core path (a short GPU session)
PATHS = [False] if SIM else ([True] if os.environ.get("NBATTN_TEST_PATHS") == "tc" else [False, True])
gpu = pytest.mark.skipif(SIM, reason="needs a real GPU")


def f32(x):
    return np.asarray(x, np.float32)


def check(got, ref, tol=2e-3):
    """Output within fp16 rounding; LSE exact in where it is -inf, close elsewhere."""
    if isinstance(ref, tuple):
        (o, lse), (o_r, lse_r) = got, ref
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_r))
        fin = np.isfinite(lse_r)
        np.testing.assert_allclose(lse[fin], lse_r[fin], rtol=tol, atol=tol)
    else:
        o, o_r = got, ref
    assert np.isfinite(f32(o)).all()
    np.testing.assert_allclose(f32(o), o_r, rtol=tol, atol=tol)


def paged_case(rng, qo_lens, kv_lens, page_size, hq=4, hk=2, d=16, dtype=np.float16, share=False,
               layout="NHD"):
    pool = int(sum(-(-k // page_size) for k in kv_lens)) + 3
    pkv = L.PagedKV.allocate(kv_lens, page_size, num_pages=pool, rng=rng)
    ind = pkv.paged_kv_indices.copy()
    if share and len(kv_lens) > 1 and kv_lens[0] >= page_size and kv_lens[1] > page_size:
        ind[pkv.paged_kv_indptr[1]] = ind[0]            # request 1 reuses request 0's first page
    shape = (pool, 2, page_size, hk, d) if layout == "NHD" else (pool, 2, hk, page_size, d)
    cache = rng.standard_normal(shape).astype(dtype)
    q = rng.standard_normal((sum(qo_lens), hq, d)).astype(dtype)
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    return q, cache, qo, pkv.paged_kv_indptr, ind, pkv.paged_kv_last_page_len


def both(fn_cuda, fn_ref, args, tc, **kw):
    got = fn_cuda(*args, tensor_cores=tc, **kw)
    ref = fn_ref(*args, **kw)
    return got, ref


@pytest.mark.parametrize("tc", PATHS)
@pytest.mark.parametrize("causal", [False, True])
def test_paged_gqa_partial_and_shared_pages(tc, causal):
    rng = np.random.default_rng(1)
    args = paged_case(rng, [3, 1, 5, 0], [6, 2, 9, 3], 4, share=True)
    check(*both(P.batch_prefill_paged, R.batch_prefill_paged, args, tc, causal=causal, return_lse=True))


@pytest.mark.parametrize("tc", PATHS)
def test_paged_hnd_page1_mha_and_empty_kv(tc):
    rng = np.random.default_rng(2)
    args = paged_case(rng, [2, 3], [0, 5], 1, hq=2, hk=2, layout="HND")
    got, ref = both(P.batch_prefill_paged, R.batch_prefill_paged, args, tc, kv_layout="HND",
                    return_lse=True)
    check(got, ref)
    assert np.isneginf(got[1][:2]).all() and (f32(got[0][:2]) == 0).all()   # no keys: o=0, lse=-inf


@pytest.mark.parametrize("tc", PATHS)
@pytest.mark.parametrize("kw", [
    dict(causal=True, window_left=2),
    dict(causal=True, window_left=1, sink_size=2),
    dict(logits_soft_cap=3.0, pos_encoding_mode="ALIBI", sm_scale=0.3),
    dict(use_sigmoid=True, sigmoid_bias=-1.0, causal=True),
    dict(score_mod=lambda s, b, h, qi, kj: s + 0.1 * (h + b) - 0.05 * (qi - kj)),
])
def test_variants(tc, kw):
    rng = np.random.default_rng(3)
    args = paged_case(rng, [4, 2], [7, 5], 3)
    lse = not kw.get("use_sigmoid")
    check(*both(P.batch_prefill_paged, R.batch_prefill_paged, args, tc, return_lse=lse, **kw))


@pytest.mark.parametrize("tc", PATHS)
def test_fully_masked_rows_and_huge_logits(tc):
    rng = np.random.default_rng(4)
    q, cache, qo, ip, ix, lp = paged_case(rng, [3], [6], 4, hq=2, hk=1, dtype=np.float32 if not tc else np.float16)
    q = (q * 40).astype(q.dtype)                    # scores of order +-1000
    cache = (cache * 40).astype(cache.dtype)
    mask = lambda b, h, qi, kj: qi != 4            # the middle query row keeps nothing
    args = (q, cache, qo, ip, ix, lp)
    got, ref = both(P.batch_prefill_paged, R.batch_prefill_paged, args, tc, mask_mod=mask, return_lse=True)
    assert np.abs(ref[1][np.isfinite(ref[1])]).max() > 500
    check(got, ref, tol=2e-2 if tc else 2e-3)
    assert np.isneginf(got[1][1]).all() and (f32(got[0][1]) == 0).all()


@pytest.mark.parametrize("tc", PATHS)
def test_ragged_and_single(tc):
    rng = np.random.default_rng(5)
    hq, hk, d = 4, 1, 16
    q = rng.standard_normal((5, hq, d)).astype(np.float16)
    k = rng.standard_normal((9, hk, d)).astype(np.float16)
    v = rng.standard_normal((9, hk, d)).astype(np.float16)
    qo, kv = np.array([0, 2, 5], np.int32), np.array([0, 3, 9], np.int32)
    check(*both(P.batch_prefill_ragged, R.batch_prefill_ragged, (q, k, v, qo, kv), tc, causal=True,
                return_lse=True))
    check(*both(P.single_prefill, R.single_prefill, (q[:3], k, v), tc, causal=True, return_lse=True))


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    q, cache, qo, ip, ix, lp = paged_case(rng, [2], [5], 2)
    o = P.batch_prefill_paged(torch.from_numpy(q), torch.from_numpy(cache), qo, ip, ix, lp)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float16
    check(o.numpy(), R.batch_prefill_paged(q, cache, qo, ip, ix, lp))


@pytest.mark.parametrize("tdtype", ["float16", "bfloat16", "float32"])
def test_torch_cpu_inputs_handled_as_before(tdtype):
    """CPU torch tensors are accepted like NumPy arrays (copied to the device) and
    answered in kind: torch CPU results in q's dtype, float32 LSE, the same bits
    as the NumPy path; ``out=``/``lse=`` CPU tensors are filled in place and
    returned; a wrong ``out`` dtype or a non-float32 ``lse`` is rejected."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(16)
    q, cache, qo, ip, ix, lp = paged_case(rng, [3, 2], [6, 5], 4, dtype=np.float32)
    tdt = getattr(torch, tdtype)
    tq, tcache = torch.from_numpy(q).to(tdt), torch.from_numpy(cache).to(tdt)
    o, lse = P.batch_prefill_paged(tq, tcache, qo, ip, ix, lp, causal=True, return_lse=True)
    assert isinstance(o, torch.Tensor) and o.dtype == tdt and o.device.type == "cpu"
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and tuple(lse.shape) == (5, 4)
    # the same bits as host NumPy inputs (bf16 as its raw |V2 view)
    if tdtype == "bfloat16":
        nq, ncache = (t.view(torch.int16).numpy().view("V2") for t in (tq, tcache))
    else:
        nq, ncache = tq.numpy(), tcache.numpy()
    o_np, lse_np = P.batch_prefill_paged(nq, ncache, qo, ip, ix, lp, causal=True, return_lse=True)
    np.testing.assert_array_equal(o.float().numpy(), f32(o_np))
    np.testing.assert_array_equal(lse.numpy(), lse_np)
    check((o.float().numpy(), lse.numpy()),
          R.batch_prefill_paged(tq.float().numpy(), tcache.float().numpy(), qo, ip, ix, lp, causal=True,
                                return_lse=True), tol=2e-2 if tdtype == "bfloat16" else 2e-3)
    # caller's buffers: filled in place, the same objects come back
    out, lse_buf = torch.full_like(tq, float("nan")), torch.full((5, 4), float("nan"))
    o2, l2 = P.batch_prefill_paged(tq, tcache, qo, ip, ix, lp, causal=True, return_lse=True, out=out,
                                   lse=lse_buf)
    assert o2 is out and l2 is lse_buf
    assert torch.equal(out, o) and torch.equal(lse_buf, lse)
    # a mixed host batch (torch q, NumPy k/v) answers in q's kind; wrong buffers are rejected
    if tdtype != "bfloat16":
        k = q[:4, :2].astype(tdtype)
        o3 = P.single_prefill(tq[:3], k, k + 1)
        assert isinstance(o3, torch.Tensor) and o3.dtype == tdt
        np.testing.assert_array_equal(o3.numpy(), P.single_prefill(tq[:3].numpy(), k, k + 1))
    wrong = torch.float32 if tdtype != "float32" else torch.float16
    with pytest.raises(ValueError, match="out: must have shape"):
        P.batch_prefill_paged(tq, tcache, qo, ip, ix, lp, out=torch.zeros(tuple(tq.shape), dtype=wrong))
    with pytest.raises(ValueError, match="lse: must be float32"):
        P.batch_prefill_paged(tq, tcache, qo, ip, ix, lp, lse=torch.zeros((5, 4), dtype=torch.float16))


def test_stream_is_the_callers_or_torchs_current(monkeypatch):
    """stream=0 (the default) launches where decode does (torch's current stream for
    torch CUDA inputs, :func:`nbattn.cuda.host.arrays.launch_stream`); a passed stream wins."""
    from nbattn.cuda.host import arrays as A
    seen = []
    monkeypatch.setattr(A, "launch_stream", lambda *arrays: seen.append(arrays) or "torch-current")
    assert P.resolve_stream(0, "q", None) == "torch-current" and seen == [("q", None)]
    assert P.resolve_stream(None, "q") == "torch-current"
    mine = object()
    assert P.resolve_stream(mine, "q") is mine and len(seen) == 2


@pytest.mark.parametrize("bad, match", [
    (dict(qo=np.array([0, 3, 4], np.float64)), "must be int32"),
    (dict(lp=np.array([0, 2], np.int32)), "paged_kv_last_page_len"),
    (dict(ix=np.array([0, 1, 99], np.int32)), "page ids must be"),
    (dict(q_heads=3), "num_qo_heads"),
    (dict(qdtype=np.float32), "dtype must match"),
    (dict(causal_long=True), "qo length"),
])
def test_bad_inputs_raise_before_launch(bad, match, monkeypatch):
    rng = np.random.default_rng(7)
    q, cache, qo, ip, ix, lp = paged_case(rng, [3, 1], [5, 2], 4)
    launched = []
    monkeypatch.setattr(P, "launch", lambda *a, **k: launched.append(1))
    qo = bad.get("qo", qo)
    lp = bad.get("lp", lp)
    ix = bad.get("ix", ix)
    if "q_heads" in bad:
        q = q[:, :3]
    if "qdtype" in bad:
        q = q.astype(np.float32)
    causal = bool(bad.get("causal_long"))
    if causal:
        qo = np.array([0, 3, 6], np.int32)
        q = np.concatenate([q, q[:2]])
    with pytest.raises(ValueError, match=match):
        P.batch_prefill_paged(q, cache, qo, ip, ix, lp, causal=causal)
    assert not launched


def test_sigmoid_has_no_lse():
    rng = np.random.default_rng(8)
    with pytest.raises(ValueError, match="return_lse"):
        P.batch_prefill_paged(*paged_case(rng, [1], [2], 2), use_sigmoid=True, return_lse=True)


# ---------------------------------------------------------------------------
# Real sizes on the GPU (both paths)
# ---------------------------------------------------------------------------

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tc", PATHS)
@pytest.mark.parametrize("page_size, group, d, dtype", [
    (1, 1, 64, "f16"), (5, 4, 128, "bf16"), (16, 8, 256, "f16"), (16, 4, 128, "bf16")])
def test_gpu_real_sizes(tc, page_size, group, d, dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(page_size * 10 + group)
    qo_lens = [1, 17, 577, 64, 0, 130]
    kv_lens = [1, 300, 2000, 8192, 40, 130]
    hk = 2
    q, cache, qo, ip, ix, lp = paged_case(rng, qo_lens, kv_lens, page_size, hq=hk * group, hk=hk, d=d,
                                          dtype=np.float32)
    tdt = torch.float16 if dtype == "f16" else torch.bfloat16
    tq, tc_ = torch.from_numpy(q).to("cuda", tdt), torch.from_numpy(cache).to("cuda", tdt)
    for causal in (False, True):
        o, lse = P.batch_prefill_paged(tq, tc_, qo, ip, ix, lp, causal=causal, return_lse=True, tensor_cores=tc)
        ref = R.batch_prefill_paged(tq.float().cpu().numpy(), tc_.float().cpu().numpy(), qo, ip, ix, lp,
                                    causal=causal, return_lse=True)
        check((o.float().cpu().numpy(), lse.cpu().numpy()), ref, tol=2e-2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d, dtype, layout, kw", [
    (128, "bf16", "HND", dict(causal=True, window_left=70, sink_size=3, pos_encoding_mode="ALIBI",
                              logits_soft_cap=20.0)),
    (64, "f16", "NHD", dict(use_sigmoid=True, sigmoid_bias=-1.0, causal=True)),
    (128, "f16", "NHD", dict(mask_mod=lambda b, h, qi, kj: (qi + kj) % 3 != 0)),
    (64, "bf16", "NHD", dict(score_mod=lambda s, b, h, qi, kj: s - 0.01 * (qi - kj), causal=True)),
])
def test_gpu_pipelined_variants(d, dtype, layout, kw):
    """The pipelined tensor-core kernel (head_dim 64/128) on its masked tiles:
    window + sinks + ALiBi + soft-cap, sigmoid, user mask and score functions,
    with key ranges that end inside a 64-key tile and a page size that does
    not divide it."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(d + len(kw))
    q, cache, qo, ip, ix, lp = paged_case(rng, [70, 1, 130, 0], [300, 1, 200, 50], 5, hq=8, hk=2, d=d,
                                          dtype=np.float32, layout=layout)
    tdt = torch.float16 if dtype == "f16" else torch.bfloat16
    tq, tc_ = torch.from_numpy(q).to("cuda", tdt), torch.from_numpy(cache).to("cuda", tdt)
    lse = not kw.get("use_sigmoid")
    got = P.batch_prefill_paged(tq, tc_, qo, ip, ix, lp, kv_layout=layout, return_lse=lse, tensor_cores=True, **kw)
    ref = R.batch_prefill_paged(tq.float().cpu().numpy(), tc_.float().cpu().numpy(), qo, ip, ix, lp,
                                kv_layout=layout, return_lse=lse, **kw)
    got = (got[0].float().cpu().numpy(), got[1].cpu().numpy()) if lse else got.float().cpu().numpy()
    check(got, ref, tol=2e-2)


@pytest.mark.parametrize("tc", PATHS)
@pytest.mark.parametrize("d", [16] if SIM else [64, 256])
def test_heads_of_later_tiles_with_a_group_of_three(tc, d):
    """A tile starts at fused row row0 of its request; with a group that does not
    divide the tile height, row r's head is head0 + (row0 + r) % group, not
    head0 + r % group.  ALiBi slopes and a head-dependent mask see the head, so
    every tile after the first of a request checks it (the tensor-core tiles
    had the second form until this test)."""
    rng = np.random.default_rng(31 + d)
    qo_lens = [7, 5] if SIM else [50, 30]          # 3 fused rows each: several tiles per request
    kv_lens = [9, 12] if SIM else [90, 70]
    q, cache, qo, ip, ix, lp = paged_case(rng, qo_lens, kv_lens, 4, hq=6, hk=2, d=d)
    kw = dict(causal=True, pos_encoding_mode="ALIBI", mask_mod=lambda b, h, qi, kj: (kj + h) % 4 != 0)
    got = P.batch_prefill_paged(q, cache, qo, ip, ix, lp, return_lse=True, tensor_cores=tc, **kw)
    ref = R.batch_prefill_paged(q, cache, qo, ip, ix, lp, return_lse=True, **kw)
    check(got, ref, tol=2e-2 if tc else 2e-3)


@pytest.mark.parametrize("fn", ["batch_prefill_paged", "batch_prefill_ragged", "single_prefill"])
def test_tuning_must_be_a_prefill_tuning(fn, monkeypatch):
    """``tuning=`` takes a PrefillTuning (or None); anything else is a TypeError naming
    it, raised before any kernel is built or launched."""
    from nbattn.cuda.tuning import DECODE
    rng = np.random.default_rng(8)
    q, cache, qo, ip, ix, lp = paged_case(rng, [3, 1], [5, 2], 4)
    k = v = rng.standard_normal((5, 2, 16)).astype(np.float16)
    args = {"batch_prefill_paged": (q, cache, qo, ip, ix, lp),
            "batch_prefill_ragged": (q, k, v, qo, np.array([0, 3, 5], np.int32)),
            "single_prefill": (q[:3], k, v)}[fn]
    monkeypatch.setattr(P, "get_kernel", lambda *a: pytest.fail("a kernel was built"))
    for bad in (DECODE, {"unroll": (4, 4)}, "rows"):
        with pytest.raises(TypeError, match="tuning must be a nbattn.cuda.tuning.PrefillTuning"):
            getattr(P, fn)(*args, tuning=bad)


def test_tuning_reaches_the_kernel_and_keeps_the_result():
    """A tuning other than the default builds other kernels (its fields are part of the
    cache key) and computes the same attention."""
    rng = np.random.default_rng(9)
    q, cache, qo, ip, ix, lp = paged_case(rng, [9, 3], [17, 3], 4, hq=8, hk=2, d=16)
    base = P.batch_prefill_paged(q, cache, qo, ip, ix, lp, causal=True, return_lse=True, tensor_cores=False)
    for tuning in (PREFILL.replace(unroll=(2, 2)), PREFILL.replace(cuda_core=False),
                   PREFILL.replace(longest_first=False)):
        n = len(P.KERNELS)
        got = P.batch_prefill_paged(q, cache, qo, ip, ix, lp, causal=True, return_lse=True, tensor_cores=False,
                                    tuning=tuning)
        assert len(P.KERNELS) > n
        check(got, base, tol=1e-3)


def test_causal_work_starts_longest_first():
    """Causal query tiles launch most-keys-first (a permutation of build_work's
    rows, stable among equals); other masks keep build_work's order."""
    rng = np.random.default_rng()
    qo_lens = rng.integers(1, 40, size=5)
    kv_lens = qo_lens + rng.integers(0, 30, size=5)
    qo = L.RaggedQ.validate(np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32))
    spec = P.make_spec("paged", "NHD", "f16", 16, 8, 2, Variant(causal=True), False)
    work = P.build_work(qo.qo_indptr[:-1], qo.lengths, np.zeros(5, np.int32), np.zeros(5, np.int32),
                        kv_lens, spec.group, spec.tile_q)
    pos, kvoff, _ = P.request_rows(qo, kv_lens)
    order = P.longest_first(spec, work, pos, kvoff)
    assert sorted(map(tuple, order)) == sorted(map(tuple, work))
    # brute force: keys the tile's last fused row sees
    keys = []
    for qo_start, qo_len, row0, *_ in order:
        qi = min(qo_len - 1, (row0 + spec.tile_q - 1) // spec.group)
        keys.append(int(pos[qo_start + qi]) + 1)
    assert keys == sorted(keys, reverse=True)
    plain = P.make_spec("paged", "NHD", "f16", 16, 8, 2, Variant(), False)
    assert P.longest_first(plain, work, pos, kvoff) is work
    # PrefillTuning.longest_first off: build_work's order (and another kernel build)
    off = P.make_spec("paged", "NHD", "f16", 16, 8, 2, Variant(causal=True), False,
                      tuning=PREFILL.replace(longest_first=False))
    assert P.longest_first(off, work, pos, kvoff) is work and off != spec


@pytest.mark.parametrize("tc", PATHS)
def test_bound_launch_reused_across_metadata_sizes(tc, monkeypatch):
    """One kernel and call shape (q, k, v, out, lse) bind one launch; calls whose metadata
    differ in size (other request splits, so other work lists) reuse it and still
    match the golden model -- and the kept shapes are bounded."""
    rng = np.random.default_rng(11)
    hq, hk, d = 4, 2, 16
    q = rng.standard_normal((12, hq, d)).astype(np.float16)
    k = rng.standard_normal((40, hk, d)).astype(np.float16)
    v = rng.standard_normal((40, hk, d)).astype(np.float16)
    PL.BOUND.clear()
    for qo_lens, kv_lens in (([12], [40]), ([3, 9], [10, 30]), ([1, 1, 10], [1, 19, 20]), ([0, 12], [5, 35])):
        qo, kv = np.cumsum([0] + qo_lens).astype(np.int32), np.cumsum([0] + kv_lens).astype(np.int32)
        for causal in (False, True):
            check(*both(P.batch_prefill_ragged, R.batch_prefill_ragged, (q, k, v, qo, kv), tc,
                        causal=causal, return_lse=True))
    assert len(PL.BOUND) == 2                           # one per kernel: causal and not
    monkeypatch.setattr(PL, "BOUND_MOST", 3)
    for n in range(2, 8):                               # every KV length a new call shape
        P.single_prefill(q[:1], k[:n], v[:n], tensor_cores=tc)
    assert len(PL.BOUND) == 3


def _work_by_loop(qo_starts, qo_lens, kv_ptrs, kv_bases, kv_lens, group, tile_q, kv_chunk=None,
                  out_starts=None, chunk_stride=0):
    """The work list written as the docstring reads: request, then KV chunk, then query tile."""
    out_starts = qo_starts if out_starts is None else out_starts
    rows = []
    for i in range(len(qo_lens)):
        n_chunks = 1 if not kv_chunk else max(1, -(-int(kv_lens[i]) // kv_chunk))
        for c in range(n_chunks):
            begin = 0 if not kv_chunk else c * kv_chunk
            end = int(kv_lens[i]) if not kv_chunk else min(int(kv_lens[i]), begin + kv_chunk)
            for row0 in range(0, int(qo_lens[i]) * group, tile_q):
                rows.append((qo_starts[i], qo_lens[i], row0, kv_ptrs[i], kv_bases[i], begin, end,
                             out_starts[i] + c * chunk_stride))
    return np.asarray(rows, dtype=np.int32).reshape(-1, 8)


def test_build_work_equals_the_loop():
    """build_work (vectorized) gives exactly the rows, in the order, of the loop over
    requests, chunks and tiles -- empty requests, empty KV, chunking and output strides included."""
    rng = np.random.default_rng()
    for _ in range(200):
        n = int(rng.integers(0, 12))
        qo_lens = rng.integers(0, 70, size=n) * (rng.random(n) > 0.2)
        kv_lens = rng.integers(0, 300, size=n) * (rng.random(n) > 0.1)
        qo_starts = np.concatenate([[0], np.cumsum(qo_lens)[:-1]]).astype(np.int64) if n else np.zeros(0, np.int64)
        kv_ptrs, kv_bases = rng.integers(0, 1000, size=n), rng.integers(0, 1000, size=n)
        group, tile_q = int(rng.choice([1, 2, 4, 8])), int(rng.choice([16, 32, 64, 128]))
        kw = {}
        if rng.random() < 0.5:
            kw = dict(kv_chunk=int(rng.choice([16, 48, 1000])), out_starts=qo_starts + 5,
                      chunk_stride=int(rng.integers(0, 400)))
        got = P.build_work(qo_starts, qo_lens, kv_ptrs, kv_bases, kv_lens, group, tile_q, **kw)
        want = _work_by_loop(qo_starts, qo_lens, kv_ptrs, kv_bases, kv_lens, group, tile_q, **kw)
        assert got.dtype == np.int32 and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@gpu
@pytest.mark.gpu
def test_gpu_torch_calls_bound_per_shape_and_stride():
    """Torch CUDA tensors in the plain prefill forms launch through bound launches
    keyed by shape and strides: alternating strided and contiguous q, other lengths,
    an ``out=`` buffer and a side stream must each give the golden model's answer."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(231)
    side = torch.cuda.Stream()
    for trial, (nq, nkv) in enumerate([(40, 90), (40, 90), (7, 300), (40, 90), (129, 129)]):
        hq, hk, d = 8, 2, 128
        q = torch.from_numpy(rng.standard_normal((hq, nq, d)).astype(np.float32)).to("cuda", torch.float16)
        q = q.transpose(0, 1) if trial % 2 else q.transpose(0, 1).contiguous()     # strided, then not
        k, v = (torch.from_numpy(rng.standard_normal((nkv, hk, d)).astype(np.float32)).to("cuda", torch.float16)
                for _ in range(2))
        ref = R.single_prefill(q.float().cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy(),
                               causal=True, return_lse=True)
        check(tuple(x.float().cpu().numpy() for x in P.single_prefill(q, k, v, causal=True, return_lse=True)),
              ref, tol=2e-2)
        out = torch.full((nq, hq, d), float("nan"), dtype=torch.float16, device="cuda")
        with torch.cuda.stream(side):
            o = P.batch_prefill_ragged(q, k, v, np.array([0, nq], np.int32), np.array([0, nkv], np.int32),
                                       causal=True, out=out)
        side.synchronize()
        assert o.data_ptr() == out.data_ptr()
        check(out.float().cpu().numpy(), ref[0], tol=2e-2)
