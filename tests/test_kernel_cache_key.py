"""The on-disk kernel cache key (:func:`nbattn.cuda.host.driver.stable_key`) must tell
apart every kernel that computes something different, and must be the same for
the same kernel in a new process.

A key that misses a difference is a wrong answer on a GPU: the second kernel is
loaded from disk in place of its own compilation.  The key is computed the same
way in the simulator, so these run on CPU; the kernels are built, not launched.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import nbattn  # noqa: F401  (simulator choice)
from nbattn.cuda.host import driver as _driver
from nbattn.cuda import decode as DEC
from nbattn.cuda import prefill as P
from nbattn.variants import Variant


def _user_fn(src: str, name: str, **globals_):
    """A fresh function object named ``name`` defined by ``src`` in its own module
    namespace with ``globals_`` -- as a notebook redefines a cell's function."""
    ns = {"__name__": "__main__", **globals_}
    exec(textwrap.dedent(src), ns)
    return ns[name]


def _prefill_key(variant: Variant, kind: str = "f32", head_dim: int = 64) -> str:
    spec = P.make_spec("contig", "NHD", kind, head_dim, 4, 2, variant)
    key = _driver.stable_key(P.get_kernel(spec).py_func)
    assert key is not None, "a prefill kernel has no process-independent key (no on-disk cache)"
    return key


def _decode_key(variant: Variant) -> str:
    cfg = DEC.make_config("f32", 64, 2, "NHD", variant)
    key = _driver.stable_key(DEC.decode_kernel(cfg).py_func)
    assert key is not None, "a decode kernel has no process-independent key (no on-disk cache)"
    return key


TILT_A = "def tilt(score, b, h, q_idx, kv_idx):\n    return score - 0.05 * (q_idx - kv_idx)\n"
TILT_B = "def tilt(score, b, h, q_idx, kv_idx):\n    return score - 0.05 * h\n"
SCALED = "def tilt(score, b, h, q_idx, kv_idx):\n    return score - SLOPE * (q_idx - kv_idx)\n"
WIN = "def keep(b, h, q_idx, kv_idx):\n    return (q_idx - kv_idx <= W) | (kv_idx < 2)\n"


def _variant_pairs():
    """Pairs of variants that compute different things."""
    return {
        "score_mod: same name, other body": (Variant(causal=True, score_mod=_user_fn(TILT_A, "tilt")),
                                             Variant(causal=True, score_mod=_user_fn(TILT_B, "tilt"))),
        "score_mod: same body, other global": (
            Variant(causal=True, score_mod=_user_fn(SCALED, "tilt", SLOPE=0.05)),
            Variant(causal=True, score_mod=_user_fn(SCALED, "tilt", SLOPE=0.5))),
        "mask_mod: same body, other global": (Variant(causal=True, mask_mod=_user_fn(WIN, "keep", W=5)),
                                              Variant(causal=True, mask_mod=_user_fn(WIN, "keep", W=7))),
        "score_mod present or not": (Variant(causal=True),
                                     Variant(causal=True, score_mod=_user_fn(TILT_A, "tilt"))),
        "soft-cap value": (Variant(causal=True, logits_soft_cap=5.0), Variant(causal=True, logits_soft_cap=6.0)),
        "soft-cap vs window": (Variant(causal=True, logits_soft_cap=5.0),
                               Variant(causal=True, window_left=7, sink_size=2)),
        "window size": (Variant(window_left=7), Variant(window_left=8)),
        "sinks": (Variant(window_left=7, sink_size=1), Variant(window_left=7, sink_size=2)),
        "alibi": (Variant(causal=True), Variant(causal=True, pos_encoding_mode="ALIBI")),
        "sigmoid bias": (Variant(use_sigmoid=True, sigmoid_bias=0.0), Variant(use_sigmoid=True, sigmoid_bias=-1.0)),
    }


@pytest.mark.parametrize("name", list(_variant_pairs()))
def test_prefill_keys_differ(name):
    a, b = _variant_pairs()[name]
    assert _prefill_key(a) != _prefill_key(b), name


