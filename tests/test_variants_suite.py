"""benchmarks/gpu_variants.py as a dry run in the simulator: the script runs every
part and writes a valid suite, and it states each variant the same way for nbattn
and for FlexAttention (uncompiled here), since their outputs agree; the fused
RoPE decode agrees with rotating first and attending after.  Speed is measured
only on a GPU."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn.cuda.blocks.primitives import SIMULATOR

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not SIMULATOR, reason="the dry run is the simulator's; on a GPU run the script itself")
@pytest.mark.filterwarnings("ignore")
def test_the_variants_suite_runs_and_nbattn_and_flex_state_the_same_variants(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_variants", ROOT / "benchmarks" / "gpu_variants.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--commit", "test", "--out", str(tmp_path)]) == 0
    suite = json.loads((tmp_path / "variants.json").read_text())
    prefill = json.loads((tmp_path / "variants_prefill.json").read_text())
    assert {r["case"]["part"] for r in suite["records"]} == {"rope", "decode"}
    assert {r["case"]["part"] for r in prefill["records"]} == {"prefill"}
    assert (tmp_path / "variants.png").stat().st_size > 0
    recs = suite["records"] + prefill["records"]
    errs = [r for r in recs if r["metric"] == "max_abs_err"]
    compared = {(r["case"]["part"], r["case"].get("variant")) for r in errs}
    for part in ("decode", "prefill"):
        for name in mod.VARIANTS:
            if name != "sinks":
                assert (part, name) in compared, (part, name)
        assert any(r["case"]["part"] == part and r["case"].get("variant") == "sinks" and r["metric"] == "latency_us"
                   for r in recs)
    assert sum(r["case"]["part"] == "rope" for r in errs) == len(mod.ROPE_CASES) + 1      # + the prefill case
    assert {r["case"]["mode"] for r in recs if r["case"].get("op") == "prefill" and r["case"]["part"] == "rope"
            and r["metric"] == "latency_us"} == {"fused", "separate", "none"}
    for r in errs:                       # fp16 outputs: a few units in the last place
        assert r["value"] < 4e-3, r
    modes = {r["case"].get("mode") for r in recs if r["case"]["part"] == "rope"}
    assert {"fused", "separate", "none"} <= modes
    sys.modules.pop("gpu_variants", None)
