"""RoPE at attention time on the kernels (``pos_encoding_mode="ROPE_LLAMA"``), simulator.

Every case is checked against tests/brute.py's complex-number rotation and float64
attention loop (:func:`brute.brute_rope`), not against :mod:`nbattn.reference`:
q turns to its own position (bottom-right aligned), each key to its position in
the request, and the cache holds keys unrotated.  The kernels that rotate are
the decode teaching kernel (``path="smem"``) and the warp decode path, the
CUDA-core teaching prefill tile, and on a GPU the pipelined tensor-core prefill
tile (tests/test_gpu_variants.py); a call that asks for another fast path gets a
teaching kernel.  The warp path's turn (the angle in fixed-point turns, approximate
float32 cos/sin on a GPU) is also checked alone at positions up to 2**31 - 1.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nbattn  # noqa: F401  (simulator choice first)
from numba import cuda  # noqa: E402
from nbattn import cuda as C
from nbattn.cuda import decode as DEC
from nbattn.cuda.kernels.prefill_dispatch import make_spec
from nbattn.cuda.tuning import DECODE
from nbattn.variants import Variant

from brute import brute_rope, fresh, gather_pages, indptr_of, random_paged_batch

TOL = {np.float32: 3e-5, np.float16: 4e-3}


def _f64(x):
    return np.asarray(x, np.float64)


def _check_decode(b, kv_lens, o, lse, scale, theta, tol):
    for r, n in enumerate(kv_lens):
        if n == 0:
            assert np.all(_f64(o[r]) == 0) and np.all(np.isneginf(lse[r]))
            continue
        k, v = gather_pages(b["cache"], b["indptr"], b["indices"], b["last"], r)
        want_o, want_lse = brute_rope(_f64(b["q"][r:r + 1]), _f64(k), _f64(v), scale, theta)
        np.testing.assert_allclose(_f64(o[r]), want_o[0], atol=tol, rtol=tol, err_msg=f"request {r}")
        np.testing.assert_allclose(lse[r], want_lse[0], atol=tol, rtol=tol, err_msg=f"request {r}")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv_lens=st.lists(st.integers(0, 40), min_size=1, max_size=4), page_size=st.sampled_from([1, 3, 16]),
       group=st.sampled_from([1, 2, 4]), theta=st.sampled_from([1e4, 5e5, 37.0]),
       scale=st.sampled_from([1.0, 2.5]), head_dim=st.sampled_from([8, 16, 32]),
       dtype=st.sampled_from([np.float32, np.float16]), path=st.sampled_from(["smem", "warp"]),
       seed=st.integers(0, 2 ** 31))
def test_paged_decode_kernel_rotates_q_and_every_key(kv_lens, page_size, group, theta, scale, head_dim, dtype,
                                                     path, seed):
    """On the teaching kernel and on the warp path (partner chunks NX/2 lanes away; one
    chunk holds the row at fp16 head_dim 8)."""
    rng = np.random.default_rng(seed)
    b = random_paged_batch(rng, qo_lens=[1] * len(kv_lens), kv_lens=kv_lens, page_size=page_size,
                           num_kv_heads=2, group=group, head_dim=head_dim, share_first_page=True, dtype=dtype)
    kw = dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=scale, rope_theta=theta)
    tuning = DECODE.replace(path=path)
    p = DEC.prepare_decode(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], tuning=tuning, **kw)
    assert p.config().path == path
    o, lse = C.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], return_lse=True,
                                  tuning=tuning, **kw)
    _check_decode(b, kv_lens, o, lse, scale, theta, TOL[dtype])


def test_the_warp_turn_is_float32_accurate_at_large_positions():
    """blocks.rope.fast_rotation alone, against the rotation in float64 (NumPy): positions
    up to 2**31 - 1, theta 5e5 and 10 and a scale of 0.1 (pair 0 turns more than once per
    position), every element of a row of 32.  Runs on a GPU too (cos.approx / sin.approx)."""
    from nbattn.cuda.blocks.primitives import device_fn
    from nbattn.cuda.blocks.rope import fast_rotation, turns_per_position
    D, VEC = 32, 8
    turn = fast_rotation(D, VEC)
    rng, seed = fresh()
    for theta, scale in ((5e5, 1.0), (10.0, 1.0), (1e4, 0.1)):
        turns = turns_per_position(D, scale, theta)

        @device_fn
        def one(x, xp, out, turns, d0, pos):
            turn(x, 0, xp, out, d0, pos, turns)

        @cuda.jit
        def kern(x, pos, turns, out):
            xp = cuda.local.array(VEC, np.float32)
            xo = cuda.local.array(VEC, np.float32)
            c = cuda.threadIdx.x              # chunk c of row b: partners are chunk c ^ 2
            b = cuda.blockIdx.x
            xs = cuda.local.array(VEC, np.float32)
            for e in range(VEC):
                xs[e] = x[b, c * VEC + e]
                xp[e] = x[b, (c ^ 2) * VEC + e]
            one(xs, xp, xo, turns, c * VEC, pos[b])
            for e in range(VEC):
                out[b, c * VEC + e] = xo[e]

        pos = np.array([0, 1, 777, 65_537, 999_999, 2 ** 24 + 3, 1_234_567_891, 2 ** 31 - 1], np.int64)
        x = rng.standard_normal((pos.size, D)).astype(np.float32)
        out = np.zeros_like(x)
        kern[pos.size, D // VEC](x, pos, turns, out)
        i = np.arange(D // 2)
        freq = theta ** (-2.0 * i / D) / scale
        fixed = turns[:D // 2].astype(np.float64) * 2.0 ** -32 + turns[D // 2:] * 2.0 ** -64
        np.testing.assert_allclose(fixed, freq / (2 * np.pi) % 1.0, rtol=1e-15, atol=1e-18)
        # float64 angles lose ~pos * 1e-16 rad; reduce pos * freq mod 2 pi in exact integers
        # of 2**-60 turns instead, from the same float64 turns per position
        r = [int(np.ldexp(t, 60)) for t in freq / (2 * np.pi) % 1.0]
        ang = np.array([[((int(pp) * ri) % 2 ** 60) / 2.0 ** 60 for ri in r] for pp in pos]) * 2 * np.pi
        z = (x[:, :D // 2] + 1j * x[:, D // 2:].astype(np.float64)) * np.exp(1j * ang)
        want = np.concatenate([z.real, z.imag], axis=1)
        np.testing.assert_allclose(out, want, atol=4e-6, rtol=2e-6, err_msg=f"theta {theta} (seed={seed})")


def test_the_prefill_tiles_word_turn_rounds_like_rotating_first():
    """blocks.rope.word_rotation alone (the tensor-core prefill tile turns its shared-memory
    rows with it): fp16 rows held as 32-bit words, positions up to 2**31 - 1, theta 1e4 and
    a scale of 0.1, against the float64 rotation: every turned value within one fp16 unit of
    it (rounding alone gives half a unit), plus 2e-6 of its pair's size for the float32 turn
    itself, which shows where the two products cancel to a value of a few fp16 units.  Runs
    on a GPU too."""
    from numba import uint32
    from nbattn.cuda.blocks.primitives import device_fn, f16x2_to_f32, f32_to_f16_bits
    from nbattn.cuda.blocks.rope import turns_per_position, word_rotation
    D = 16
    rng, seed = fresh()

    @device_fn
    def pack2(lo, hi):
        return uint32(f32_to_f16_bits(lo)) | (uint32(f32_to_f16_bits(hi)) << 16)

    turn_words = word_rotation(D, f16x2_to_f32, pack2)

    @cuda.jit
    def kern(words, pos, turns):
        r = cuda.blockIdx.x                   # row r, words r * D/2 ..; thread m turns words m and m + D/4
        turn_words(words, r * (D // 2), cuda.threadIdx.x, pos[r], turns)

    for theta, scale in ((1e4, 1.0), (1e4, 0.1)):
        pos = np.array([0, 1, 5, 4095, 65_537, 2 ** 24 + 3, 1_234_567_891, 2 ** 31 - 1], np.int64)
        x = rng.standard_normal((pos.size, D)).astype(np.float16)
        words = x.view(np.uint32).reshape(-1).copy()  # two fp16 a word, element 2m in the low half
        kern[pos.size, D // 4](words, pos, turns_per_position(D, scale, theta))
        got = words.view(np.float16).reshape(x.shape).astype(np.float64)
        freq = theta ** (-2.0 * np.arange(D // 2) / D) / scale
        r = [int(np.ldexp(t, 60)) for t in freq / (2 * np.pi) % 1.0]     # exact turns, as in the warp test
        ang = np.array([[((int(pp) * ri) % 2 ** 60) / 2.0 ** 60 for ri in r] for pp in pos]) * 2 * np.pi
        z = (x[:, :D // 2].astype(np.float64) + 1j * x[:, D // 2:]) * np.exp(1j * ang)
        want = np.concatenate([z.real, z.imag], axis=1)
        unit = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
        pair = np.tile(np.abs(x[:, :D // 2].astype(np.float64)) + np.abs(x[:, D // 2:]), 2)
        assert np.all(np.abs(got - want) <= unit + 2e-6 * pair), (theta, scale, seed, np.abs(got - want).max())


@pytest.mark.parametrize("path", ["warp", "tc", "auto"])
def test_a_decode_that_asks_for_a_fast_path_rotates_on_the_warp_or_teaching_kernel(path):
    rng, seed = fresh()
    kv_lens = [9, 0, 33]
    b = random_paged_batch(rng, qo_lens=[1] * 3, kv_lens=kv_lens, page_size=4, num_kv_heads=1, group=4,
                           head_dim=16, share_first_page=True)
    kw = dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=300.0)
    tuning = DECODE.replace(path=path)
    p = DEC.prepare_decode(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], return_lse=True,
                           tuning=tuning, **kw)
    assert p.config().path == ("warp" if path == "warp" else "smem")     # the simulator's choice
    o, lse = C.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], return_lse=True,
                                  tuning=tuning, **kw)
    _check_decode(b, kv_lens, o, lse, 1.0, 300.0, TOL[np.float32])


def test_split_decode_with_rope_equals_the_unsplit_one():
    """A split-KV decode rotates each chunk's keys by their positions in the request."""
    rng, seed = fresh()
    kv_lens = [70, 5, 41]
    b = random_paged_batch(rng, qo_lens=[1] * 3, kv_lens=kv_lens, page_size=3, num_kv_heads=2, group=2,
                           head_dim=8, share_first_page=True)
    kw = dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=50.0, rope_scale=2.0)
    p = DEC.prepare_decode(b["q"], b["cache"], b["indptr"], b["indices"], b["last"], return_lse=True, **kw)
    DEC.run_split(p, 16)
    o, lse = DEC.finish_decode(p, True)
    _check_decode(b, kv_lens, o, lse, 2.0, 50.0, TOL[np.float32])


