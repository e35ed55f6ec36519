"""Every variant on every GPU-only kernel path, against the golden model in float64.

The simulator runs one prefill tile and one decode kernel at tiny shapes; a GPU
runs others: the register-tiled CUDA-core prefill tile at its real shape (fp32,
and fp16/bf16 when tensor cores are turned off), the tensor-core prefill tiles
(pipelined for head_dim 64/128, the plain mma tile for other head dims), and
the warp and tensor-core decode kernels.  Query and key lengths differ, last
pages are not full, pages are shuffled, and GQA fuses heads.

Run on a GPU with ``python -m pytest -n 8 tests/test_gpu_variants.py`` (the
cost is compilation, one kernel per case: spread it over processes).
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import nbattn  # noqa: F401  (simulator choice first)
from nbattn import reference as R
from nbattn.cuda import decode as DEC
from nbattn.cuda import prefill as P
from nbattn.cuda import batch_decode_paged, batch_prefill_paged, single_prefill
from nbattn.cuda.blocks.primitives import SIMULATOR
from nbattn.cuda.tuning import DECODE

from brute import random_paged_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SIMULATOR, reason="needs a real GPU")]


def tilt_pos(score, b, h, q_idx, kv_idx):          # depends on positions only
    return score - 0.05 * (q_idx - kv_idx)


def scale_head_batch(score, b, h, q_idx, kv_idx):  # depends on the head and the request
    return score * (1.0 + 0.25 * h) + 0.5 * b * (score > 0)


def dilated(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx) % 3 != 1


VARIANTS = {
    "score_mod_positions": dict(causal=True, score_mod=tilt_pos),
    "score_mod_head_batch": dict(score_mod=scale_head_batch),
    "mask_mod": dict(causal=True, mask_mod=dilated),
    "soft_cap": dict(logits_soft_cap=4.0),
    "alibi": dict(causal=True, pos_encoding_mode="ALIBI"),
    "window_sinks": dict(causal=True, window_left=37, sink_size=3),
    "window": dict(causal=True, window_left=300),                   # decode plans the hidden pages out
    "sigmoid": dict(use_sigmoid=True, sigmoid_bias=-1.0),
    "combined": dict(causal=True, logits_soft_cap=8.0, pos_encoding_mode="ALIBI", window_left=80, sink_size=2,
                     score_mod=tilt_pos, mask_mod=dilated),
}

PREFILL_LENS = ([37, 1, 70, 0], [300, 129, 70, 5])
DECODE_LENS = [0, 1, 17, 700, 2500, 33]
SINGLE_LENS = (128, 1024, 1024)
TOL = {"f32": 2e-4, "f16": 6e-3, "bf16": 4e-2}
NP = {"f32": np.float32, "f16": np.float16}


def _cast(x, code):
    if code == "bf16":
        import torch
        return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).cuda()
    return x.astype(NP[code])


def _f64(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy().astype(np.float64)
    return np.asarray(x).astype(np.float64)


def _golden_inputs(*xs):
    return [_f64(x) for x in xs]


def _check(o, lse, ro, rlse, code, sigmoid):
    o = _f64(o)
    scale = 1.0 + np.abs(ro).max()
    np.testing.assert_allclose(o, ro, atol=TOL[code] * scale, rtol=TOL[code])
    if not sigmoid:
        lse = _f64(lse)
        assert np.array_equal(np.isneginf(lse), np.isneginf(rlse))
        fin = np.isfinite(rlse)
        np.testing.assert_allclose(lse[fin], rlse[fin], atol=10 * TOL[code], rtol=10 * TOL[code])


# Prefill paths: (kind, head_dim, tensor_cores) -> the tile it must build.
PREFILL_PATHS = {
    "cuda_core_f32": ("f32", 64, False),
    "cuda_core_f16": ("f16", 128, False),
    "tensor_core_pipelined_f16": ("f16", 128, True),
    "tensor_core_pipelined_bf16_d64": ("bf16", 64, True),
    "tensor_core_plain_d96": ("f16", 96, True),
}


def _prefill_spec(mode, code, head_dim, hq, hkv, variant_kw, tc):
    from nbattn.variants import variant_from_kwargs
    return P.make_spec(mode, "NHD", code, head_dim, hq, hkv, variant_from_kwargs(dict(variant_kw)), tc)


def _paged_prefill_and_golden(b, code, tc, kw):
    """``(o, lse, golden o, golden lse)`` of a paged batch ``b``: the kernel on the
    dtype ``code`` (``tensor_cores=tc``) and the golden model in float64 on the
    same rounded inputs; LSEs are None for sigmoid."""
    q, cache = _cast(b["q"], code), _cast(b["cache"], code)
    sig = bool(kw.get("use_sigmoid"))
    res = batch_prefill_paged(q, cache, b["qo_indptr"], b["indptr"], b["indices"], b["last"],
                              return_lse=not sig, tensor_cores=tc, **kw)
    o, lse = (res, None) if sig else res
    qg, cg = _golden_inputs(q, cache)
    gold = R.batch_prefill_paged(qg, cg, b["qo_indptr"], b["indptr"], b["indices"], b["last"],
                                 return_lse=not sig, dtype=np.float64, **kw)
    ro, rlse = (gold, None) if sig else gold
    return o, lse, ro, rlse


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", list(PREFILL_PATHS))
def test_paged_prefill_variant_on_path(path, variant):
    code, head_dim, tc = PREFILL_PATHS[path]
    kw = VARIANTS[variant]
    rng = np.random.default_rng([zlib.crc32(path.encode()), zlib.crc32(variant.encode())])
    qo_lens, kv_lens = PREFILL_LENS                                # q shorter than kv, one q == kv, one empty q
    b = random_paged_batch(rng, qo_lens=qo_lens, kv_lens=kv_lens, page_size=16, num_kv_heads=2, group=4,
                           head_dim=head_dim, share_first_page=True)
    if kw.get("logits_soft_cap"):
        b["q"] *= 8.0                                              # logits well past the cap
    spec = _prefill_spec("paged", code, head_dim, 8, 2, kw, tc)
    assert spec.tensor_cores == tc
    if not tc:
        from nbattn.cuda.kernels import prefill_cc as CC
        assert CC.covers(spec), "the register-tiled CUDA-core tile should take this case"
    _check(*_paged_prefill_and_golden(b, code, tc, kw), code, bool(kw.get("use_sigmoid")))


@pytest.mark.parametrize("variant", ["score_mod_positions", "mask_mod", "window_sinks", "combined"])
@pytest.mark.parametrize("path", ["cuda_core_f32", "tensor_core_pipelined_f16"])
def test_single_prefill_variant_on_path(path, variant):
    """Contiguous K/V, the notebooks' shape: 128 queries over 1024 keys, 8 heads."""
    code, head_dim, tc = PREFILL_PATHS[path]
    kw = VARIANTS[variant]
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((n, 8, head_dim)).astype(np.float32) for n in SINGLE_LENS)
    o, lse = single_prefill(_cast(q, code), _cast(k, code), _cast(v, code), return_lse=True, tensor_cores=tc, **kw)
    ro, rlse = R.single_prefill(*_golden_inputs(_cast(q, code), _cast(k, code), _cast(v, code)),
                                return_lse=True, dtype=np.float64, **kw)
    _check(o, lse, ro, rlse, code, False)


