"""A sliding window's hidden keys are planned out of decode's work lists
(:func:`nbattn.cuda.decode_problem.first_visible`): every entry path (the plain
call's general path and its launch layer, both wrapper schedules) starts each
request's work at its first visible key, rounded down, and still equals a float64
brute force."""
import numpy as np
import pytest

import nbattn  # noqa: F401  (simulator choice first)
from numba import cuda  # noqa: E402
from nbattn import cuda as C  # noqa: E402
from nbattn.cuda.decode_problem import first_visible, split_rule, window_edge  # noqa: E402
from nbattn.variants import Variant  # noqa: E402

from brute import brute_attention, fresh, gather_pages, random_paged_batch  # noqa: E402

HK, G, D, PAGE = 2, 2, 8, 4


def _want(b, lens, **kw):
    outs, lses = [], []
    for r in range(len(lens)):
        k, v = gather_pages(b["cache"], b["indptr"], b["indices"], b["last"], r)
        o, l2 = brute_attention(b["q"][r:r + 1], k, v, **kw)
        outs.append(o[0]), lses.append(l2[0])
    return np.stack(outs), np.stack(lses)


def _close(got, want, seed, what):
    o, lse = (np.asarray(x.copy_to_host() if hasattr(x, "copy_to_host") else x, np.float64) for x in got)
    wo, wl = want
    empty = np.isneginf(wl)
    assert np.array_equal(np.isneginf(lse), empty), f"seed {seed}, {what}: empty rows differ"
    np.testing.assert_allclose(o, wo, atol=2e-5, rtol=1e-4, err_msg=f"seed {seed}, {what}: o")
    np.testing.assert_allclose(lse[~empty], wl[~empty], atol=2e-5, rtol=1e-5, err_msg=f"seed {seed}, {what}: lse")


def test_first_visible_is_the_window_edge_rounded_down():
    lens = np.array([0, 1, 5, 17, 40, 100])
    for edge, align in ((-1, 16), (0, 1), (3, 4), (10, 16), (200, 8)):
        got = first_visible(lens, edge, align)
        want = [0 if edge < 0 else max(n - 1 - edge, 0) // align * align for n in lens]
        assert got.tolist() == want
    assert window_edge(Variant(window_left=7)) == 7
    assert window_edge(Variant(window_left=7, sink_size=2)) == -1      # sink tokens keep the first keys
    assert window_edge(Variant()) == -1


@pytest.mark.parametrize("window", [0, 3, 9, 1000])
def test_plain_call_with_a_window_equals_brute_force(window):
    """numpy inputs (the general path) and numba device arrays (the launch layer)."""
    rng, seed = fresh()
    lens = rng.integers(0, 60, size=5)
    lens[int(rng.integers(5))] = 0
    b = random_paged_batch(rng, qo_lens=[1] * 5, kv_lens=lens, page_size=PAGE, num_kv_heads=HK, group=G,
                           head_dim=D, share_first_page=True)
    want = _want(b, lens, window_left=window)
    tables = (b["indptr"], b["indices"], b["last"])
    got = C.batch_decode_paged(b["q"], b["cache"], *tables, return_lse=True, window_left=window)
    _close(got, want, seed, "numpy")
    dev = [cuda.to_device(x) for x in (b["q"], b["cache"], *tables)]
    got = C.batch_decode_paged(*dev, return_lse=True, window_left=window)
    _close(got, want, seed, "device arrays")


@pytest.mark.parametrize("schedule", ["lpt", "split"])
def test_wrapper_plans_from_the_first_visible_key(schedule):
    rng, seed = fresh()
    window = int(rng.integers(0, 12))
    lens = rng.integers(80, 200, size=4)
    b = random_paged_batch(rng, qo_lens=[1] * 4, kv_lens=lens, page_size=PAGE, num_kv_heads=HK, group=G,
                           head_dim=D)
    w = C.BatchDecodeWithPagedKVCacheWrapper(cuda.device_array(1 << 20, np.uint8), num_ctas=8)
    w.plan(b["indptr"], b["indices"], b["last"], HK * G, HK, D, PAGE, window_left=window, schedule=schedule,
           q_data_type="float32",
           **(dict(chunk_overhead=0.0, chunk_limit=None) if schedule == "lpt" else {}))
    p = w.last_plan
    lo = np.maximum(lens - 1 - window, 0)
    grain = split_rule(w._cfg, 4, HK * G)[2]          # the kernels' key tile on this machine (16 keys and up)
    starts, ends, req = p.kv_start, p.kv_end, p.request
    for r in range(4):
        mine = req == r
        assert starts[mine].min() <= lo[r], f"seed {seed}: request {r} starts after its window"
        assert starts[mine].min() == lo[r] // grain * grain, f"seed {seed}: request {r} plans hidden pages"
        assert ends[mine].max() == lens[r]
    _close(w.run(b["q"], b["cache"], return_lse=True), _want(b, lens, window_left=window), seed, schedule)