@pytest.mark.parametrize("path", ["smem", "warp"])
def test_decode_wrapper_plans_rope_and_runs_it(path):
    rng, seed = fresh()
    kv_lens = [12, 30, 1]
    b = random_paged_batch(rng, qo_lens=[1] * 3, kv_lens=kv_lens, page_size=4, num_kv_heads=2, group=2,
                           head_dim=8, share_first_page=True)
    w = C.BatchDecodeWithPagedKVCacheWrapper(cuda.device_array(8 << 20, np.uint8))
    w.plan(b["indptr"], b["indices"], b["last"], 4, 2, 8, 4, pos_encoding_mode="ROPE_LLAMA", rope_theta=80.0,
           q_data_type=np.float32, kv_data_type=np.float32, tuning=DECODE.replace(path=path), chunk_limit=7)
    o, lse = w.run(b["q"], b["cache"], return_lse=True)
    _check_decode(b, kv_lens, o, lse, 1.0, 80.0, TOL[np.float32])


def _check_rows(q, ks, vs, qo_lens, o, lse, scale, theta, causal, tol=TOL[np.float32]):
    qo = indptr_of(qo_lens)
    for r, (k, v) in enumerate(zip(ks, vs)):
        rows = slice(qo[r], qo[r + 1])
        if qo_lens[r] == 0:
            continue
        want_o, want_lse = brute_rope(_f64(q[rows]), _f64(k), _f64(v), scale, theta, causal=causal)
        np.testing.assert_allclose(_f64(o[rows]), want_o, atol=tol, rtol=tol, err_msg=f"request {r}")
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(lse[rows][fin], want_lse[fin], atol=tol, rtol=tol, err_msg=f"request {r}")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 30)), min_size=1, max_size=3),
       page_size=st.sampled_from([1, 3, 16]), group=st.sampled_from([1, 2, 4]), causal=st.booleans(),
       theta=st.sampled_from([1e4, 37.0]), scale=st.sampled_from([1.0, 2.5]), seed=st.integers(0, 2 ** 31))
