"""The package's one query-tile rule (nbattn.sched.tiles.choose_tile_q) and the
menus the kernels offer it: the planners cut query rows exactly as the kernels run them."""
from __future__ import annotations

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn.sched import QUERY_TILES, choose_tile_q, decode_tiles, plan
from nbattn.cuda.wrappers import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper

from test_cuda_wrappers import HK, HQ, D, PAGE, WS, decode_batch, prefill_batch, workspace


def brute_tile(qo_lens, group, menu):
    """Smallest menu entry covering the mean fused rows, else the largest (written plainly)."""
    mean = sum(qo_lens) * group / len(qo_lens) if len(qo_lens) else 0.0
    covering = [t for t in menu if t >= mean]
    return min(covering) if covering else max(menu)


@pytest.mark.parametrize("seed", range(20))
def test_rule_equals_the_brute_force_on_random_menus(seed):
    rng = np.random.default_rng(seed)
    menu = tuple(int(t) for t in rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256], rng.integers(1, 5),
                                             replace=False))
    qo = [int(x) for x in rng.integers(0, 300, rng.integers(1, 12))]
    group = int(rng.integers(1, 9))
    assert choose_tile_q(qo, group, menu) == brute_tile(qo, group, menu)
    assert choose_tile_q(qo, group) == brute_tile(qo, group, QUERY_TILES)


def test_rule_edges_and_bad_menus():
    assert choose_tile_q([], 4, (16, 64)) == 16
    assert choose_tile_q([1] * 5, 4, decode_tiles(4)) == 4
    for bad in [(), (0, 16), (-1,)]:
        with pytest.raises(ValueError, match="tiles"):
            choose_tile_q([3], 1, bad)
    with pytest.raises(ValueError, match="group"):
        decode_tiles(0)


def test_standalone_plan_default_is_the_rule():
    qo, kv = [3, 40, 1, 9], [50, 60, 5, 9]
    assert plan(qo, kv, 4, group=2).tile_q == choose_tile_q(qo, 2)


def test_decode_wrapper_plans_with_the_decode_menu():
    rng = np.random.default_rng(3)
    b = decode_batch(rng, [5, 40, 1, 17])
    w = BatchDecodeWithPagedKVCacheWrapper(workspace(WS), num_ctas=4)
    w.plan(b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, chunk_overhead=0.0, chunk_limit=None)
    assert w.last_plan.tile_q == choose_tile_q([1] * 4, HQ // HK, decode_tiles(HQ // HK)) == HQ // HK


@pytest.mark.parametrize("qo_lens", [[3, 1, 5, 0, 2], [40, 1, 1], [0, 0, 7]])
def test_prefill_wrapper_plans_with_the_kernels_tile(qo_lens):
    rng = np.random.default_rng(4)
    b = prefill_batch(rng, qo_lens, [40, 3, 17, 0, 25][:len(qo_lens)])
    w = BatchPrefillWithPagedKVCacheWrapper(workspace(WS), num_ctas=4)
    w.plan(b["qo_indptr"], b["indptr"], b["indices"], b["last"], HQ, HK, D, PAGE, causal=True)
    tq = w.last_plan.tile_q
    assert tq == w._spec.tile_q == choose_tile_q(qo_lens, HQ // HK, (w._spec.tile_q,))
