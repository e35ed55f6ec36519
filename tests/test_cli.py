"""The command line: demo, doctor, bench without a GPU, layout figures."""
import json
import os
import subprocess
import sys

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
    assert "numba-cuda" in out and "numpy" in out and "cuda-bindings" in out
    assert ("CUDA simulator" in out) == nbattn.simulator_enabled()
    for key in ("CUDA driver", "NVVM", "kernels run in", "kernel cache"):
        assert key in out


def _run(*args, **env):
    full = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    full.update(env)
    return subprocess.run([sys.executable, "-m", "nbattn.cli", *args], env=full,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(nbattn._compat.driver_gpu_count() > 0, reason="needs a machine without a driver")
def test_doctor_without_a_driver_reports_and_exits_0():
    r = _run("doctor", NUMBA_ENABLE_CUDASIM="0")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "CUDA driver" in r.stdout and "not found" in r.stdout
    assert "NUMBA_ENABLE_CUDASIM" in r.stdout       # says how to get the simulator back


def test_version_and_help_are_quiet_and_complete():
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"nbattn {nbattn.__version__}"
    for cmd in ([], ["demo"], ["figures"], ["doctor"], ["bench"]):
        r = _run(*cmd, "--help")
        assert r.returncode == 0 and "usage: nbattn" in r.stdout
        assert "simulator" not in r.stderr, r.stderr      # the notice belongs to kernel runs
    parser = cli.build_parser()
    subcommands = parser._subparsers._group_actions[0].choices
    assert set(subcommands) >= {"demo", "figures", "doctor", "bench"}
    for p in [parser, *subcommands.values()]:
        for opt in p._actions:
            assert opt.help, f"{p.prog} {opt.option_strings or opt.dest} has no help text"


@pytest.mark.skipif(not nbattn.simulator_enabled(), reason="only meaningful without a GPU")
def test_bench_without_gpu_says_so_and_fails(capsys):
    assert cli.main(["bench"]) != 0
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.fixture
def fast_cpu_bench(monkeypatch):
    monkeypatch.setattr(cli, "bench_golden_cpu", lambda **case: (2e9, 4e9))


def test_bench_cpu_writes_to_a_fresh_folder_not_the_committed_results(tmp_path, monkeypatch,
                                                                       capsys, fast_cpu_bench):
    committed = cli.BENCH_DIR / "results" / "golden_cpu.json"
    before = committed.read_bytes()
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--cpu"]) == 0
    made = list(tmp_path.glob("nbattn-bench-*/golden_cpu.json"))
    assert len(made) == 1 and str(made[0].parent.resolve()) in capsys.readouterr().out
    assert json.loads(made[0].read_text())["records"][1]["value"] == 0.5
    assert cli.main(["bench", "--cpu", "--out", "mine"]) == 0
    assert (tmp_path / "mine" / "golden_cpu.json").is_file()
    assert committed.read_bytes() == before


def test_bench_update_results_targets_the_checkout(monkeypatch, tmp_path, fast_cpu_bench):
    monkeypatch.setattr(cli, "BENCH_DIR", tmp_path / "benchmarks")
    assert cli.main(["bench", "--cpu", "--update-results"]) == 2     # no checkout there
    (tmp_path / "benchmarks").mkdir()
    assert cli.main(["bench", "--cpu", "--update-results"]) == 0
    assert (tmp_path / "benchmarks" / "results" / "golden_cpu.json").is_file()


def test_bench_without_scripts_says_so_and_fails(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "BENCH_DIR", tmp_path / "site-packages-has-no-benchmarks")
    assert cli.main(["bench"]) == 2
    assert "benchmark scripts are not installed" in capsys.readouterr().err


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