# Decode paths: (kind, head_dim, group, forced path)
DECODE_PATHS = {
    "warp_f16": ("f16", 128, 2, "warp"),
    "warp_f32": ("f32", 64, 4, "warp"),
    "tensor_core_f16": ("f16", 128, 4, "tc"),
    "tensor_core_bf16_g8": ("bf16", 64, 8, "tc"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", list(DECODE_PATHS))
def test_decode_variant_on_path(path, variant):
    code, head_dim, group, forced = DECODE_PATHS[path]
    kw = VARIANTS[variant]
    if forced == "tc" and kw.get("use_sigmoid"):
        pytest.skip("the tensor-core decode takes softmax variants only (sigmoid runs on the warp path)")
    tuning = DECODE.replace(path=forced)
    rng = np.random.default_rng([zlib.crc32(path.encode()), zlib.crc32(variant.encode()), 3])
    kv_lens = DECODE_LENS
    b = random_paged_batch(rng, qo_lens=[1] * len(kv_lens), kv_lens=kv_lens, page_size=16, num_kv_heads=2,
                           group=group, head_dim=head_dim, share_first_page=True)
    if kw.get("logits_soft_cap"):
        b["q"] *= 8.0
    dkw = {k: v for k, v in kw.items() if k != "causal"}          # one query row: causal changes nothing
    q, cache = _cast(b["q"], code), _cast(b["cache"], code)
    sig = bool(kw.get("use_sigmoid"))
    qg, cg = _golden_inputs(q, cache)
    for chunk in (None, 256):                                       # unsplit, and split + merge
        p = DEC.prepare_decode(q, cache, b["indptr"], b["indices"], b["last"], return_lse=not sig,
                               tuning=tuning, **dkw)
        assert p.config().path == forced
        DEC.run_split(p, chunk)
        res = DEC.finish_decode(p, not sig)
        o, lse = (res, None) if sig else res
        gold = R.batch_decode_paged(qg, cg, b["indptr"], b["indices"], b["last"], return_lse=not sig,
                                    dtype=np.float64, **dkw)
        ro, rlse = (gold, None) if sig else gold
        _check(o, lse, ro, rlse, code, sig)
    # and the public call as a user makes it
    res = batch_decode_paged(q, cache, b["indptr"], b["indices"], b["last"], return_lse=not sig, tuning=tuning,
                             **dkw)
    _check(res if sig else res[0], None if sig else res[1], ro, rlse, code, sig)


# ---------------------------------------------------------------------------
# The NaN rule on every GPU-only path
# ---------------------------------------------------------------------------

NAN_PATHS = dict(PREFILL_PATHS, tensor_core_plain_d256=("bf16", 256, True))
NAN_VARIANTS = {"causal_window": dict(causal=True, window_left=37),
                "sigmoid_window": dict(causal=True, window_left=37, use_sigmoid=True, sigmoid_bias=-1.0)}


def _poison_kv(b, r, t, which, value, rng):
    """One element of K (which=0) or V (which=1) of key t of request r."""
    ps = b["cache"].shape[2]
    page = b["indices"][b["indptr"][r] + t // ps]
    b["cache"][page, which, t % ps, rng.integers(b["cache"].shape[3]), rng.integers(b["cache"].shape[4])] = value


def _check_nan_rule(o, lse, ro, rlse, code, sigmoid):
    """NaN exactly where the golden model has it, whole rows (o and LSE); the rest as _check."""
    o64 = _f64(o)
    assert np.array_equal(np.isnan(o64), np.isnan(ro)), \
        f"o NaN at {np.argwhere(np.isnan(o64) != np.isnan(ro))[:5].tolist()} (first places that differ)"
    if not sigmoid:
        assert np.array_equal(np.isnan(_f64(lse)), np.isnan(rlse))
    nan = np.isnan(ro)
    _check(np.where(nan, 0.0, o64), lse, np.where(nan, 0.0, ro), rlse, code, sigmoid)


def _nan_batch(rng, head_dim, group, qo_lens, kv_lens):
    """Keys poisoned where some rows see them and others do not (causal, window 37),
    V of a key no row sees, K of a visible key, and one q element."""
    b = random_paged_batch(rng, qo_lens=qo_lens, kv_lens=kv_lens, page_size=16, num_kv_heads=2, group=group,
                           head_dim=head_dim, share_first_page=False)
    for r, t, which, value in [(0, kv_lens[0] - 1, 1, np.nan),   # only request 0's last row sees it
                               (0, 5, 1, np.inf),                 # outside every row's window
                               (0, kv_lens[0] - 40, 0, np.nan),   # K: some rows see it
                               (1, 10, 1, np.nan),                # hidden by the window
                               (2, 40, 1, -np.inf)]:              # rows 40..69 of request 2 see it
        if t < kv_lens[r]:
            _poison_kv(b, r, t, which, value, rng)
    if len(b["q"]) > 3:
        b["q"][-3, int(rng.integers(b["q"].shape[1])), 0] = np.nan
    return b



@pytest.mark.parametrize("code,head_dim,group", [("f16", 128, 4), ("bf16", 128, 8), ("f32", 64, 2), ("f16", 64, 1)])
def test_decode_rope_on_the_warp_path(code, head_dim, group):
    """RoPE at attention time on a GPU: the default dispatch sends it to the warp path,
    unsplit and split + merge, against the golden model in float64 (keys up to 2500
    positions, theta 5e5 and 1e4 with a scale)."""
    for theta, scale in ((5e5, 1.0), (1e4, 2.0)):
        kw = dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=theta, rope_scale=scale)
        rng = np.random.default_rng([zlib.crc32(code.encode()), head_dim, group, int(theta)])
        b = random_paged_batch(rng, qo_lens=[1] * len(DECODE_LENS), kv_lens=DECODE_LENS, page_size=16,
                               num_kv_heads=2, group=group, head_dim=head_dim, share_first_page=True)
        q, cache = _cast(b["q"], code), _cast(b["cache"], code)
        qg, cg = _golden_inputs(q, cache)
        ro, rlse = R.batch_decode_paged(qg, cg, b["indptr"], b["indices"], b["last"], return_lse=True,
                                        dtype=np.float64, **kw)
        for chunk in (None, 256):
            p = DEC.prepare_decode(q, cache, b["indptr"], b["indices"], b["last"], return_lse=True, **kw)
            assert p.config().path == "warp"
            DEC.run_split(p, chunk)
            o, lse = DEC.finish_decode(p, True)
            _check(o, lse, ro, rlse, code, False)
        o, lse = batch_decode_paged(q, cache, b["indptr"], b["indices"], b["last"], return_lse=True, **kw)
        _check(o, lse, ro, rlse, code, False)

@pytest.mark.parametrize("code,head_dim,causal", [("f16", 128, True), ("bf16", 64, False), ("f16", 64, True)])
def test_prefill_rope_on_the_pipelined_tile(code, head_dim, causal):
    """RoPE at attention time on the tensor-core prefill tile (q rows and each K tile
    turned in shared memory): paged with non-full last pages and a shared first page,
    the prefill wrapper with a CUDA-graph replay, and single prefill over 1024 keys,
    against the golden model in float64; theta 5e5, and 1e4 with a scale."""
    import torch
    from nbattn.cuda import BatchPrefillWithPagedKVCacheWrapper
    for theta, scale in ((5e5, 1.0), (1e4, 2.0)):
        kw = dict(causal=causal, pos_encoding_mode="ROPE_LLAMA", rope_theta=theta, rope_scale=scale)
        rng = np.random.default_rng([zlib.crc32(code.encode()), head_dim, int(causal), int(theta)])
        qo_lens, kv_lens = PREFILL_LENS
        b = random_paged_batch(rng, qo_lens=qo_lens, kv_lens=kv_lens, page_size=16, num_kv_heads=2, group=4,
                               head_dim=head_dim, share_first_page=True)
        assert _prefill_spec("paged", code, head_dim, 8, 2, kw, None).tensor_cores
        o, lse, ro, rlse = _paged_prefill_and_golden(b, code, None, kw)
        _check(o, lse, ro, rlse, code, False)
        # the wrapper: plan once, run eagerly, then replay a captured run
        q = torch.as_tensor(_f64(_cast(b["q"], code))).to(torch.bfloat16 if code == "bf16" else torch.float16).cuda()
        cache = torch.as_tensor(_f64(_cast(b["cache"], code))).to(q.dtype).cuda()
        w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
                                                use_cuda_graph=True)
        w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], 8, 2, head_dim, 16, q_data_type=q.dtype,
               **kw)
        out = torch.empty_like(q)
        lse_w = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
        w.run(q, cache, out=out, lse=lse_w)
        _check(out, lse_w, ro, rlse, code, False)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w.run(q, cache, out=out, lse=lse_w)
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        _check(out, lse_w, ro, rlse, code, False)
        # contiguous K/V
        q1, k1, v1 = (_cast(rng.standard_normal((n, 8, head_dim)).astype(np.float32), code)
                      for n in (128, 1024, 1024))
        kw1 = dict(kw, causal=False)
        o1, lse1 = single_prefill(q1, k1, v1, return_lse=True, **kw1)
        ro1, rlse1 = R.single_prefill(*_golden_inputs(q1, k1, v1), return_lse=True, dtype=np.float64, **kw1)
        _check(o1, lse1, ro1, rlse1, code, False)