def test_paged_prefill_kernel_rotates_every_row_and_key(lens, page_size, group, causal, theta, scale, seed):
    rng = np.random.default_rng(seed)
    kv_lens = [max(k, q) for q, k in lens]              # causal needs kv_len >= qo_len
    qo_lens = [q for q, _ in lens]
    b = random_paged_batch(rng, qo_lens=qo_lens, kv_lens=kv_lens, page_size=page_size, num_kv_heads=2,
                           group=group, head_dim=8, share_first_page=True)
    kw = dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=scale, rope_theta=theta, causal=causal)
    o, lse = C.batch_prefill_paged(b["q"], b["cache"], b["qo_indptr"], b["indptr"], b["indices"], b["last"],
                                   return_lse=True, **kw)
    kvs = [gather_pages(b["cache"], b["indptr"], b["indices"], b["last"], r) for r in range(len(kv_lens))]
    _check_rows(b["q"], [k for k, _ in kvs], [v for _, v in kvs], qo_lens, o, lse, scale, theta, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_ragged_and_single_prefill_rotate(causal):
    rng, seed = fresh()
    qo_lens, kv_lens = [3, 0, 6], [7, 4, 6]
    q = rng.standard_normal((sum(qo_lens), 4, 16)).astype(np.float32)
    k = rng.standard_normal((sum(kv_lens), 2, 16)).astype(np.float32)
    v = rng.standard_normal((sum(kv_lens), 2, 16)).astype(np.float32)
    qo, kv = indptr_of(qo_lens), indptr_of(kv_lens)
    kw = dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=500.0, causal=causal)
    o, lse = C.batch_prefill_ragged(q, k, v, qo, kv, return_lse=True, **kw)
    ks = [k[kv[r]:kv[r + 1]] for r in range(3)]
    vs = [v[kv[r]:kv[r + 1]] for r in range(3)]
    _check_rows(q, ks, vs, qo_lens, o, lse, 1.0, 500.0, causal)
    o1, lse1 = C.single_prefill(q[qo[2]:], k[kv[2]:], v[kv[2]:], return_lse=True, **kw)
    _check_rows(q[qo[2]:], ks[2:], vs[2:], qo_lens[2:], o1, lse1, 1.0, 500.0, causal)


