"""RoPE in the golden model (nbattn.reference.rope) against references of its
own: a float64 loop written from the formulas, torch (complex numbers for the
interleaved pairing, rotate-half for the other), and the properties a rotation
by position must have.  Inputs are fresh random draws; every assertion message
carries the seed that reproduces it (np.random.default_rng(seed))."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import nbattn  # noqa: F401  (compat first)
from nbattn import layout as L
from nbattn import reference as R
from brute import assert_refused  # noqa: E402

DTYPES = [np.float32, np.float16, np.float64]
# How far the rounded output may be from the exact float64 value, relative to it.
RTOL = {np.float16: 2.0 ** -10, np.float32: 2.0 ** -23, np.float64: 1e-10}
ATOL = {np.float16: 1e-6, np.float32: 1e-9, np.float64: 1e-10}


def fresh():
    seed = int(np.random.SeedSequence().entropy)
    return np.random.default_rng(seed), seed


# ---------------------------------------------------------------------------
# Reference 1: a float64 loop over rows, heads and pairs, from the formulas
# ---------------------------------------------------------------------------

def brute_positions(indptr, offsets):
    pos = []
    for i in range(len(indptr) - 1):
        for j in range(int(indptr[i + 1]) - int(indptr[i])):
            pos.append(int(offsets[i]) + j)
    return pos


def brute_plain_angle(rotary_dim, rope_theta, rope_scale):
    def angle(pos, p):
        return (pos / rope_scale) * (rope_theta ** (-2 * p / rotary_dim))
    return angle


def brute_llama31_freq(p, rotary_dim, rope_theta, rope_scale, low, high, old):
    """(frequency, regime) of pair p."""
    f = rope_theta ** (-2 * p / rotary_dim)
    wavelen = 2 * math.pi / f
    if wavelen < old / high:
        return f, "high"
    if wavelen > old / low:
        return f / rope_scale, "low"
    smooth = (old / wavelen - low) / (high - low)
    return (1 - smooth) * f / rope_scale + smooth * f, "medium"


def brute_llama31_angle(rotary_dim, rope_theta, rope_scale, low, high, old):
    def angle(pos, p):
        return pos * brute_llama31_freq(p, rotary_dim, rope_theta, rope_scale, low, high, old)[0]
    return angle


def brute_rope(x, pos, rotary_dim, interleave, angle):
    x = np.asarray(x, dtype=np.float64)
    out = x.copy()
    nnz, heads, _ = x.shape
    half = rotary_dim // 2
    for r in range(nnz):
        for h in range(heads):
            for p in range(half):
                i, j = (2 * p, 2 * p + 1) if interleave else (p, p + half)
                a = angle(pos[r], p)
                c, s = math.cos(a), math.sin(a)
                x1, x2 = x[r, h, i], x[r, h, j]
                out[r, h, i] = x1 * c - x2 * s
                out[r, h, j] = x1 * s + x2 * c
    return out


# ---------------------------------------------------------------------------
# Reference 2: torch
# ---------------------------------------------------------------------------

def torch_inv_freq(rotary_dim, rope_theta):
    return 1.0 / (rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))


def torch_llama31_freq(rotary_dim, rope_theta, rope_scale, low, high, old):
    inv = torch_inv_freq(rotary_dim, rope_theta)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / rope_scale, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / rope_scale + smooth * inv
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


def torch_rope(x, pos, freq, rotary_dim, interleave, position_scale=1.0):
    x = torch.as_tensor(np.asarray(x, dtype=np.float64))
    nnz, heads, _ = x.shape
    ang = torch.outer(torch.as_tensor(pos, dtype=torch.float64) / position_scale, freq)  # [nnz, R/2]
    rot, tail = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleave:
        z = torch.view_as_complex(rot.reshape(nnz, heads, rotary_dim // 2, 2).contiguous())
        turn = torch.polar(torch.ones_like(ang), ang)[:, None, :]
        rot = torch.view_as_real(z * turn).reshape(nnz, heads, rotary_dim)
    else:
        def rotate_half(t):
            a, b = t[..., :rotary_dim // 2], t[..., rotary_dim // 2:]
            return torch.cat([-b, a], dim=-1)
        cos = torch.cat([ang.cos(), ang.cos()], dim=-1)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], dim=-1)[:, None, :]
        rot = rot * cos + rotate_half(rot) * sin
    return torch.cat([rot, tail], dim=-1).numpy()


# ---------------------------------------------------------------------------
# Random inputs
# ---------------------------------------------------------------------------

def random_batch(rng, *, dtype=np.float32, hq=4, hkv=2, head_dim=16, max_len=5, batch=4, max_offset=3000):
    lens = rng.integers(0, max_len + 1, size=batch)
    if batch > 1:
        lens[rng.integers(0, batch)] = 0                         # at least one empty request
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    offsets = rng.integers(0, max_offset + 1, size=batch).astype(np.int32)
    nnz = int(indptr[-1])
    q = rng.standard_normal((nnz, hq, head_dim)).astype(dtype)
    k = rng.standard_normal((nnz, hkv, head_dim)).astype(dtype)
    return q, k, indptr, offsets


def close(got, want, dtype, seed, what=""):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=RTOL[dtype], atol=ATOL[dtype],
                               err_msg=f"seed={seed} {what}")


CONFIGS = [  # (hq, hkv, head_dim, rotary_dim)
    (4, 2, 16, None), (4, 1, 16, 8), (2, 2, 8, 6), (3, 3, 32, 32), (8, 2, 12, 4),
]


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("hq,hkv,head_dim,rotary_dim", CONFIGS)
def test_apply_rope_matches_brute_and_torch(interleave, dtype, hq, hkv, head_dim, rotary_dim):
    rng, seed = fresh()
    q, k, indptr, offsets = random_batch(rng, dtype=dtype, hq=hq, hkv=hkv, head_dim=head_dim)
    theta = float(rng.choice([1e4, 5e5, 250.0]))
    scale = float(rng.choice([1.0, 2.5, 8.0]))
    rd = head_dim if rotary_dim is None else rotary_dim
    q0, k0 = q.copy(), k.copy()
    q_rope, k_rope = R.apply_rope(q, k, indptr, offsets, rotary_dim=rotary_dim, interleave=interleave,
                                  rope_scale=scale, rope_theta=theta)
    assert q_rope.dtype == dtype and k_rope.dtype == dtype, f"seed={seed}"
    assert q_rope.shape == q.shape and k_rope.shape == k.shape, f"seed={seed}"
    assert np.array_equal(q, q0) and np.array_equal(k, k0), f"seed={seed}: an input changed"
    assert not np.shares_memory(q_rope, q) and not np.shares_memory(k_rope, k), f"seed={seed}"

    pos = brute_positions(indptr, offsets)
    angle = brute_plain_angle(rd, theta, scale)
    close(q_rope, brute_rope(q, pos, rd, interleave, angle), dtype, seed, "q vs brute")
    close(k_rope, brute_rope(k, pos, rd, interleave, angle), dtype, seed, "k vs brute")
    freq = torch_inv_freq(rd, theta)
    close(q_rope, torch_rope(q, pos, freq, rd, interleave, scale), dtype, seed, "q vs torch")
    close(k_rope, torch_rope(k, pos, freq, rd, interleave, scale), dtype, seed, "k vs torch")


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("hq,hkv,head_dim,rotary_dim", CONFIGS)
def test_apply_rope_pos_ids_matches_brute_and_torch(interleave, dtype, hq, hkv, head_dim, rotary_dim):
    rng, seed = fresh()
    nnz = int(rng.integers(1, 12))
    q = rng.standard_normal((nnz, hq, head_dim)).astype(dtype)
    k = rng.standard_normal((nnz, hkv, head_dim)).astype(dtype)
    pos = rng.integers(0, 20000, size=nnz)                          # any order, repeats allowed
    rd = head_dim if rotary_dim is None else rotary_dim
    q_rope, k_rope = R.apply_rope_pos_ids(q, k, pos, rotary_dim=rotary_dim, interleave=interleave)
    assert q_rope.dtype == dtype and k_rope.dtype == dtype, f"seed={seed}"
    angle = brute_plain_angle(rd, 1e4, 1.0)
    close(q_rope, brute_rope(q, pos.tolist(), rd, interleave, angle), dtype, seed, "q vs brute")
    close(k_rope, brute_rope(k, pos.tolist(), rd, interleave, angle), dtype, seed, "k vs brute")
    close(q_rope, torch_rope(q, pos, torch_inv_freq(rd, 1e4), rd, interleave), dtype, seed, "q vs torch")


LLAMA = [  # (rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    (8.0, 5e5, 1.0, 4.0, 8192), (32.0, 5e5, 1.0, 4.0, 8192), (4.0, 1e4, 2.0, 8.0, 4096),
]


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("llama", LLAMA)
@pytest.mark.parametrize("rotary_dim", [None, 16])
def test_llama31_matches_brute_and_torch(interleave, dtype, llama, rotary_dim):
    rng, seed = fresh()
    scale, theta, low, high, old = llama
    head_dim = 32
    rd = head_dim if rotary_dim is None else rotary_dim
    regimes = {brute_llama31_freq(p, rd, theta, scale, low, high, old)[1] for p in range(rd // 2)}
    assert regimes == {"high", "medium", "low"}, f"the case should use all three regimes, got {regimes}"
    q, k, indptr, offsets = random_batch(rng, dtype=dtype, hq=4, hkv=1, head_dim=head_dim, max_offset=100000)
    kw = dict(rotary_dim=rotary_dim, interleave=interleave, rope_scale=scale, rope_theta=theta,
              low_freq_factor=low, high_freq_factor=high, old_context_len=old)
    q_rope, k_rope = R.apply_llama31_rope(q, k, indptr, offsets, **kw)
    assert q_rope.dtype == dtype and k_rope.dtype == dtype, f"seed={seed}"
    pos = brute_positions(indptr, offsets)
    angle = brute_llama31_angle(rd, theta, scale, low, high, old)
    close(q_rope, brute_rope(q, pos, rd, interleave, angle), dtype, seed, "q vs brute")
    close(k_rope, brute_rope(k, pos, rd, interleave, angle), dtype, seed, "k vs brute")
    freq = torch_llama31_freq(rd, theta, scale, low, high, old)
    close(q_rope, torch_rope(q, pos, freq, rd, interleave), dtype, seed, "q vs torch")
    close(k_rope, torch_rope(k, pos, freq, rd, interleave), dtype, seed, "k vs torch")

    q_ids, k_ids = R.apply_llama31_rope_pos_ids(q, k, np.array(pos, np.int32), **kw)
    np.testing.assert_array_equal(q_ids, q_rope, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(k_ids, k_rope, err_msg=f"seed={seed}")


def test_llama31_defaults_are_flashinfers():
    rng, seed = fresh()
    q = rng.standard_normal((3, 2, 64))
    pos = [0, 9000, 70000]
    q_rope, _ = R.apply_llama31_rope_pos_ids(q, q, pos)
    angle = brute_llama31_angle(64, 5e5, 8.0, 1.0, 4.0, 8192)
    close(q_rope, brute_rope(q, pos, 64, False, angle), np.float64, seed)


def test_worked_examples_of_the_concept_page():
    """docs/concepts/rope.md: the positions example and x = [1, 2, 3, 4] at position 1."""
    assert brute_positions([0, 3, 3, 5], [10, 4, 0]) == [10, 11, 12, 0, 1]
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]])
    half, _ = R.apply_rope_pos_ids(x, x, [1], rope_theta=100.0)
    inter, _ = R.apply_rope_pos_ids(x, x, [1], interleave=True, rope_theta=100.0)
    np.testing.assert_allclose(half.ravel(), [-1.9841, 1.5907, 2.4624, 4.1797], atol=5e-5)
    np.testing.assert_allclose(inter.ravel(), [-1.1426, 1.9221, 2.5857, 4.2795], atol=5e-5)
    bands = [brute_llama31_freq(p, 128, 5e5, 8.0, 1.0, 4.0, 8192)[1] for p in range(64)]
    assert (bands.count("high"), bands.count("medium"), bands.count("low")) == (29, 6, 29)


# ---------------------------------------------------------------------------
# Edge shapes: empty requests, nnz = 0
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [R.apply_rope, R.apply_llama31_rope])
@pytest.mark.parametrize("indptr,offsets", [([0], []), ([0, 0, 0], [4, 1]), ([0, 0], [0])])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_nnz_zero(fn, indptr, offsets, dtype):
    q = np.zeros((0, 4, 8), dtype)
    k = np.zeros((0, 2, 8), dtype)
    q_rope, k_rope = fn(q, k, np.array(indptr, np.int32), np.array(offsets, np.int32), rotary_dim=4)
    assert q_rope.shape == (0, 4, 8) and k_rope.shape == (0, 2, 8)
    assert q_rope.dtype == dtype and k_rope.dtype == dtype


def test_pos_ids_nnz_zero():
    q_rope, k_rope = R.apply_rope_pos_ids(np.zeros((0, 2, 8), np.float16), np.zeros((0, 1, 8), np.float16),
                                          np.zeros(0, np.int32))
    assert q_rope.shape == (0, 2, 8) and k_rope.shape == (0, 1, 8) and q_rope.dtype == np.float16


def test_empty_requests_in_the_middle():
    rng, seed = fresh()
    indptr = np.array([0, 0, 3, 3, 3, 5, 5], np.int32)
    offsets = np.array([7, 100, 0, 9, 40, 2], np.int32)
    q = rng.standard_normal((5, 2, 8))
    k = rng.standard_normal((5, 2, 8))
    q_rope, k_rope = R.apply_rope(q, k, indptr, offsets)
    pos = [100, 101, 102, 40, 41]
    assert brute_positions(indptr, offsets) == pos
    angle = brute_plain_angle(8, 1e4, 1.0)
    close(q_rope, brute_rope(q, pos, 8, False, angle), np.float64, seed)
    close(k_rope, brute_rope(k, pos, 8, False, angle), np.float64, seed)


# ---------------------------------------------------------------------------
# torch in, torch out
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("tdtype,rtol", [(torch.float32, 2.0 ** -23), (torch.float16, 2.0 ** -10),
                                         (torch.bfloat16, 2.0 ** -7)], ids=["float32", "float16", "bfloat16"])
def test_torch_inputs(interleave, tdtype, rtol):
    rng, seed = fresh()
    q64, k64, indptr, offsets = random_batch(rng, dtype=np.float64, hq=4, hkv=2, head_dim=16)
    q, k = torch.from_numpy(q64).to(tdtype), torch.from_numpy(k64).to(tdtype)
    q0, k0 = q.clone(), k.clone()
    q_rope, k_rope = R.apply_rope(q, k, torch.from_numpy(indptr), torch.from_numpy(offsets.astype(np.int64)),
                                  rotary_dim=12, interleave=interleave)
    assert isinstance(q_rope, torch.Tensor) and isinstance(k_rope, torch.Tensor), f"seed={seed}"
    assert q_rope.dtype == tdtype and k_rope.dtype == tdtype, f"seed={seed}"
    assert torch.equal(q, q0) and torch.equal(k, k0), f"seed={seed}: an input changed"
    pos = brute_positions(indptr, offsets)
    angle = brute_plain_angle(12, 1e4, 1.0)
    for got, x in ((q_rope, q), (k_rope, k)):
        want = brute_rope(x.double().numpy(), pos, 12, interleave, angle)
        np.testing.assert_allclose(got.double().numpy(), want, rtol=rtol, atol=1e-6, err_msg=f"seed={seed}")
        assert torch.equal(got[..., 12:], x[..., 12:]), f"seed={seed}: tail dims changed"


# ---------------------------------------------------------------------------
# Reference 3: properties
# ---------------------------------------------------------------------------

def pairs(rotary_dim, interleave):
    half = rotary_dim // 2
    if interleave:
        return np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)
    return np.arange(half), np.arange(half, rotary_dim)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("llama", [False, True])
def test_rotation_preserves_each_pairs_norm(interleave, llama):
    rng, seed = fresh()
    q, k, indptr, offsets = random_batch(rng, dtype=np.float64, hq=4, hkv=2, head_dim=16, max_offset=50000)
    fn = R.apply_llama31_rope if llama else R.apply_rope
    q_rope, k_rope = fn(q, k, indptr, offsets, rotary_dim=12, interleave=interleave)
    a, b = pairs(12, interleave)
    for got, x in ((q_rope, q), (k_rope, k)):
        np.testing.assert_allclose(np.hypot(got[..., a], got[..., b]), np.hypot(x[..., a], x[..., b]),
                                   rtol=1e-12, err_msg=f"seed={seed}")
        # and the pairs really turn: not the identity once positions are > 0
        if x.shape[0]:
            moved = np.abs(got[..., :12] - x[..., :12]).max()
            assert moved > 1e-3 or brute_positions(indptr, offsets) == [0] * x.shape[0], f"seed={seed}"


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("llama", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 10])
def test_scores_depend_only_on_the_position_difference(interleave, llama, rotary_dim):
    rng, seed = fresh()
    hq, hkv, d = 4, 2, 16
    q = rng.standard_normal((2, hq, d))
    k = rng.standard_normal((2, hkv, d))
    m, n = (int(x) for x in rng.integers(0, 5000, size=2))
    shift = int(rng.integers(1, 50000))
    fn = R.apply_llama31_rope_pos_ids if llama else R.apply_rope_pos_ids
    kw = dict(rotary_dim=rotary_dim, interleave=interleave, rope_scale=3.0)

    def scores(pm, pn):
        q_rope, _ = fn(q, k, [pm, pn], **kw)
        _, k_rope = fn(q, k, [pm, pn], **kw)
        # query row 0 at position pm against key row 1 at position pn; head h reads kv head h // 2
        return np.einsum("hd,hd->h", q_rope[0], np.repeat(k_rope[1], hq // hkv, axis=0))

    base = scores(m, n)
    np.testing.assert_allclose(scores(m + shift, n + shift), base, rtol=1e-9, atol=1e-9,
                               err_msg=f"seed={seed} m={m} n={n} shift={shift}")
    # ... while a different difference gives different scores
    assert np.abs(scores(m + shift + 1, n + shift) - base).max() > 1e-6, f"seed={seed}"


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_position_zero_is_the_identity(interleave, dtype):
    rng, seed = fresh()
    q, k, indptr, _ = random_batch(rng, dtype=dtype, hq=4, hkv=1, head_dim=16)
    nnz = q.shape[0]
    for fn in (R.apply_rope_pos_ids, R.apply_llama31_rope_pos_ids):
        q_rope, k_rope = fn(q, k, np.zeros(nnz, np.int32), interleave=interleave)
        assert np.array_equal(q_rope, q) and np.array_equal(k_rope, k), f"seed={seed} {fn.__name__}"
    # a request's first row sits at its offset: offset 0 leaves it unchanged
    offsets = np.zeros(len(indptr) - 1, np.int32)
    q_rope, _ = R.apply_rope(q, k, indptr, offsets, interleave=interleave)
    firsts = [int(indptr[i]) for i in range(len(indptr) - 1) if indptr[i + 1] > indptr[i]]
    assert np.array_equal(q_rope[firsts], q[firsts]), f"seed={seed}"


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("rotary_dim", [2, 6, 14])
def test_tail_dims_pass_through_bit_identical(interleave, dtype, rotary_dim):
    rng, seed = fresh()
    q, k, indptr, offsets = random_batch(rng, dtype=dtype, hq=4, hkv=2, head_dim=16)
    q[..., -1] = np.nan                                          # even odd values pass untouched
    k[..., -1] = -np.inf
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    for fn in (R.apply_rope, R.apply_llama31_rope):
        q_rope, k_rope = fn(q, k, indptr, offsets, rotary_dim=rotary_dim, interleave=interleave)
        for got, x in ((q_rope, q), (k_rope, k)):
            assert np.array_equal(got[..., rotary_dim:].view(uint), x[..., rotary_dim:].view(uint)), \
                f"seed={seed} {fn.__name__}"
            assert np.isfinite(got[..., :rotary_dim]).all(), f"seed={seed}"


@pytest.mark.parametrize("interleave", [False, True])
def test_indptr_offsets_equal_expanded_pos_ids(interleave):
    rng, seed = fresh()
    q, k, indptr, offsets = random_batch(rng, dtype=np.float32, hq=6, hkv=2, head_dim=16, batch=6)
    lens = np.diff(indptr)
    pos = np.concatenate([o + np.arange(n) for o, n in zip(offsets, lens)] + [np.zeros(0, int)]).astype(np.int32)
    kw = dict(rotary_dim=8, interleave=interleave)
    for ragged, per_row, extra in ((R.apply_rope, R.apply_rope_pos_ids, dict(rope_scale=2.0, rope_theta=500.0)),
                                   (R.apply_llama31_rope, R.apply_llama31_rope_pos_ids, dict(rope_scale=16.0))):
        a = ragged(q, k, indptr, offsets, **kw, **extra)
        b = per_row(q, k, pos, **kw, **extra)
        np.testing.assert_array_equal(a[0], b[0], err_msg=f"seed={seed} {ragged.__name__}")
        np.testing.assert_array_equal(a[1], b[1], err_msg=f"seed={seed} {ragged.__name__}")


@pytest.mark.parametrize("interleave", [False, True])
def test_llama31_all_high_frequency_is_plain_rope_unscaled(interleave):
    """With high_freq_wavelen = old_context_len / high_freq_factor above every
    wavelength (at most 2 pi rope_theta), no frequency is scaled."""
    rng, seed = fresh()
    q, k, indptr, offsets = random_batch(rng, dtype=np.float64, hq=4, hkv=2, head_dim=16, max_offset=100000)
    theta = 1e4
    assert 8192 / 0.1 > 2 * math.pi * theta
    got = R.apply_llama31_rope(q, k, indptr, offsets, interleave=interleave, rope_scale=8.0, rope_theta=theta,
                               low_freq_factor=0.01, high_freq_factor=0.1, old_context_len=8192)
    want = R.apply_rope(q, k, indptr, offsets, interleave=interleave, rope_scale=1.0, rope_theta=theta)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=f"seed={seed}")


@pytest.mark.parametrize("interleave", [False, True])
def test_llama31_all_low_frequency_is_plain_rope_scaled(interleave):
    """With low_freq_wavelen below every wavelength (at least 2 pi), every
    frequency is divided by rope_scale: plain RoPE with that rope_scale."""
    rng, seed = fresh()
    q, k, indptr, offsets = random_batch(rng, dtype=np.float64, hq=4, hkv=2, head_dim=16, max_offset=100000)
    got = R.apply_llama31_rope(q, k, indptr, offsets, interleave=interleave, rope_scale=8.0, rope_theta=1e4,
                               low_freq_factor=2.0, high_freq_factor=4.0, old_context_len=6.0)
    want = R.apply_rope(q, k, indptr, offsets, interleave=interleave, rope_scale=8.0, rope_theta=1e4)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9, err_msg=f"seed={seed}")


# ---------------------------------------------------------------------------
# Validation: one case per rule; the message names the argument, nothing changes
# ---------------------------------------------------------------------------

def bad_inputs():
    rng = np.random.default_rng()
    return dict(q=rng.standard_normal((4, 2, 8)).astype(np.float32),
                k=rng.standard_normal((4, 1, 8)).astype(np.float32),
                indptr=np.array([0, 1, 4], np.int32), offsets=np.array([0, 5], np.int32),
                pos_ids=np.array([0, 1, 2, 3], np.int32))


def rope(d, **kw):
    return R.apply_rope(d["q"], d["k"], d["indptr"], d["offsets"], **kw)


def rope_ids(d, **kw):
    return R.apply_rope_pos_ids(d["q"], d["k"], d["pos_ids"], **kw)


def llama(d, **kw):
    return R.apply_llama31_rope(d["q"], d["k"], d["indptr"], d["offsets"], **kw)


def llama_ids(d, **kw):
    return R.apply_llama31_rope_pos_ids(d["q"], d["k"], d["pos_ids"], **kw)


# (case, argument named first in the message, a phrase of the rule, call)
RULES = [
    ("q_rank_2", "q", "rank 3", lambda d: R.apply_rope(d["q"][0], d["k"], d["indptr"], d["offsets"])),
    ("k_rank_4", "k", "rank 3", lambda d: R.apply_rope_pos_ids(d["q"], d["k"][None], d["pos_ids"])),
    ("q_integer", "q", "floating-point", lambda d: R.apply_rope_pos_ids(d["q"].astype(np.int32), d["k"],
                                                                        d["pos_ids"])),
    ("k_other_nnz", "k", "rows (nnz)", lambda d: R.apply_rope(d["q"], d["k"][:3], d["indptr"], d["offsets"])),
    ("k_other_head_dim", "k", "head_dim", lambda d: R.apply_llama31_rope_pos_ids(d["q"], d["k"][..., :6],
                                                                                 d["pos_ids"])),
    ("indptr_float", "indptr", "int32", lambda d: R.apply_rope(d["q"], d["k"], d["indptr"].astype(np.float32),
                                                               d["offsets"])),
    ("indptr_start", "indptr", "start at 0", lambda d: R.apply_rope(d["q"], d["k"], [1, 2, 4], d["offsets"])),
    ("indptr_decreasing", "indptr", "non-decreasing",
     lambda d: R.apply_llama31_rope(d["q"], d["k"], [0, 3, 1, 4], [0, 0, 0])),
    ("indptr_end", "indptr", "end at nnz", lambda d: R.apply_rope(d["q"], d["k"], [0, 1, 3], d["offsets"])),
    ("indptr_empty", "indptr", "length", lambda d: R.apply_rope(d["q"], d["k"], np.zeros(0, np.int32), [])),
    ("offsets_length", "offsets", "one entry per request",
     lambda d: R.apply_rope(d["q"], d["k"], d["indptr"], d["offsets"][:1])),
    ("offsets_negative", "offsets", ">= 0", lambda d: R.apply_llama31_rope(d["q"], d["k"], d["indptr"], [0, -1])),
    ("offsets_float", "offsets", "int32", lambda d: R.apply_rope(d["q"], d["k"], d["indptr"],
                                                                 d["offsets"].astype(np.float64))),
    ("pos_ids_length", "pos_ids", "one entry per row",
     lambda d: R.apply_rope_pos_ids(d["q"], d["k"], d["pos_ids"][:3])),
    ("pos_ids_negative", "pos_ids", ">= 0", lambda d: R.apply_llama31_rope_pos_ids(d["q"], d["k"], [0, 1, -2, 3])),
    ("rotary_dim_odd", "rotary_dim", "even", lambda d: rope(d, rotary_dim=3)),
    ("rotary_dim_zero", "rotary_dim", "0 < rotary_dim", lambda d: rope_ids(d, rotary_dim=0)),
    ("rotary_dim_negative", "rotary_dim", "0 < rotary_dim", lambda d: llama(d, rotary_dim=-2)),
    ("rotary_dim_above_head_dim", "rotary_dim", "<= head_dim", lambda d: llama_ids(d, rotary_dim=10)),
    ("rotary_dim_float", "rotary_dim", "integer", lambda d: rope(d, rotary_dim=4.0)),
    ("rotary_dim_default_odd_head_dim", "rotary_dim", "even",
     lambda d: R.apply_rope_pos_ids(d["q"][..., :7], d["k"][..., :7], d["pos_ids"])),
    ("rope_theta_zero", "rope_theta", "> 0", lambda d: rope(d, rope_theta=0.0)),
    ("rope_theta_negative", "rope_theta", "> 0", lambda d: llama(d, rope_theta=-1e4)),
    ("rope_theta_inf", "rope_theta", "finite", lambda d: rope_ids(d, rope_theta=np.inf)),
    ("rope_theta_nan", "rope_theta", "finite", lambda d: llama_ids(d, rope_theta=np.nan)),
    ("rope_scale_zero", "rope_scale", "> 0", lambda d: rope(d, rope_scale=0)),
    ("rope_scale_negative", "rope_scale", "> 0", lambda d: rope_ids(d, rope_scale=-2.0)),
    ("rope_scale_inf", "rope_scale", "finite", lambda d: llama(d, rope_scale=np.inf)),
    ("rope_scale_nan", "rope_scale", "finite", lambda d: llama_ids(d, rope_scale=float("nan"))),
    ("low_freq_factor_zero", "low_freq_factor", "> 0", lambda d: llama(d, low_freq_factor=0.0)),
    ("low_freq_factor_negative", "low_freq_factor", "> 0",
     lambda d: llama_ids(d, low_freq_factor=-1.0, high_freq_factor=4.0)),
    ("high_freq_factor_equal", "high_freq_factor", "> low_freq_factor",
     lambda d: llama(d, low_freq_factor=4.0, high_freq_factor=4.0)),
    ("high_freq_factor_below", "high_freq_factor", "> low_freq_factor",
     lambda d: llama_ids(d, low_freq_factor=4.0, high_freq_factor=1.0)),
    ("high_freq_factor_inf", "high_freq_factor", "finite", lambda d: llama(d, high_freq_factor=np.inf)),
    ("old_context_len_zero", "old_context_len", "> 0", lambda d: llama(d, old_context_len=0)),
    ("old_context_len_negative", "old_context_len", "> 0", lambda d: llama_ids(d, old_context_len=-8192)),
]


@pytest.mark.parametrize("case,arg,rule,call", RULES, ids=[r[0] for r in RULES])
def test_rule(case, arg, rule, call):
    assert_refused(call, bad_inputs(), arg, rule, case, exc=L.LayoutError)


def test_valid_inputs_of_the_rules_pass():
    """The rules' baseline inputs are valid, so each case fails for its one reason."""
    d = bad_inputs()
    for fn in (rope, rope_ids, llama, llama_ids):
        q_rope, k_rope = fn(d)
        assert q_rope.shape == d["q"].shape and k_rope.shape == d["k"].shape
