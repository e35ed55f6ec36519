"""RoPE at attention time (``pos_encoding_mode="ROPE_LLAMA"``) in the golden model.

The brute force here rotates with complex numbers, one vector at a time: the pair
``(x_p, x_{p + d/2})`` is ``z = x_p + i x_{p + d/2}`` and turns to ``z * e^{i a}``,
with ``a = (pos / rope_scale) * rope_theta ** (-2p / d)``; then it attends with
tests/brute.py's float64 loop.  Keys turn by their position in the request, the
query by its own (bottom-right aligned), so the cache holds keys unrotated.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nbattn import reference as R
from nbattn.variants import Variant

from brute import brute_attention, brute_rope, fresh, gather_pages, indptr_of, random_paged_batch, turn


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv_lens=st.lists(st.integers(0, 40), min_size=1, max_size=4), page_size=st.sampled_from([1, 3, 16]),
       group=st.sampled_from([1, 2, 4]), theta=st.sampled_from([1e4, 5e5, 37.0]),
       scale=st.sampled_from([1.0, 2.5]), seed=st.integers(0, 2 ** 31))
def test_paged_decode_rotates_q_and_every_key_by_its_position(kv_lens, page_size, group, theta, scale, seed):
    rng = np.random.default_rng(seed)
    b = random_paged_batch(rng, qo_lens=[1] * len(kv_lens), kv_lens=kv_lens, page_size=page_size,
                           num_kv_heads=2, group=group, head_dim=8, share_first_page=True, dtype=np.float32)
    o, lse = R.batch_decode_paged(b["q"], b["cache"], b["indptr"], b["indices"], b["last"],
                                  pos_encoding_mode="ROPE_LLAMA", rope_scale=scale, rope_theta=theta,
                                  return_lse=True)
    for r, n in enumerate(kv_lens):
        k, v = gather_pages(b["cache"], b["indptr"], b["indices"], b["last"], r)
        if n == 0:
            assert np.all(o[r] == 0) and np.all(np.isneginf(lse[r]))
            continue
        want_o, want_lse = brute_rope(b["q"][r:r + 1], k, v, scale, theta)
        np.testing.assert_allclose(o[r], want_o[0], atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(lse[r], want_lse[0], atol=2e-5, rtol=2e-5)


def test_ragged_causal_prefill_with_an_empty_request():
    rng, seed = fresh()
    qo_lens, kv_lens = [3, 0, 5], [7, 4, 5]
    q = rng.standard_normal((sum(qo_lens), 4, 16)).astype(np.float32)
    k = rng.standard_normal((sum(kv_lens), 2, 16)).astype(np.float32)
    v = rng.standard_normal((sum(kv_lens), 2, 16)).astype(np.float32)
    qo, kv = indptr_of(qo_lens), indptr_of(kv_lens)
    o, lse = R.batch_prefill_ragged(q, k, v, qo, kv, causal=True, pos_encoding_mode="ROPE_LLAMA",
                                    rope_theta=500.0, return_lse=True)
    for r in range(3):
        qs, ks = slice(qo[r], qo[r + 1]), slice(kv[r], kv[r + 1])
        if qo_lens[r] == 0:
            continue
        want_o, want_lse = brute_rope(q[qs], k[ks], v[ks], 1.0, 500.0, causal=True)
        np.testing.assert_allclose(o[qs], want_o, atol=2e-5, rtol=2e-5, err_msg=f"seed {seed}")
        np.testing.assert_allclose(lse[qs], want_lse, atol=2e-5, rtol=2e-5, err_msg=f"seed {seed}")


def test_attention_time_rope_equals_rotating_first_with_the_standalone_function():
    """Rotating q and k with apply_rope_pos_ids at their positions, then attending with
    no position encoding, gives the same numbers: the cache holds unrotated keys."""
    rng, seed = fresh()
    nk, nq = 23, 4
    q = rng.standard_normal((nq, 8, 32)).astype(np.float32)
    k = rng.standard_normal((nk, 2, 32)).astype(np.float32)
    v = rng.standard_normal((nk, 2, 32)).astype(np.float32)
    o = R.single_prefill(q, k, v, causal=True, pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=1e4)
    q_rot, _ = R.apply_rope_pos_ids(q, q[:, :2], np.arange(nk - nq, nk), rope_scale=2.0, rope_theta=1e4)
    k_rot, _ = R.apply_rope_pos_ids(k, k, np.arange(nk), rope_scale=2.0, rope_theta=1e4)
    want = R.single_prefill(np.asarray(q_rot, np.float32), np.asarray(k_rot, np.float32), v, causal=True)
    np.testing.assert_allclose(o, want, atol=1e-5, rtol=1e-5, err_msg=f"seed {seed}")


def test_a_score_depends_on_the_distance_only():
    """Shifting every position of a decode by the same amount leaves its output as it was
    (up to float rounding): what RoPE is for."""
    rng, seed = fresh()
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    k = rng.standard_normal((9, 4, 16)).astype(np.float32)
    v = rng.standard_normal((9, 4, 16)).astype(np.float32)
    o = R.single_decode(q[0], k, v, pos_encoding_mode="ROPE_LLAMA")
    plain = R.single_decode(q[0], k, v)
    shifted = brute_attention(turn(q, [108], 1.0, 1e4), turn(k, np.arange(100, 109), 1.0, 1e4), v)[0][0]
    np.testing.assert_allclose(o, shifted, atol=2e-5, rtol=2e-5, err_msg=f"seed {seed}")
    assert not np.allclose(o, plain, atol=1e-3)


@pytest.mark.parametrize("name,value", [("rope_theta", 0.0), ("rope_theta", -1.0), ("rope_theta", float("nan")),
                                        ("rope_scale", 0.0), ("rope_scale", float("inf"))])
def test_bad_rope_numbers_are_refused_naming_the_argument(name, value):
    q = np.ones((4, 8), np.float32)
    k = np.ones((3, 2, 8), np.float32)
    with pytest.raises(ValueError, match=f"^{name}: must be finite and > 0"):
        R.single_decode(q, k, k, pos_encoding_mode="ROPE_LLAMA", **{name: value})
    with pytest.raises(ValueError, match=f"^{name}:"):
        Variant(pos_encoding_mode="ROPE_LLAMA", **{name: value})
