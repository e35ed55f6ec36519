"""``nbattn verify`` in CI: a short simulator campaign over every kernel, and a
check that the campaign does catch a wrong kernel."""
from __future__ import annotations

import json

import numpy as np

import nbattn  # noqa: F401  (compat first)
import nbattn.cuda as C
from nbattn import cli
from nbattn import verify as V


def test_short_campaign_every_kernel(tmp_path):
    out = tmp_path / "verify.json"
    seed = int(np.random.default_rng().integers(1 << 30))
    rc = cli.main(["verify", "--cases", str(2 * len(V.KERNELS)), "--seed", str(seed), "--out", str(out),
                   "--no-progress", "--time-budget", "75"])
    report = json.loads(out.read_text())
    assert report["failures"] == [], f"seed {seed}: {report['failures']}"
    assert rc == 0
    assert report["backend"] in ("simulator", "gpu") and report["cases_run"] >= len(V.KERNELS)
    assert set(report["per_kernel"]) == set(V.KERNELS)


def test_campaign_catches_a_wrong_kernel(monkeypatch, tmp_path):
    real = C.single_prefill

    def off_by_a_bit(*a, **k):
        o, lse = real(*a, **k)
        return np.asarray(o) * np.float32(1.05) + np.float32(0.01), lse

    monkeypatch.setattr(C, "single_prefill", off_by_a_bit)
    out = tmp_path / "bad.json"
    rc = V.main(["--cases", "3", "--kernel", "single_prefill", "--seed", "5", "--out", str(out), "--no-progress"])
    report = json.loads(out.read_text())
    assert rc == 1 and report["mismatches"] >= 1
    fail = report["failures"][0]
    assert "--case" in fail["reproduce"] and fail["case_inputs"]["config"]["kernel"] == "single_prefill"
