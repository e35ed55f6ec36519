"""The GPU benchmarks' timing helpers (benchmarks/_timing.py), run here against a
fake torch.cuda: what they count, the median they return, and the fallback to
plain launches when a graph cannot be captured."""
import importlib.util
import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "_timing.py"


class FakeCuda:
    """Events read a clock that advances 1 ms per fn() call (plus the given extra)."""

    def __init__(self, capture_ok: bool):
        self.now = 0.0
        self.capture_ok = capture_ok
        self.graph_calls = 0
        cuda = self

        class Event:
            def __init__(self, enable_timing=True):
                self.t = None

            def record(self):
                self.t = cuda.now

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return other.t - self.t

        class Graph:
            def __init__(self):
                self.fns = []
                if not cuda.capture_ok:
                    raise RuntimeError("capture not supported")

            def replay(self):
                cuda.graph_calls += 1
                cuda.now += 0.5 * 10        # a graph of rep=10 calls runs at 0.5 ms a call

        class _Ctx:
            def __init__(self, *a):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

        self.Event, self.CUDAGraph = Event, Graph
        self.Stream = lambda: SimpleNamespace(wait_stream=lambda s: None)
        self.current_stream = lambda: SimpleNamespace(wait_stream=lambda s: None)
        self.stream = _Ctx
        self.graph = _Ctx
        self.synchronize = lambda: None


def load(monkeypatch, capture_ok):
    spec = importlib.util.spec_from_file_location("_timing_under_test", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fake = FakeCuda(capture_ok)
    monkeypatch.setattr(mod, "torch", SimpleNamespace(cuda=fake))
    return mod, fake


def test_events_ms_is_the_median_of_single_calls(monkeypatch):
    mod, fake = load(monkeypatch, True)
    costs = itertools.cycle([1.0, 9.0, 2.0])       # ms per call: median 2 over 3 reps
    calls = []

    def fn():
        calls.append(1)
        fake.now += next(costs)
    ms = mod.events_ms(fn, reps=3, warm=0)
    assert ms == 2.0 and len(calls) == 3
    mod.events_ms(fn, reps=3, warm=2)
    assert len(calls) == 3 + 5


def test_graph_ms_replays_the_graph(monkeypatch):
    mod, fake = load(monkeypatch, True)
    ms, graphed = mod.graph_ms(lambda: None, iters=4, rep=10)
    assert graphed and ms == pytest.approx(0.5)
    assert fake.graph_calls == 1 + 4                 # one check replay after capture, then iters


def test_graph_ms_falls_back_to_plain_launches(monkeypatch):
    mod, fake = load(monkeypatch, False)
    said = []

    def fn():
        fake.now += 2.0
    ms, graphed = mod.graph_ms(fn, iters=3, rep=4, log=said.append)
    assert not graphed and ms == pytest.approx(2.0)
    assert said and "plain launches" in said[0]
    ms, graphed = mod.graph_ms(fn, iters=3, rep=4, graph=False, log=said.append)
    assert not graphed and len(said) == 1            # asked for plain launches: nothing to report


def test_back_to_back_ms_is_the_median_round_per_call(monkeypatch):
    """Rounds of ``reps`` calls issued back to back: each round's time over reps, the
    median round kept; the warm-up calls are not timed."""
    mod, fake = load(monkeypatch, True)
    rounds = iter([0.0] * 3 + [1.0] * 4 + [5.0] * 4 + [2.0] * 4)   # warm-up, then per-call ms by round
    calls = []

    def fn():
        calls.append(1)
        fake.now += next(rounds)
    ms = mod.back_to_back_ms(fn, reps=4, rounds=3, warm=3)
    assert ms == pytest.approx(2.0) and len(calls) == 3 + 12
