"""The command line: demo, doctor, bench without a GPU, layout figures."""
import numpy as np
import pytest

import nbattn
from nbattn import cli
from nbattn.plots import layout as layout_plots


def test_demo_prints_the_spec4_facts(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "[0, 3, 4, 8]" in out and "[6, 2, 9]" in out
    assert "page 14, slot 1" in out and "page 6, slot 0" in out
    assert "[6, 7, 8, 9]" in out
    err = float(out.split("max |diff| = ")[1].split()[0])
    assert err < 1e-4


def test_dense_pool_brute_force_catches_a_wrong_answer():
    qo, pkv = layout_plots.spec4_batch()
    rng = np.random.default_rng(1)
    cache = rng.standard_normal((pkv.num_pages, 2, 4, 1, 8)).astype(np.float32)
    q = rng.standard_normal((8, 2, 8)).astype(np.float32)
    causal = cli.dense_pool_attention(q, cache, qo, pkv, causal=True)
    full = cli.dense_pool_attention(q, cache, qo, pkv, causal=False)
    assert np.abs(causal - full).max() > 1e-2   # the mask matters, so the demo check can fail


def test_doctor_names_the_device(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "numba-cuda" in out and "numpy" in out
    assert ("CUDA simulator" in out) == nbattn.simulator_enabled()


@pytest.mark.skipif(not nbattn.simulator_enabled(), reason="only meaningful without a GPU")
def test_bench_without_gpu_says_so_and_fails(capsys):
    assert cli.main(["bench"]) != 0
    assert "no CUDA GPU" in capsys.readouterr().err


def test_golden_cpu_bench_measures_both_rates():
    golden, matmul = cli.bench_golden_cpu(batch=2, q_len=64, kv_len=64, heads=2, head_dim=16, repeats=1)
    assert golden > 0 and matmul > 0


@pytest.mark.parametrize("fn", ["page_table_bsr", "causal_mask", "composable_formats"])
def test_layout_figures_render(tmp_path, fn):
    path = tmp_path / f"{fn}.png"
    getattr(layout_plots, fn)(path)
    assert path.stat().st_size > 1000


def test_causal_visibility_counts():
    qo, pkv = layout_plots.spec4_batch()
    counts = [m.sum(axis=1).tolist() for m in layout_plots.causal_visibility(qo, pkv.kv_lens)]
    assert counts == [[4, 5, 6], [2], [6, 7, 8, 9]]