def test_prefill_wrapper_plans_rope_and_runs_it():
    rng, seed = fresh()
    qo_lens, kv_lens = [2, 5], [9, 5]
    b = random_paged_batch(rng, qo_lens=qo_lens, kv_lens=kv_lens, page_size=4, num_kv_heads=2, group=2,
                           head_dim=8, share_first_page=True)
    w = C.BatchPrefillWithPagedKVCacheWrapper(cuda.device_array(8 << 20, np.uint8))
    w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], 4, 2, 8, 4, causal=True,
           pos_encoding_mode="ROPE_LLAMA", rope_theta=64.0, q_data_type=np.float32, kv_data_type=np.float32)
    o, lse = w.run(b["q"], b["cache"], return_lse=True)
    kvs = [gather_pages(b["cache"], b["indptr"], b["indices"], b["last"], r) for r in range(2)]
    _check_rows(b["q"], [k for k, _ in kvs], [v for _, v in kvs], qo_lens, o, lse, 1.0, 64.0, True)


def test_single_decode_rotates():
    rng, seed = fresh()
    q = rng.standard_normal((4, 8)).astype(np.float32)
    k = rng.standard_normal((11, 2, 8)).astype(np.float32)
    v = rng.standard_normal((11, 2, 8)).astype(np.float32)
    o, lse = C.single_decode(q, k, v, return_lse=True, pos_encoding_mode="ROPE_LLAMA", rope_theta=20.0)
    want_o, want_lse = brute_rope(_f64(q[None]), _f64(k), _f64(v), 1.0, 20.0)
    np.testing.assert_allclose(o, want_o[0], atol=3e-5, rtol=3e-5)
    np.testing.assert_allclose(lse, want_lse[0], atol=3e-5, rtol=3e-5)