@pytest.mark.parametrize("variant", list(NAN_VARIANTS))
@pytest.mark.parametrize("path", list(NAN_PATHS))
def test_paged_prefill_nan_rule_on_path(path, variant):
    code, head_dim, tc = NAN_PATHS[path]
    kw = NAN_VARIANTS[variant]
    rng = np.random.default_rng([zlib.crc32(path.encode()), zlib.crc32(variant.encode()), 11])
    b = _nan_batch(rng, head_dim, 4, [37, 1, 70, 0], [300, 129, 70, 5])
    assert _prefill_spec("paged", code, head_dim, 8, 2, kw, tc).tensor_cores == tc
    o, lse, ro, rlse = _paged_prefill_and_golden(b, code, tc, kw)
    assert np.isnan(ro).any() and not np.isnan(ro).all()          # the case has both kinds of rows
    _check_nan_rule(o, lse, ro, rlse, code, bool(kw.get("use_sigmoid")))


@pytest.mark.parametrize("path", list(DECODE_PATHS))
def test_decode_nan_rule_on_path(path):
    code, head_dim, group, forced = DECODE_PATHS[path]
    rng = np.random.default_rng([zlib.crc32(path.encode()), 12])
    kv_lens = [300, 129, 70, 17]
    b = _nan_batch(rng, head_dim, group, [1] * 4, kv_lens)
    kw = dict(window_left=37)
    q, cache = _cast(b["q"], code), _cast(b["cache"], code)
    qg, cg = _golden_inputs(q, cache)
    ro, rlse = R.batch_decode_paged(qg, cg, b["indptr"], b["indices"], b["last"], return_lse=True,
                                    dtype=np.float64, **kw)
    assert np.isnan(ro).any() and not np.isnan(ro).all()
    for chunk in (None, 64):
        p = DEC.prepare_decode(q, cache, b["indptr"], b["indices"], b["last"], return_lse=True,
                               tuning=DECODE.replace(path=forced), **kw)
        assert p.config().path == forced
        DEC.run_split(p, chunk)
        o, lse = DEC.finish_decode(p, True)
        _check_nan_rule(o, lse, ro, rlse, code, False)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("path", list(DECODE_PATHS))
