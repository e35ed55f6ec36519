"""The standalone RoPE kernels (nbattn.cuda.apply_rope and its three siblings)
against the references of tests/test_rope.py: a float64 loop written from the
formulas and torch, plus the golden model.  Fresh random inputs (ragged, with
empty requests, GQA, partial rotary_dim, positions up to 10^5); every assertion
message carries the seed.  On a GPU the same tests run on the device.

Tolerance: a float32 result may differ from the exact float64 value by the
golden model's rounding (half an ulp) plus the last-bit difference of the
device's cos/sin; fp16 / bf16 results are rounded twice (float64 -> float32 ->
element type), so one ulp of the element type."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import nbattn  # noqa: F401  (compat first)
import test_rope as TR
from brute import assert_refused  # noqa: E402
from nbattn import cuda as C
from nbattn import layout as L
from nbattn import reference as R
from nbattn.cuda import rope as CR

ULP = {np.float32: 2.0 ** -23, np.float16: 2.0 ** -10, "bf16": 2.0 ** -7}
CONFIGS = [(4, 2, 16, None), (4, 1, 16, 8), (2, 2, 8, 6), (8, 2, 12, 4)]   # (hq, hkv, head_dim, rotary_dim)


def close(got, want, ulp, seed, what):
    got = np.asarray(got.float() if torch.is_tensor(got) else got, np.float64)
    np.testing.assert_allclose(got, want, rtol=2 * ulp, atol=2 * ulp * max(1.0, float(np.abs(want).max(initial=0))),
                               err_msg=f"seed={seed} {what}")


def batch(rng, dtype, hq, hkv, head_dim):
    q, k, indptr, offsets = TR.random_batch(rng, dtype=np.float32, hq=hq, hkv=hkv, head_dim=head_dim,
                                            max_len=4, batch=3, max_offset=100_000)
    if dtype == "bf16":                                   # values bf16 can hold exactly
        return torch.from_numpy(q).bfloat16(), torch.from_numpy(k).bfloat16(), indptr, offsets
    return q.astype(dtype), k.astype(dtype), indptr, offsets


def host64(x):
    return (x.float().numpy() if torch.is_tensor(x) else np.asarray(x)).astype(np.float64)


@pytest.mark.parametrize("llama", [False, True], ids=["plain", "llama31"])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bf16"], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("hq,hkv,head_dim,rotary_dim", CONFIGS)
def test_kernel_matches_the_brute_force_torch_and_the_golden_model(hq, hkv, head_dim, rotary_dim, dtype,
                                                                     interleave, llama):
    rng, seed = TR.fresh()
    q, k, indptr, offsets = batch(rng, dtype, hq, hkv, head_dim)
    q0, k0 = q.clone() if torch.is_tensor(q) else q.copy(), k.clone() if torch.is_tensor(k) else k.copy()
    rd = head_dim if rotary_dim is None else rotary_dim
    theta = float(rng.choice([1e4, 5e5, 250.0]))
    scale = float(rng.choice([1.0, 2.5, 8.0]))
    if llama:
        factors = dict(low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=float(rng.choice([64, 8192])))
        kw = dict(rotary_dim=rotary_dim, interleave=interleave, rope_scale=scale, rope_theta=theta, **factors)
        got = C.apply_llama31_rope(q, k, indptr, offsets, **kw)
        want_golden = R.apply_llama31_rope(q, k, indptr, offsets, **kw)
        angle = TR.brute_llama31_angle(rd, theta, scale, factors["low_freq_factor"], factors["high_freq_factor"],
                                       factors["old_context_len"])
    else:
        kw = dict(rotary_dim=rotary_dim, interleave=interleave, rope_scale=scale, rope_theta=theta)
        got = C.apply_rope(q, k, indptr, offsets, **kw)
        want_golden = R.apply_rope(q, k, indptr, offsets, **kw)
        angle = TR.brute_plain_angle(rd, theta, scale)
    pos = TR.brute_positions(indptr, offsets)
    ulp = ULP[dtype]
    for name, x, x0, g, w in (("q", q, q0, got[0], want_golden[0]), ("k", k, k0, got[1], want_golden[1])):
        assert type(g) is type(x) and g.dtype == x.dtype and tuple(g.shape) == tuple(x.shape), f"seed={seed} {name}"
        assert host64(x).tobytes() == host64(x0).tobytes(), f"seed={seed}: {name} changed"
        close(g, TR.brute_rope(host64(x), pos, rd, interleave, angle), ulp, seed, f"{name} vs brute force")
        close(g, host64(w), ulp, seed, f"{name} vs golden")
        if not llama:
            freq = TR.torch_inv_freq(rd, theta)
            close(g, TR.torch_rope(host64(x), pos, freq, rd, interleave, scale), ulp, seed, f"{name} vs torch")


@pytest.mark.parametrize("interleave", [False, True])
def test_pos_ids_forms_equal_the_ragged_forms_at_the_same_positions(interleave):
    rng, seed = TR.fresh()
    q, k, indptr, offsets = batch(rng, np.float32, 4, 2, 16)
    pos = np.asarray(TR.brute_positions(indptr, offsets), np.int32)
    for ragged, ids in ((C.apply_rope, C.apply_rope_pos_ids), (C.apply_llama31_rope, C.apply_llama31_rope_pos_ids)):
        a = ragged(q, k, indptr, offsets, interleave=interleave, rotary_dim=10)
        b = ids(q, k, pos, interleave=interleave, rotary_dim=10)
        for x, y in zip(a, b):
            assert np.array_equal(x, y), f"seed={seed} {ids.__name__}"


def test_the_dimensions_past_rotary_dim_are_copied_bit_for_bit():
    rng, seed = TR.fresh()
    q = rng.standard_normal((3, 2, 16)).astype(np.float16)
    k = rng.standard_normal((3, 1, 16)).astype(np.float16)
    q[0, 0, 8:] = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 6e-8, 1.0], np.float16)
    q_rope, k_rope = C.apply_rope(q, k, [0, 1, 3], [7, 90_000], rotary_dim=8)
    assert q_rope[..., 8:].tobytes() == q[..., 8:].tobytes(), f"seed={seed}"
    assert k_rope[..., 8:].tobytes() == k[..., 8:].tobytes(), f"seed={seed}"
    assert np.isfinite(q_rope[..., :8]).all(), f"seed={seed}: a tail value reached a rotated pair"


@pytest.mark.parametrize("indptr,offsets", [([0], []), ([0, 0, 0], [4, 1])])
def test_no_rows(indptr, offsets):
    q, k = np.zeros((0, 2, 8), np.float16), np.zeros((0, 1, 8), np.float16)
    q_rope, k_rope = C.apply_rope(q, k, indptr, offsets)
    assert q_rope.shape == (0, 2, 8) and k_rope.shape == (0, 1, 8) and q_rope.dtype == np.float16


def test_cpu_torch_in_gives_cpu_torch_out():
    rng, seed = TR.fresh()
    q, k, indptr, offsets = batch(rng, np.float32, 4, 2, 8)
    tq, tk = torch.from_numpy(q).half(), torch.from_numpy(k).half()
    got = C.apply_rope_pos_ids(tq, tk, torch.tensor(TR.brute_positions(indptr, offsets), dtype=torch.int32))
    want = C.apply_rope_pos_ids(tq.numpy(), tk.numpy(), TR.brute_positions(indptr, offsets))
    for g, w in zip(got, want):
        assert torch.is_tensor(g) and g.dtype == torch.float16 and g.device.type == "cpu", f"seed={seed}"
        assert np.array_equal(g.numpy(), w), f"seed={seed}"


KERNELS = types.SimpleNamespace(apply_rope=C.apply_rope, apply_rope_pos_ids=C.apply_rope_pos_ids,
                                apply_llama31_rope=C.apply_llama31_rope,
                                apply_llama31_rope_pos_ids=C.apply_llama31_rope_pos_ids)


@pytest.mark.parametrize("case,arg,rule,call", TR.RULES, ids=[r[0] for r in TR.RULES])
def test_the_golden_models_rules_hold_before_any_kernel_runs(case, arg, rule, call, monkeypatch):
    """Every rule of the golden model's RoPE, called on the kernels: the same
    argument named, the same rule, nothing changed, and no kernel launched."""
    def no_launch(*a, **kw):
        raise AssertionError("a kernel was launched")
    monkeypatch.setattr(TR, "R", KERNELS)                # the rules' calls now reach nbattn.cuda
    monkeypatch.setattr(CR, "launch", no_launch)
    assert_refused(call, TR.bad_inputs(), arg, rule, case, exc=L.LayoutError)


@pytest.mark.parametrize("dtype", [np.float64, np.int16])
def test_element_types_the_kernels_do_not_hold_are_refused(dtype):
    d = TR.bad_inputs()
    assert_refused(lambda d: C.apply_rope(d["q"].astype(dtype), d["k"], d["indptr"], d["offsets"]), d, "q",
                   "float16, bfloat16 or float32", str(dtype), exc=L.LayoutError)


@pytest.mark.gpu
@pytest.mark.skipif(CR.SIMULATOR, reason="needs a real GPU")
@pytest.mark.parametrize("tdtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_torch_tensors_at_a_serving_shape(tdtype):
    """A Llama-shaped step (2048 rows, 32 / 8 heads, head_dim 128, positions to 10^5) on
    torch CUDA tensors: results are new CUDA tensors on the current stream, within one
    ulp of the golden model, and the inputs are untouched."""
    rng, seed = TR.fresh()
    lens = rng.integers(1, 512, size=8)
    lens[3] = 0
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    offsets = rng.integers(0, 100_000, size=8).astype(np.int32)
    nnz = int(indptr[-1])
    q = torch.from_numpy(rng.standard_normal((nnz, 32, 128)).astype(np.float32)).to(tdtype)
    k = torch.from_numpy(rng.standard_normal((nnz, 8, 128)).astype(np.float32)).to(tdtype)
    qd, kd = q.cuda(), k.cuda()
    ulp = {torch.float16: ULP[np.float16], torch.bfloat16: ULP["bf16"], torch.float32: ULP[np.float32]}[tdtype]
    for fn, gold in ((C.apply_rope, R.apply_rope), (C.apply_llama31_rope, R.apply_llama31_rope)):
        got = fn(qd, kd, indptr, offsets, interleave=False)
        torch.cuda.synchronize()
        want = gold(q, k, indptr, offsets, interleave=False)
        for g, w in zip(got, want):
            assert g.is_cuda and g.dtype == tdtype, f"seed={seed}"
            close(g.cpu(), host64(w), ulp, seed, fn.__name__)
    assert torch.equal(qd.cpu(), q) and torch.equal(kd.cpu(), k), f"seed={seed}: an input changed"