def test_rope_off_the_tensor_cores_builds_the_teaching_prefill_tile():
    spec = make_spec("paged", "NHD", "f32", 16, 4, 2, Variant(pos_encoding_mode="ROPE_LLAMA"))
    assert not spec.tensor_cores
    from nbattn.cuda.kernels import prefill_cc as CC
    assert not CC.covers(spec)


def test_bad_rope_requests_are_refused_before_any_kernel_runs():
    rng, seed = fresh()
    out = np.full((2, 4, 8), 7.0, np.float32)
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    k = rng.standard_normal((5, 2, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="^tensor_cores: pos_encoding_mode='ROPE_LLAMA'"):
        C.single_prefill(q, k, k, tensor_cores=True, pos_encoding_mode="ROPE_LLAMA", out=out)
    with pytest.raises(ValueError, match="^rope_theta: must be finite and > 0"):
        C.single_prefill(q, k, k, pos_encoding_mode="ROPE_LLAMA", rope_theta=0.0, out=out)
    assert np.all(out == 7.0)
    # fp16 rows of 24 elements: 16-byte chunks of 8 cannot pair element i with i + 12
    b = random_paged_batch(rng, qo_lens=[1], kv_lens=[5], page_size=4, num_kv_heads=1, group=1, head_dim=24,
                           dtype=np.float16)
    with pytest.raises(ValueError, match="^pos_encoding_mode: 'ROPE_LLAMA' on the decode kernels needs head_dim"):
        C.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"],
                             pos_encoding_mode="ROPE_LLAMA")


def test_on_a_gpu_the_dispatch_sends_rope_to_the_warp_path_and_masks_to_the_teaching_tile(monkeypatch):
    """The simulator never offers the fast paths, so the choice is checked with the GPU's
    answers patched in: the same shapes take tensor cores without RoPE or a mask; with
    RoPE decode takes the warp path and prefill the pipelined tensor-core tile where it
    builds (head_dim 64 / 128, keys with positions), else the teaching tile; with a mask
    the teaching tile."""
    from nbattn.cuda.kernels import decode_common as DC
    from nbattn.cuda.kernels import prefill_dispatch as PD
    monkeypatch.setattr(DC, "SIMULATOR", False)
    monkeypatch.setattr(DC, "_configs", {})
    monkeypatch.setattr(PD._mma, "AVAILABLE", True)
    for path in ("auto", "tc", "warp"):
        tuning = DECODE.replace(path=path)
        assert DC.make_config("f16", 128, 4, "NHD", Variant(), tuning=tuning).path in ("tc", "warp")
        assert DC.make_config("f16", 128, 4, "NHD", Variant(pos_encoding_mode="ROPE_LLAMA"),
                              tuning=tuning).path == "warp"
    assert DC.make_config("f16", 128, 4, "NHD", Variant(pos_encoding_mode="ROPE_LLAMA"),
                          tuning=DECODE.replace(path="smem")).path == "smem"
    rope = Variant(pos_encoding_mode="ROPE_LLAMA")
    assert PD.make_spec("paged", "NHD", "f16", 128, 32, 8, Variant()).tensor_cores
    for mode, head_dim in (("paged", 128), ("ragged", 64), ("paged", 64)):     # the pipelined tile turns q and K
        assert PD.make_spec(mode, "NHD", "f16", head_dim, 32, 8, rope).tensor_cores
    for mode, head_dim in (("bsr", 128), ("paged", 96), ("paged", 256)):       # no positions, or the mma tile
        assert not PD.make_spec(mode, "NHD", "f16", head_dim, 32, 8, rope).tensor_cores
        with pytest.raises(ValueError, match="^tensor_cores: pos_encoding_mode='ROPE_LLAMA' runs on the tensor"):
            PD.make_spec(mode, "NHD", "f16", head_dim, 32, 8, rope, True)
    assert not PD.make_spec("paged", "NHD", "f16", 128, 32, 8, Variant(), custom_mask=True).tensor_cores
