"""Performance-model functions, GPU specs and the result-file format."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nbattn.perf import gpus, results
from nbattn.perf import roofline as rl
from nbattn.perf.results import ResultFormatError


# --------------------------------------------------------------------------
# FLOPs, bytes, intensity
# --------------------------------------------------------------------------

def brute_visible_pairs(q, k):
    """Count the bottom-right causal mask element by element."""
    i = np.arange(q)[:, None]
    j = np.arange(k)[None, :]
    return int((j <= k - q + i).sum())


@pytest.mark.parametrize("q,k", [(1, 1), (1, 9), (3, 6), (4, 9), (8, 8), (7, 3), (16, 100)])
def test_causal_pairs_match_the_mask(q, k):
    assert rl.causal_visible_pairs(q, k) == brute_visible_pairs(q, k)


def test_causal_pairs_spec4_request2():
    # The example batch's R2: its four query rows see 6, 7, 8, 9 keys.
    assert rl.causal_visible_pairs(4, 9) == 6 + 7 + 8 + 9
    assert rl.causal_visible_pairs(1, 4096) == 4096  # decode sees everything


def test_flops_spot_values():
    assert rl.attention_flops(1, 4096, 128, 32) == 4 * 4096 * 128 * 32
    assert rl.attention_flops(8192, 8192, 128) == 4 * 8192 * 8192 * 128
    causal = rl.attention_flops(8192, 8192, 128, causal=True)
    assert causal == 4 * 128 * (8192 * 8192 - 8192 * 8191 / 2)
    # Vectorized: one value per length.
    np.testing.assert_array_equal(rl.attention_flops(1, np.array([1, 2, 3]), 2),
                                  [8, 16, 24])


def test_bytes_spot_values():
    # b*d*(l_q*H_qo + 2*l_kv*H_kv + l_q*H_qo)
    assert rl.attention_bytes(1, 4096, 128, 32, 32, 2) == 2 * 128 * (32 + 2 * 4096 * 32 + 32)
    assert rl.attention_bytes(1, 4096, 128, 32, 8, 2) == 2 * 128 * (32 + 2 * 4096 * 8 + 32)
    assert rl.attention_bytes(10, 20, 64) == 2 * 64 * (10 + 40 + 10)  # MHA default, fp16


def test_decode_intensity_orders():
    mha = rl.operational_intensity(1, 4096, 128, 32, 32, bytes_per_elem=2)
    assert 0.99 < mha < 1.0  # (2/b)*l_kv/(1+l_kv) -> 1 FLOP/byte for fp16 MHA decode
    gqa8 = rl.operational_intensity(1, 4096, 128, 32, 4, bytes_per_elem=2)
    assert gqa8 == pytest.approx(4 * 4096 * 32 / (2 * (64 + 2 * 4096 * 4)))
    assert gqa8 == pytest.approx(8.0, rel=0.01)  # O(group)
    fp8 = rl.operational_intensity(1, 4096, 128, 32, 32, bytes_per_elem=1)
    assert fp8 == pytest.approx(2 * mha)


def test_prefill_intensity_grows_with_length():
    lens = np.array([128, 1024, 8192])
    inten = rl.operational_intensity(lens, lens, 128, 32, 32)
    np.testing.assert_allclose(inten, lens / 2)  # (2/b)*l*l/(2l) with b = 2
    assert np.all(np.diff(inten) > 0)


def test_closed_form_exact_for_mha_and_close_for_gqa_decode():
    q = np.array([1, 7, 64, 512, 4096])
    k = np.array([4096, 100, 64, 8192, 4096])
    np.testing.assert_allclose(rl.intensity_approx(q, k, 1, 2),
                               rl.operational_intensity(q, k, 128, 8, 8, 2))
    exact = rl.operational_intensity(1, 32768, 128, 32, 4)
    assert rl.intensity_approx(1, 32768, 8) == pytest.approx(exact, rel=1e-3)


# --------------------------------------------------------------------------
# Roofline, report fractions
# --------------------------------------------------------------------------

def test_attainable_is_min_of_roofs():
    assert rl.attainable_tflops(1.0, 989.5, 4300.0) == pytest.approx(4.3)
    assert rl.attainable_tflops(1e4, 989.5, 4300.0) == 989.5
    ridge = rl.ridge_point(989.5, 4300.0)
    assert ridge == pytest.approx(989.5e3 / 4300.0)
    assert rl.attainable_tflops(ridge, 989.5, 4300.0) == pytest.approx(989.5)
    x = np.geomspace(0.1, 1e4, 50)
    y = rl.attainable_tflops(x, 312.0, 2039.0)
    assert np.all(np.diff(y) >= 0) and y.max() == 312.0


def test_report_fractions():
    assert rl.bandwidth_fraction(4.3e9, 1e-3, 4300.0) == pytest.approx(1.0)  # 4.3 GB in 1 ms
    assert rl.bandwidth_fraction(2.15e12, 1.0, 4300.0) == pytest.approx(0.5)
    assert rl.peak_fraction(989.5e12, 2.0, 989.5) == pytest.approx(0.5)
    nbytes = 64 * rl.attention_bytes(1, 8192, 128, 32, 8)
    seconds = nbytes / 4300e9 / 0.8  # a run at 80 % of the copy ceiling
    assert rl.decode_bandwidth_fraction(seconds, batch=64, l_kv=8192, head_dim=128,
                                        num_qo_heads=32, num_kv_heads=8,
                                        copy_bandwidth_GBps=4300.0) == pytest.approx(0.8)
    flops = rl.attention_flops(8192, 8192, 128, 32, causal=True)
    assert rl.prefill_peak_fraction(flops / 500e12, batch=1, l_q=8192, l_kv=8192,
                                    head_dim=128, num_qo_heads=32, peak_tflops=1000.0,
                                    causal=True) == pytest.approx(0.5)


def test_roofline_time_is_the_slower_roof():
    assert rl.roofline_time_s(1e12, 1e9, 1.0, 1000.0) == pytest.approx(1.0)
    assert rl.roofline_time_s(1.0, 4.3e9, 989.5, 4300.0) == pytest.approx(1e-3)


# --------------------------------------------------------------------------
# Shared prefix, planning, Amdahl, split-KV
# --------------------------------------------------------------------------

def test_prefix_traffic_spot_values():
    assert rl.naive_prefix_tokens(64, 32768, 128) == 64 * (32768 + 128)
    assert rl.reuse_prefix_tokens(64, 32768, 128) == 32768 + 64 * 128
    assert rl.prefix_traffic_ratio(64, 32768, 128) == pytest.approx(
        64 * (32768 + 128) / (32768 + 64 * 128))
    assert rl.prefix_traffic_ratio(64, 32768, 128) == pytest.approx(51.4)
    assert rl.prefix_traffic_ratio(16, 1024, 128) == pytest.approx(6.0)
    assert rl.prefix_traffic_ratio(1, 1000, 10) == 1.0  # nothing to share
    n = np.array([1, 2, 4, 8])
    assert np.all(np.diff(rl.prefix_traffic_ratio(n, 4096, 128)) > 0)


def test_planning_breakeven():
    # L*(u - v) > p + h with u - v = 2, p + h = 11: L = 6.
    assert rl.planning_breakeven_layers(10.0, 8.0, 10.0, 1.0) == 6
    assert rl.planning_pays(6, 10.0, 8.0, 10.0, 1.0)
    assert not rl.planning_pays(5, 10.0, 8.0, 10.0, 1.0)
    # Strict inequality: 5 * 2 == 10 does not pay, so 6 layers.
    assert rl.planning_breakeven_layers(3.0, 1.0, 10.0) == 6
    assert rl.planning_breakeven_layers(1.0, 1.0, 10.0) == math.inf
    assert rl.planning_breakeven_layers(1.0, 2.0, 0.0) == math.inf
    assert rl.planning_breakeven_layers(2.0, 1.0, 0.0) == 1


def test_planning_breakeven_is_minimal():
    rng = np.random.default_rng(0)
    u = rng.uniform(1, 50, 200)
    v = u - rng.uniform(0.01, 10, 200)
    p = rng.uniform(0, 500, 200)
    h = rng.uniform(0, 50, 200)
    L = rl.planning_breakeven_layers(u, v, p, h)
    assert np.all(rl.planning_pays(L, u, v, p, h))
    assert not np.any(rl.planning_pays(L - 1, u, v, p, h))


def test_amdahl():
    assert rl.amdahl_speedup(0.5, 2.0) == pytest.approx(4 / 3)
    assert rl.amdahl_speedup(0.0, 100.0) == 1.0
    assert rl.amdahl_speedup(1.0, 7.0) == pytest.approx(7.0)
    assert rl.amdahl_speedup(0.8, 1e12) == pytest.approx(5.0)
    k = np.geomspace(1, 1000, 30)
    assert np.all(np.diff(rl.amdahl_speedup(0.6, k)) > 0)


def test_split_kv_model_shape():
    batch = np.array([1, 2, 4, 8, 16, 64, 256])
    s = rl.split_kv_speedup_model(batch, 32768, num_qo_heads=32, num_kv_heads=8)
    assert s[0] > 2 and np.all(np.diff(s) <= 1e-12)
    assert s[-1] == pytest.approx(1.0)
    mha = rl.split_kv_speedup_model(1, 32768, num_qo_heads=32, num_kv_heads=32)
    assert 1 < mha < s[0]
    # Short KV cannot be split finely: less to gain.
    assert rl.split_kv_speedup_model(1, 512) < rl.split_kv_speedup_model(1, 32768)
    frac = rl.decode_bandwidth_model(batch, 32768, split=True)
    assert np.all((frac > 0.9) & (frac <= 1.0))
    no = rl.decode_bandwidth_model(1, 32768, split=False, num_kv_heads=8, num_sms=132,
                                   sm_bandwidth_share=2.0)
    assert no == pytest.approx(16 / 132)


# --------------------------------------------------------------------------
# GPU specs
# --------------------------------------------------------------------------

def test_gpu_specs():
    assert gpus.H200.num_sms == 132 and gpus.A100_SXM_80GB.num_sms == 108
    assert gpus.H200.copy_bandwidth_GBps == 4300.0  # measured on the H200 beats datasheet
    assert gpus.H200.measured_bf16_matmul_tflops == 790.0
    assert gpus.H100_SXM.copy_bandwidth_GBps == gpus.H100_SXM.mem_bandwidth_GBps
    assert not gpus.H100_SXM.bandwidth_is_measured
    assert gpus.H200.ridge_intensity() == pytest.approx(989.5e3 / 4300)
    with pytest.raises(Exception):
        gpus.H200.num_sms = 1  # frozen


@pytest.mark.parametrize("name,expected", [("NVIDIA H200", "H200"),
                                           ("NVIDIA H100 80GB HBM3", "H100 SXM"),
                                           ("A100-SXM4-80GB", "A100 SXM 80GB")])
def test_match_gpu(name, expected):
    assert gpus.match_gpu(name).name == expected
    assert gpus.get_gpu(name).name == expected


def test_unknown_gpu():
    assert gpus.match_gpu("Radeon") is None
    with pytest.raises(KeyError, match="unknown GPU"):
        gpus.get_gpu("Radeon")


def test_with_copy_bandwidth(tmp_path):
    assert gpus.with_copy_bandwidth(gpus.H200, 4100.0).copy_bandwidth_GBps == 4100.0
    assert gpus.with_copy_bandwidth(gpus.H200, {"copy_bandwidth_GBps": 4200}).measured_copy_GBps == 4200
    for nothing in (None, {}, {"copy_bandwidth_GBps": None}, -3.0, float("nan")):
        assert gpus.with_copy_bandwidth(gpus.H200, nothing) is gpus.H200
    results.write_suite("copy", [], gpu="NVIDIA H200", command="x",
                        copy_bandwidth_GBps=4321.0, root=tmp_path)
    suite = results.load_suite("copy", tmp_path)
    spec = gpus.with_copy_bandwidth(gpus.H100_SXM, suite)
    assert spec.copy_bandwidth_GBps == 4321.0 and spec.mem_bandwidth_GBps == 3350.0


# --------------------------------------------------------------------------
# Result files
# --------------------------------------------------------------------------

def good_suite() -> dict:
    return {
        "suite": "decode", "gpu": "NVIDIA H200", "date": "2026-11-29",
        "command": "python -m nbattn bench decode", "versions": {"numba-cuda": "0.30.4"},
        "copy_bandwidth_GBps": 4310.5,
        "records": [
            {"case": {"batch": 1, "kv_len": 32768, "page_size": 16}, "metric": "bw_fraction",
             "value": 0.81, "unit": "ratio", "peers": {"sdpa": 0.55, "cudnn": None}},
            {"case": {"batch": 64, "kv_len": 4096}, "metric": "bw_fraction", "value": 0.95,
             "unit": "ratio", "peers": {"sdpa": 0.6}},
            {"case": {"batch": 64, "kv_len": 4096}, "metric": "latency_us", "value": 120.0,
             "unit": "us"},
        ],
    }


def test_roundtrip(tmp_path):
    obj = good_suite()
    path = results.write_suite("decode", obj["records"], gpu=obj["gpu"], command=obj["command"],
                               versions=obj["versions"], copy_bandwidth_GBps=4310.5,
                               date=obj["date"], root=tmp_path)
    assert path == tmp_path / "decode.json"
    suite = results.load_suite("decode", tmp_path)
    assert suite.gpu == "NVIDIA H200" and suite.copy_bandwidth_GBps == 4310.5
    assert len(suite.records) == 3 and suite.records[0].peers == {"sdpa": 0.55, "cudnn": None}
    assert suite.records[2].peers == {}  # defaulted on write
    assert suite.metrics() == ["bw_fraction", "latency_us"]
    again = json.loads(path.read_text())
    assert again["records"][0] == obj["records"][0]
    # Records round-trip as Record objects too.
    results.write_suite("decode", suite.records, gpu="NVIDIA H200", command="c", root=tmp_path)
    assert results.load_suite("decode", tmp_path).records == suite.records


def test_load_absent_is_none(tmp_path):
    assert results.load_suite("decode", tmp_path) is None
    assert results.load_suite("decode", tmp_path / "no" / "such" / "dir") is None


def test_default_root_points_into_the_checkout(monkeypatch, tmp_path):
    assert results.default_results_root().parts[-2:] == ("benchmarks", "results")
    assert results.suite_path("x") == results.default_results_root() / "x.json"
    # Without a checkout (a wheel install), the copy shipped inside the package is used.
    packaged = tmp_path / "nbattn" / "_results"
    packaged.mkdir(parents=True)
    (packaged / "decode.json").write_text("{}")
    monkeypatch.setattr(results, "checkout_results_root", lambda: tmp_path / "no" / "checkout")
    monkeypatch.setattr(results, "packaged_results_root", lambda: packaged)
    assert results.default_results_root() == packaged
    # Neither: the checkout path, where load_suite finds nothing (figures say so).
    (packaged / "decode.json").unlink()
    assert results.default_results_root() == tmp_path / "no" / "checkout"


def _mutate(path, value):
    obj = good_suite()
    target = obj
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return obj


@pytest.mark.parametrize("path,value,field", [
    (("gpu",), KeyError, "gpu"),
    (("suite",), 3, "suite"),
    (("date",), "29/11/2026", "date"),
    (("date",), "2026-02-30", "date"),
    (("command",), "", "command"),
    (("versions",), "0.1", "versions"),
    (("copy_bandwidth_GBps",), -1.0, "copy_bandwidth_GBps"),
    (("copy_bandwidth_GBps",), "4300", "copy_bandwidth_GBps"),
    (("records",), {}, "records"),
    (("records", 1, "value"), "fast", "records[1].value"),
    (("records", 1, "value"), True, "records[1].value"),
    (("records", 1, "value"), float("inf"), "records[1].value"),
    (("records", 0, "metric"), KeyError, "records[0].metric"),
    (("records", 0, "unit"), 7, "records[0].unit"),
    (("records", 0, "case"), [1, 2], "records[0].case"),
    (("records", 0, "case", "kv_len"), {"a": 1}, "records[0].case.kv_len"),
    (("records", 0, "peers", "sdpa"), "slow", "records[0].peers.sdpa"),
    (("records", 0, "peers"), [0.5], "records[0].peers"),
])
def test_validator_names_the_bad_field(path, value, field):
    bad = _mutate(path, value)
    with pytest.raises(ResultFormatError) as info:
        results.validate_suite(bad)
    assert info.value.field == field
    assert repr(field) in str(info.value)


def test_good_suite_validates_and_optional_fields():
    results.validate_suite(good_suite())
    obj = good_suite()
    del obj["copy_bandwidth_GBps"]
    for r in obj["records"]:
        r.pop("peers", None)
    suite = results.parse_suite(obj)
    assert suite.copy_bandwidth_GBps is None and suite.records[0].peers == {}


def test_load_rejects_bad_files(tmp_path):
    (tmp_path / "decode.json").write_text("{not json")
    with pytest.raises(ResultFormatError, match="not valid JSON"):
        results.load_suite("decode", tmp_path)
    bad = good_suite()
    bad["records"][0]["value"] = "x"
    (tmp_path / "decode.json").write_text(json.dumps(bad))
    with pytest.raises(ResultFormatError, match=r"records\[0\]\.value") as info:
        results.load_suite("decode", tmp_path)
    assert "decode.json" in str(info.value)
    (tmp_path / "prefill.json").write_text(json.dumps(good_suite()))  # suite says decode
    with pytest.raises(ResultFormatError) as info:
        results.load_suite("prefill", tmp_path)
    assert info.value.field == "suite"


def test_write_refuses_invalid(tmp_path):
    with pytest.raises(ResultFormatError, match="records\\[0\\].value"):
        results.write_suite("decode", [{"case": {}, "metric": "m", "value": None, "unit": ""}],
                            gpu="g", command="c", root=tmp_path)
    assert not (tmp_path / "decode.json").exists()
    with pytest.raises(ValueError, match="bad suite name"):
        results.suite_path("../escape", tmp_path)


def test_filters():
    suite = results.parse_suite(good_suite())
    assert len(suite.select("bw_fraction")) == 2
    assert len(suite.select(["bw_fraction", "latency_us"])) == 3
    assert [r.value for r in suite.select("bw_fraction", batch=64)] == [0.95]
    assert [r.value for r in suite.select(case={"kv_len": lambda k: k > 10000})] == [0.81]
    assert len(suite.select(batch=(1, 64))) == 3
    assert suite.select(page_size=16)[0].value == 0.81  # records without the key do not match
    assert suite.select(where=lambda r: "sdpa" in r.peers and r.value > 0.9)[0].value == 0.95
    assert results.peer_names(suite.records) == ["cudnn", "sdpa"]


def test_attention_shape():
    s = results.attention_shape({"batch": 4, "kv_len": 4096, "num_qo_heads": 32, "group": 4,
                                 "dtype": "torch.bfloat16"}, default_l_q=1)
    assert s == {"batch": 4, "l_q": 1, "l_kv": 4096, "num_qo_heads": 32, "num_kv_heads": 8,
                 "head_dim": 128, "bytes_per_elem": 2, "causal": False}
    s = results.attention_shape({"seq_len": 8192, "causal": True, "dtype": "fp8"})
    assert (s["l_q"], s["l_kv"], s["bytes_per_elem"], s["causal"]) == (8192, 8192, 1, True)
    assert results.attention_shape({"batch": 2}) is None
