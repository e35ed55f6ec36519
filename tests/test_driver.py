"""nbattn.cuda.host.driver: the on-disk kernel cache key (stable_key).

numba's own cache key pickles a kernel's closure, and nbattn's factory-made
kernels close over device functions whose pickles differ per process, so the
cache never hit in a new process.  These tests pin what the replacement key
must do; that a second process then loads instead of compiling is measured on
the GPU (benchmarks/results/experiments/decode_extras.json).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import nbattn  # noqa: F401  (compat first)
from nbattn.cuda.host import driver as D
from nbattn.cuda.host import staging as S
from nbattn.cuda import decode as DEC
from nbattn.cuda import merge as M
from nbattn.variants import Variant

KEYS = textwrap.dedent("""
    import nbattn
    from nbattn.cuda import decode as DEC
    from nbattn.cuda.host import driver as D
    from nbattn.variants import Variant
    for code, d, g, var in (("f16", 128, 4, Variant()), ("bf16", 64, 8, Variant(logits_soft_cap=30.0)),
                            ("f32", 32, 1, Variant(score_mod=lambda s, b, h, q, k: s + 0.5 * (q - k)))):
        print(D.stable_key(DEC.decode_kernel(DEC.make_config(code, d, g, "NHD", var)).py_func))
""")


def _keys_in_new_process():
    out = subprocess.run([sys.executable, "-c", KEYS], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_key_is_the_same_in_every_process_and_differs_per_build():
    first, second = _keys_in_new_process(), _keys_in_new_process()
    assert first == second and len(first) == 3
    assert len(set(first)) == 3 and all(len(k) == 64 for k in first)


def test_key_follows_closure_values_and_code():
    def factory(scale, fn):
        def kernel(x):
            return fn(x) * scale
        return kernel

    def twice(x):
        return 2 * x

    def thrice(x):
        return 3 * x

    a = D.stable_key(factory(1.5, twice))
    assert a == D.stable_key(factory(1.5, twice))
    assert a != D.stable_key(factory(2.5, twice))          # a constant in the closure
    assert a != D.stable_key(factory(1.5, thrice))         # a function in the closure
    assert a != D.stable_key(factory(np.float32(1.5), twice))   # the type of a constant


def test_key_refuses_what_it_cannot_describe():
    class Opaque:
        pass

    blob = Opaque()

    def kernel(x):
        return blob

    assert D.stable_key(kernel) is None
    # real kernels of the package all have a key
    assert D.stable_key(M.tile_merge_kernel("f16", 64, False).py_func) is not None
    assert D.stable_key(DEC.decode_kernel(DEC.make_config("f16", 64, 2, "HND", Variant())).py_func)


def test_launch_bounds_are_part_of_the_cache_key():
    """Two builds of one function that differ only in launch bounds compile to
    different machine code, so they must not share an on-disk cache entry."""
    def kernel(x):
        x[0] = 1.0

    plain = D.cache_key(kernel)
    assert plain == D.stable_key(kernel) and plain is not None
    two, three = D.cache_key(kernel, launch_bounds=(128, 2)), D.cache_key(kernel, launch_bounds=(128, 3))
    assert len({plain, two, three}) == 3
    assert two == D.cache_key(kernel, launch_bounds=(128, 2))


@pytest.mark.skipif(not D.SIMULATOR, reason="the simulator's answer")
def test_programmatic_launch_declines_in_the_simulator():
    """No GPU, no programmatic launch: the helper says so and launches nothing, so
    the caller's plain launch is the only one."""
    calls = []

    class Fake:
        def __getitem__(self, cfg):
            calls.append(cfg)
            return lambda *a: calls.append(a)

    assert D.launch_programmatic(Fake(), 1, 32, 0, (np.zeros(1),)) is False
    assert calls == []