def test_decode_weight_zero_key_on_path(path, value):
    """Visible keys of weight 0 still poison (the fast pass finds them by their traces):
    request 0's key 5 scores far below the rest and holds a non-finite V; request 1's
    key 7 has a -inf in K, so its raw score is -inf for every head (q > 0 there)."""
    code, head_dim, group, forced = DECODE_PATHS[path]
    rng = np.random.default_rng([zlib.crc32(path.encode()), 14, int(np.isnan(value)), int(value > 0)])
    kv_lens = [300, 129, 70, 17]
    b = random_paged_batch(rng, qo_lens=[1] * 4, kv_lens=kv_lens, page_size=16, num_kv_heads=2, group=group,
                           head_dim=head_dim, share_first_page=False)
    b["q"][:2] = np.abs(b["q"][:2]) + 0.5
    for r, t in ((0, 5), (1, 7)):
        page, slot = b["indices"][b["indptr"][r] + t // 16], t % 16
        if r == 0:
            b["cache"][page, 0, slot] = -4000.0 / np.sqrt(head_dim)
            b["cache"][page, 1, slot, int(rng.integers(2)), int(rng.integers(head_dim))] = value
        else:
            b["cache"][page, 0, slot, int(rng.integers(2)), int(rng.integers(head_dim))] = -np.inf
    q, cache = _cast(b["q"], code), _cast(b["cache"], code)
    qg, cg = _golden_inputs(q, cache)
    ro, rlse = R.batch_decode_paged(qg, cg, b["indptr"], b["indices"], b["last"], return_lse=True,
                                    dtype=np.float64)
    assert np.isnan(rlse[:2]).any() and not np.isnan(rlse[2:]).any()
    for chunk in (None, 64):
        p = DEC.prepare_decode(q, cache, b["indptr"], b["indices"], b["last"], return_lse=True,
                               tuning=DECODE.replace(path=forced))
        assert p.config().path == forced
        DEC.run_split(p, chunk)
        o, lse = DEC.finish_decode(p, True)
        _check_nan_rule(o, lse, ro, rlse, code, False)


@pytest.mark.parametrize("path", ["tensor_core_pipelined_f16", "cuda_core_f32"])
def test_sinks_on_path(path):
    """Learnable sinks through the public calls on a GPU path: prefill (paged) and decode."""
    code, head_dim, tc = PREFILL_PATHS[path]
    rng = np.random.default_rng([zlib.crc32(path.encode()), 13])
    b = random_paged_batch(rng, qo_lens=[37, 1, 70, 0], kv_lens=[300, 129, 70, 5], page_size=16, num_kv_heads=2,
                           group=4, head_dim=head_dim, share_first_page=True)
    sinks = (rng.standard_normal(8) * 3).astype(np.float32)
    q, cache = _cast(b["q"], code), _cast(b["cache"], code)
    qg, cg = _golden_inputs(q, cache)
    o, lse = batch_prefill_paged(q, cache, b["qo_indptr"], b["indptr"], b["indices"], b["last"], return_lse=True,
                                 tensor_cores=tc, causal=True, sinks=sinks)
    ro, rlse = R.batch_prefill_paged(qg, cg, b["qo_indptr"], b["indptr"], b["indices"], b["last"],
                                     return_lse=True, dtype=np.float64, causal=True, sinks=sinks)
    _check(o, lse, ro, rlse, code, False)
    bd = random_paged_batch(rng, qo_lens=[1] * 4, kv_lens=[300, 0, 70, 17], page_size=16, num_kv_heads=2,
                            group=4, head_dim=head_dim, share_first_page=True)
    q, cache = _cast(bd["q"], code), _cast(bd["cache"], code)
    qg, cg = _golden_inputs(q, cache)
    o, lse = batch_decode_paged(q, cache, bd["indptr"], bd["indices"], bd["last"], return_lse=True, sinks=sinks)
    ro, rlse = R.batch_decode_paged(qg, cg, bd["indptr"], bd["indices"], bd["last"], return_lse=True,
                                    dtype=np.float64, sinks=sinks)
    _check(o, lse, ro, rlse, code, False)
