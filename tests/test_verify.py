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


def test_sigmoid_rows_are_compared_against_their_largest_magnitude():
    """bf16-rounded sigmoid weights over many keys: elementwise relative error is
    large where a row's sum cancels, rowwise it is small; a lost share of the keys
    (a dropped cascade level, say) still fails."""
    import torch
    rng = np.random.default_rng()
    bf = lambda x: torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).float().numpy()  # noqa: E731
    s, v = rng.standard_normal((64, 600)), bf(rng.standard_normal((600, 64)) * 3)
    w = 1 / (1 + np.exp(-(s + 0.5)))
    exact, rounded = w @ v, bf(bf(w) @ v)
    assert V.compare(rounded, exact, "bf16", rowwise=True)[0]
    assert not V.compare(rounded, exact, "bf16")[0]          # why sigmoid rows need the row's scale
    lost = bf(w[:, 100:] @ v[100:])                           # a sixth of the keys missing
    assert not V.compare(lost, exact, "bf16", rowwise=True)[0]


def test_nan_mismatch_message_says_which_side():
    g = np.array([[np.nan, 1.0, 2.0]])
    w = np.array([[0.5, 1.0, np.nan]])
    ok, why, _ = V.compare(g, w, "f32")
    assert not ok and "NaN at 1 places where the golden model is not" in why and "not NaN at 1" in why


def test_a_campaign_cut_short_still_reaches_every_kernel():
    idx = list(range(400))
    cfgs = {i: V.draw_config(3, i, V.KERNELS, True, 400, 4) for i in idx}
    order = V._run_order(idx, cfgs)
    assert sorted(order) == idx
    first_round = [cfgs[i].kernel for i in order[: 4 * len(V.KERNELS)]]
    assert set(first_round) == set(V.KERNELS)
    runs = [V.astuple_key(cfgs[i]) for i in order]            # each configuration's cases in one run
    assert len({k for k in runs}) == sum(1 for a, b in zip([None] + runs, runs) if a != b)
