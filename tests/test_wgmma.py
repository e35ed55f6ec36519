"""The Hopper warpgroup product (nbattn.cuda.blocks.wgmma, kernels.wgmma_gemm).

Everywhere: the core-matrix layout and the descriptor fields, against
statements of their own.  On a Hopper GPU: D = A @ B^T from the tensor cores
against NumPy in float64 on fresh random fp16 operands, which checks the
instruction, the descriptors and the accumulator layout at once."""
from __future__ import annotations

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn.cuda.blocks import wgmma as W
from nbattn.cuda.blocks.primitives import SIMULATOR
from brute import fresh


def py(fn):
    return getattr(fn, "py_func", fn)


def test_core_matrices_tile_the_operand_once_in_16_byte_rows():
    """Every fp16 element of a 64 x 16 K-major operand gets its own 2-byte slot; each 8 x 8
    core matrix is 128 contiguous bytes, rows of 16 bytes; the next core matrix along K
    is 128 bytes on, the next 8-row group 256."""
    off = np.array([[py(W.core_offset)(r, k, 2) for k in range(16)] for r in range(64)])
    assert sorted(off.ravel().tolist()) == list(range(0, 2048, 2))
    for r in range(64):
        for k in range(16):
            core = (r // 8) * 2 + k // 8
            assert off[r, k] == core * 128 + (r % 8) * 16 + (k % 8) * 2
    assert off[0, 8] - off[0, 0] == 128 and off[8, 0] - off[0, 0] == 256


@pytest.mark.parametrize("addr,lead,stride", [(0x400, 128, 256), (0x3FFF0, 16, 4096), (0, 0, 0)])
def test_descriptor_fields(addr, lead, stride):
    d = int(py(W.smem_desc)(addr, lead, stride))
    assert d & 0x3FFF == addr >> 4
    assert (d >> 16) & 0x3FFF == lead >> 4
    assert (d >> 32) & 0x3FFF == stride >> 4
    assert d >> 62 == 0                               # no swizzle
    assert (d >> 14) & 0x3 == 0 and (d >> 30) & 0x3 == 0 and (d >> 46) & 0xFFFF == 0


def _hopper() -> bool:
    if SIMULATOR:
        return False
    from numba import cuda
    return cuda.get_current_device().compute_capability >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90a)")
@pytest.mark.parametrize("k_steps", [1, 8])
def test_gpu_warpgroup_product_equals_numpy(k_steps):
    """One product (K = 16), and eight accumulated over head_dim 128 (the descriptors'
    start moving along K, as a score tile's would)."""
    from numba import cuda
    from nbattn.cuda.kernels.wgmma_gemm import LEAD_BYTES, THREADS, wgmma_gemm_kernel
    rng, seed = fresh()
    K = 16 * k_steps
    a = rng.standard_normal((64, K)).astype(np.float16)
    b = rng.standard_normal((64, K)).astype(np.float16)
    want = a.astype(np.float64) @ b.astype(np.float64).T

    def run(lead, stride):
        d = cuda.device_array((64, 64), np.float32)
        wgmma_gemm_kernel(k_steps, lead, stride)[1, THREADS](cuda.to_device(a.view(np.uint16)),
                                                             cuda.to_device(b.view(np.uint16)), d)
        return d.copy_to_host()

    stride = 2 * k_steps * 128
    got = run(LEAD_BYTES, stride)
    tol = dict(rtol=1e-5, atol=1e-4 * k_steps)
    if not np.allclose(got, want, **tol):
        swapped = run(stride, LEAD_BYTES)
        hint = "the swapped offsets match" if np.allclose(swapped, want, **tol) else "neither order matches"
        pytest.fail(f"seed={seed}: max |D - A B^T| = {np.abs(got - want).max():.3g} with lead {LEAD_BYTES}, "
                    f"stride {stride}; {hint}")


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90a)")
@pytest.mark.parametrize("n_q,n_k,causal", [(100, 300, False), (100, 300, True), (64, 64, True),
                                            (70, 130, True), (1, 513, False)])
def test_gpu_hopper_tile_equals_the_golden_model(n_q, n_k, causal):
    """The first Hopper attention tile (kernels.prefill_wgmma) against
    nbattn.reference.single_prefill: a partial last query block and key tile, GQA
    group 2, causal with the queries as the last keys (the golden model's rule: qo length <= kv length)."""
    from numba import cuda
    from nbattn import reference as R
    from nbattn.cuda.kernels.prefill_wgmma import BLOCK_M, HEAD_DIM, THREADS, prefill_wgmma_kernel
    rng, seed = fresh()
    hq, hkv, d = 4, 2, HEAD_DIM
    q = rng.standard_normal((n_q, hq, d)).astype(np.float16)
    k = rng.standard_normal((n_k, hkv, d)).astype(np.float16)
    v = rng.standard_normal((n_k, hkv, d)).astype(np.float16)
    o = cuda.device_array((n_q, hq, d), np.float32)
    lse = cuda.device_array((n_q, hq), np.float32)
    scale = 1.0 / np.sqrt(d)
    prefill_wgmma_kernel(causal)[((n_q + BLOCK_M - 1) // BLOCK_M, hq), THREADS](
        *(cuda.to_device(x.view(np.uint16)) for x in (q, k, v)), o, lse, np.float32(scale * np.log2(np.e)),
        hq // hkv)
    want_o, want_lse = R.single_prefill(q, k, v, causal=causal, return_lse=True)
    got_o, got_lse = o.copy_to_host(), lse.copy_to_host()
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse)), f"seed={seed}: empty rows differ"
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[fin], want_lse[fin], rtol=2e-3, atol=2e-3, err_msg=f"seed={seed} lse")
    np.testing.assert_allclose(got_o, want_o, rtol=1e-2, atol=1e-2, err_msg=f"seed={seed} o")
