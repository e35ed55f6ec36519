"""CUDA-event timing shared by the GPU benchmark scripts.

Two ways to time ``fn`` (which launches on torch's current stream):

* :func:`events_ms`: events around each call after ``warm`` calls; the
  median.  For work long enough that host launch gaps do not matter
  (prefill, SDPA peers).
* :func:`graph_ms`: ``fn`` called ``rep`` times inside one captured CUDA
  graph, events around each replay, the median per call.  Launch gaps
  vanish, so microsecond kernels (decode, cascade, merges) are timed as a
  serving loop would run them; if capture fails it says so and times plain
  launches instead (the second value is False then).

Scripts that also run as dry runs in numba's CUDA simulator (no GPU: tensors on
the CPU, kernels simulated) time with :func:`eager_ms` and measure the copy with
:func:`copy_bandwidth`, which take a ``dry`` flag: a dry run times one call with
the host clock, to check that the script works, not how fast anything is.
"""
from __future__ import annotations

import statistics
import time

import torch


def host_us(fn, reps: int = 200, warm: int = 5) -> float:
    """Median host microseconds of single calls (``perf_counter``, no synchronization)."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(statistics.median(times)) * 1e6


def events_ms(fn, reps: int, warm: int = 2) -> float:
    """Median milliseconds of single calls."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(statistics.median(times))


def back_to_back_ms(fn, reps: int, rounds: int = 5, warm: int = 3) -> float:
    """Median milliseconds per call of ``reps`` calls issued back to back (eager: the
    host may run ahead of the GPU), CUDA events around each round of ``rounds``."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return float(statistics.median(out))


def graph_ms(fn, iters: int = 15, rep: int = 10, graph: bool = True, log=print) -> tuple[float, bool]:
    """(median milliseconds per call, graphed).  ``graph=False`` times plain
    launches of ``rep`` calls (a graph's memcpy node can run on a copy engine,
    so copy baselines are timed both ways)."""
    fn()
    torch.cuda.synchronize()
    captured = None
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):     # warm the side stream capture will use
                fn()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                for _ in range(rep):
                    fn()
            captured.replay()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            log(f"graph capture failed, timing plain launches: {exc!r}"[:200])
            captured = None
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if captured is not None:
            captured.replay()
        else:
            for _ in range(rep):
                fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / rep)
    return statistics.median(times), captured is not None


def eager_ms(fn, reps: int, dry: bool = False) -> float:
    """:func:`back_to_back_ms` of ``reps`` calls; in a dry run one call, host clock."""
    if not dry:
        return back_to_back_ms(fn, reps)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def copy_bandwidth(dry: bool = False) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write), back-to-back plain
    launches; in a dry run 16 MiB on the CPU."""
    n = (16 << 20) if dry else (1 << 30)
    a = torch.empty(n // 4, dtype=torch.float32, device="cpu" if dry else "cuda").uniform_()
    b = torch.empty_like(a)
    return 2 * n / (eager_ms(lambda: b.copy_(a), 5, dry) * 1e-3) / 1e9
