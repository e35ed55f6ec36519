"""A non-editable ``pip install .`` in a fresh virtual environment works without the checkout.

The new venv reuses this environment's dependencies (a ``.pth`` line pointing at
our site-packages, read after its own), so ``pip install --no-deps
--no-build-isolation`` builds and installs only nbattn itself: fast, offline.
Everything then runs from a folder outside the checkout.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")      # Python 3.11+


def _packages_on_disk() -> set[str]:
    return {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "nbattn").rglob("__init__.py")}


def test_every_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert _packages_on_disk() <= listed, "add the new package to [tool.setuptools] packages"
    assert "nbattn._results" in listed


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "*.egg-info", "__pycache__", "docs", "notebooks", "tests",
        "figures", ".pytest_cache", ".hypothesis"))
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "PYTHONPATH")}
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet",
                        "--no-deps", "--no-build-isolation", "--no-index", str(src)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    shutil.rmtree(src)                      # nothing may depend on the source tree any more
    work = tmp / "elsewhere"
    work.mkdir()
    return env_dir, work, env


def _nbattn(installed, *args, **extra_env):
    env_dir, work, env = installed
    return subprocess.run([str(env_dir / "bin" / "nbattn"), *args], cwd=work, env=dict(env, **extra_env),
                          capture_output=True, text=True, timeout=600)


def test_installed_copy_is_the_one_imported(installed):
    env_dir, work, env = installed
    r = subprocess.run([str(env_dir / "bin" / "python"), "-c",
                        "import nbattn; from nbattn.perf import results; "
                        "print(nbattn.__file__); print(results.default_results_root())"],
                       cwd=work, env=env, capture_output=True, text=True, check=True)
    module, root = r.stdout.split()
    assert module.startswith(str(env_dir)) and root.startswith(str(env_dir))
    assert Path(root).name == "_results" and (Path(root) / "decode.json").is_file()


def test_installed_figures_use_the_shipped_results(installed):
    r = _nbattn(installed, "figures", "--out", "figs", "--quiet")
    assert r.returncode == 0, r.stderr
    env_dir, work, _ = installed
    pngs = sorted((work / "figs").glob("*.png"))
    assert len(pngs) >= 10 and all(p.stat().st_size > 10_000 for p in pngs)
    assert "measured results: " + str(env_dir) in r.stdout        # not a silent model-only fallback
    assert "no result files" not in r.stderr
    r = _nbattn(installed, "figures", "--out", "figs2", "--quiet", "--results", "nowhere")
    assert r.returncode == 0 and "no result files in nowhere" in r.stderr   # said out loud


def test_installed_doctor_without_a_gpu(installed):
    r = _nbattn(installed, "doctor", NUMBA_ENABLE_CUDASIM="0")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    for key in ("nbattn", "numba-cuda", "CUDA driver", "NVVM", "kernels run in", "kernel cache"):
        assert key in r.stdout


def test_installed_bench_has_no_scripts_and_says_so(installed):
    r = _nbattn(installed, "bench")
    assert r.returncode != 0 and "benchmark scripts are not installed" in r.stderr
    r = _nbattn(installed, "--version")
    assert r.returncode == 0 and r.stdout.startswith("nbattn ")