def test_staging_ring_never_hands_out_a_slot_in_flight(monkeypatch):
    """A slot whose kernels may still run is not reused: the ring grows up to its
    bound, then waits for the slots in turn (the simulator's events are always
    done, so 'in flight' is faked here)."""
    in_flight: set = set()
    waited: list = []
    monkeypatch.setattr(S.Staged, "busy", lambda self: id(self) in in_flight)
    monkeypatch.setattr(S.HostToDevice, "begin", lambda self: waited.append(id(self)))
    ring = S.StagingRing(most=3)
    a = ring.take(10)
    assert ring.take(10) is a                        # idle: reused
    in_flight.add(id(a))
    b = ring.take(10)
    in_flight.add(id(b))
    c = ring.take(10 ** 5)                           # bigger than the others: a slot of its own size
    assert len({id(a), id(b), id(c)}) == 3 and c.host.host.size >= 10 ** 5
    in_flight.add(id(c))
    d = ring.take(10)                                # all three in flight: wait for the first
    assert d is a and waited == [id(a.host)]
    e = ring.take(10 ** 6)                           # the next in turn is too small: replaced after the wait
    assert waited[-1] == id(b.host) and e is not b and e.host.host.size >= 10 ** 6
    # the staged words reach the device array
    e.host.host[:4] = [7, 8, 9, 10]
    e.send(4, 0)
    assert list(e.dev[:4].copy_to_host()) == [7, 8, 9, 10]


def test_staging_ring_asks_the_oldest_slot_first(monkeypatch):
    """In a loop of calls that runs ahead of the GPU, the slot taken longest ago is
    the one asked first, so a call makes one event query, not one per slot."""
    in_flight: set = set()
    asked: list = []

    def busy(self):
        asked.append(id(self))
        return id(self) in in_flight
    monkeypatch.setattr(S.Staged, "busy", busy)
    ring = S.StagingRing(most=4)
    slots = []
    for _ in range(4):                      # four calls in flight: four slots
        s = ring.take(10)
        in_flight.add(id(s))
        slots.append(s)
    for k in range(8):                      # then the oldest call's kernels finish each time
        in_flight.discard(id(slots[k % 4]))
        asked.clear()
        s = ring.take(10)
        assert s is slots[k % 4] and asked == [id(s)]
        in_flight.add(id(s))


def test_staging_ring_stage_packs_each_array_where_its_span_says():
    """stage() sends int arrays as int32 and a float32 array as its bits, each at a
    16-byte aligned offset, and each span reads back its own array."""
    rng = np.random.default_rng()
    ring = S.StagingRing(most=2)
    arrays = [rng.integers(-50, 50, size=5).astype(np.int64), np.zeros(0, np.int32),
              rng.integers(0, 9, size=(3, 8)).astype(np.int32), rng.standard_normal(7).astype(np.float32)]
    slot, spans = ring.stage(arrays, 0)
    assert [sp.off % 4 for sp in spans] == [0] * 4 and len({sp.off for sp in spans}) == 4
    for a, sp in zip(arrays, spans):
        got = sp.view().copy_to_host()
        if a.size:
            np.testing.assert_array_equal(got.reshape(a.shape), a.astype(got.dtype))
            assert got.dtype == (np.float32 if a.dtype == np.float32 else np.int32)


def test_cpu_helpers_cache_under_the_package_digest(tmp_path):
    """Every on-disk-cached CPU helper of the package goes through njit_cached, whose
    index key carries the package digest: a callee edited in another module
    (numba inlines it) cannot leave a caller's cached code running the old one. The
    digest follows any file's content."""
    import pathlib
    import re

    import importlib

    from nbattn import _jit as J
    PL = importlib.import_module("nbattn.sched.plan")

    pkg = pathlib.Path(J.__file__).parent
    plain = [str(p.relative_to(pkg)) for p in pkg.rglob("*.py")
             if p.name != "_jit.py" and re.search(r"njit\([^)]*cache\s*=\s*True", p.read_text())]
    assert plain == [], plain
    cache = PL._plan_core._cache
    assert isinstance(cache, J._PackageCache)
    from numba.core.registry import cpu_target
    key = cache._index_key((), cpu_target.target_context.codegen())
    assert key[-1] == ("nbattn", J.package_digest())
    # the digest over a copy of the package changes with one byte of one file
    copy = tmp_path / "pkg"
    import shutil
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__"))
    original = J.package_digest()
    saved = (J._PACKAGE, J._DIGEST)
    try:
        J._PACKAGE, J._DIGEST = copy, []
        before = J.package_digest()
        assert before == original          # same paths, same bytes
        f = copy / "sched" / "lpt.py"
        f.write_text(f.read_text() + "\n# an edit\n")
        J._DIGEST = []
        assert J.package_digest() != before
    finally:
        J._PACKAGE, J._DIGEST = saved