@pytest.mark.parametrize("name", ["score_mod: same name, other body", "soft-cap value", "window size",
                                  "score_mod: same body, other global"])
def test_decode_keys_differ(name):
    a, b = _variant_pairs()[name]
    assert _decode_key(a) != _decode_key(b), name


def test_decode_tuning_is_part_of_the_kernel_cache_keys():
    """A DecodeConfig carries the DecodeTuning it was made with: two tunings never share an
    in-process kernel, and what a kernel reads of its tuning is in its on-disk key (the
    tensor-core kernel's L2 prefetch steps; built here, not compiled)."""
    from nbattn.cuda.kernels.decode_common import DecodeConfig
    from nbattn.cuda.kernels.decode_tc import build_tc_kernel
    from nbattn.cuda.tuning import DECODE

    other = DECODE.replace(plan_chunk_overhead=50.0)
    a = DEC.make_config("f32", 64, 2, "NHD", Variant())
    b = DEC.make_config("f32", 64, 2, "NHD", Variant(), tuning=other)
    assert (a.tuning, b.tuning) == (DECODE, other) and a != b
    assert DEC.decode_kernel(a) is not DEC.decode_kernel(b)

    def tc_key(steps):
        cfg = DecodeConfig("f16", 128, 4, "NHD", Variant(), 256, 128, True, "tc", 1, 1,
                           DECODE.replace(prefetch_steps=steps))
        return _driver.stable_key(build_tc_kernel(cfg, 8, 1).py_func)

    assert tc_key(1) != tc_key(2)
    assert tc_key(1) == tc_key(1)


def test_prefill_tuning_is_part_of_the_kernel_cache_keys():
    """A KernelSpec carries its PrefillTuning: two tunings never share an in-process
    kernel, equal tunings do, and a field that changes the code the tile generates
    changes the on-disk key (a field that does not, leaves it)."""
    from nbattn.cuda.tuning import PREFILL

    def spec(tuning):
        return P.make_spec("contig", "NHD", "f32", 64, 4, 2, Variant(causal=True), tuning=tuning)

    unroll, order = PREFILL.replace(unroll=(2, 2)), PREFILL.replace(longest_first=False)
    assert spec(None).tuning == PREFILL and spec(unroll).tuning == unroll
    assert P.get_kernel(spec(unroll)) is not P.get_kernel(spec(None))
    assert P.get_kernel(spec(PREFILL.replace(unroll=(2, 2)))) is P.get_kernel(spec(unroll))
    key = lambda t: _driver.stable_key(P.get_kernel(spec(t)).py_func)      # noqa: E731
    prefetch = {key(PREFILL.replace(prefetch_max_chunks=n)) for n in (0, 64)}    # off / on for any shape
    assert key(unroll) != key(None) and len(prefetch) == 2 and key(None) in prefetch
    assert key(order) == key(None)          # the launch order only: the same kernel code


def test_redefined_identical_function_shares_the_key():
    """Same source and globals: the same kernel, so the cache may serve it."""
    a = Variant(causal=True, score_mod=_user_fn(SCALED, "tilt", SLOPE=0.05))
    b = Variant(causal=True, score_mod=_user_fn(SCALED, "tilt", SLOPE=0.05))
    assert a != b                      # two function objects: two in-process kernels
    assert _prefill_key(a) == _prefill_key(b)
    assert P.get_kernel(P.make_spec("contig", "NHD", "f32", 64, 4, 2, a)) is not \
        P.get_kernel(P.make_spec("contig", "NHD", "f32", 64, 4, 2, b))


def test_key_is_the_same_in_a_new_process():
    code = textwrap.dedent("""
        import nbattn
        from nbattn.cuda import prefill as P
        from nbattn.cuda.host import driver as _driver
        from nbattn.variants import Variant
        spec = P.make_spec("contig", "NHD", "f32", 64, 4, 2, Variant(causal=True, logits_soft_cap=5.0))
        print(_driver.stable_key(P.get_kernel(spec).py_func))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _prefill_key(Variant(causal=True, logits_soft_cap=5.0))
