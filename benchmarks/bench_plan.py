"""CPU benchmark of the scheduler (docs/concepts/scheduler.md): plan time and simulated policies.

    .venv/bin/python benchmarks/bench_plan.py [--runs 2000] [--root benchmarks/results]

1. Times :func:`nbattn.sched.plan` for 1024 requests (C = 132 CTAs, the SM
   count of an H100/H200) after a warm-up, reporting the median of many runs.
   Budget: < 200 us.  Each case is timed twice: the plain ``L = ceil(W/C)`` rule,
   and the decode wrapper's (per-item price, ``chunk_limit="auto"``).  The break-even rule,
   ``L*(u - v) > p + h``, turns the plan cost ``p`` into the per-layer gain a
   plan must buy: with ``L = 32`` layers and ``h = 0`` that is ``p / 32``.
2. Simulates every policy on every workload of :mod:`nbattn.sched.simulate`
   (decode, batch 64, C = 132, default cost model) and records utilization,
   makespan and makespan over the lower bound.

Writes ``benchmarks/results/sched_cpu.json`` (format of
:mod:`nbattn.perf.results`).
"""
from __future__ import annotations

import argparse
import itertools
import platform
import sys
import time
from dataclasses import asdict

import numba
import numpy as np

from nbattn.cuda.tuning import DECODE
from nbattn.perf.results import write_suite
from nbattn.sched import POLICIES, WORKLOADS, CostModel, compare_policies, make_workload, plan

NUM_CTAS = 132
BATCH = 1024
SIM_BATCH = 64
LAYERS = 32


def time_plan(qo_lens, kv_lens, num_ctas, group, runs, warmup=50, **kw):
    """Median and minimum wall time of one plan() call, in microseconds."""
    for _ in range(warmup):
        plan(qo_lens, kv_lens, num_ctas, group=group, **kw)
    samples = np.empty(runs)
    for i in range(runs):
        t0 = time.perf_counter_ns()
        plan(qo_lens, kv_lens, num_ctas, group=group, **kw)
        samples[i] = time.perf_counter_ns() - t0
    return float(np.median(samples)) / 1e3, float(samples.min()) / 1e3


def plan_records(runs):
    records = []
    cases = [
        # (workload, qo_len, group): decode MHA, decode GQA (Llama-3 8B: 32/8),
        # the heavy-tailed mix, and one 128k request among 1023 short ones (the
        # only case here where a tile is split, exercising the partial slots).
        ("variable", 1, 1),
        ("variable", 1, 4),
        ("zipf", 1, 1),
        ("skewed", 1, 1),
    ]
    # "spec": the plain ``L = ceil(W/C)`` rule exactly; "auto": what the decode wrapper asks for
    # (a per-item price and the chunk-limit search, several LPT passes).
    rules = {"spec": {}, "auto": dict(chunk_overhead=DECODE.plan_chunk_overhead, chunk_limit="auto")}
    for (name, qo_len, group), (rule, kw) in itertools.product(cases, rules.items()):
        w = make_workload(name, BATCH, seed=0, qo_len=qo_len, group=group, long_len=131072)
        median_us, min_us = time_plan(w.qo_lens, w.kv_lens, NUM_CTAS, group, runs, **kw)
        p = plan(w.qo_lens, w.kv_lens, NUM_CTAS, group=group, **kw)
        case = {"workload": name, "batch": BATCH, "qo_len": qo_len, "group": group,
                "num_ctas": NUM_CTAS, "tile_q": p.tile_q, "num_items": p.num_items,
                "num_partials": p.num_partials, "runs": runs, "chunk_rule": rule}
        if name == "skewed":
            case.update(long_len=131072, short_len=512)
        print(f"plan {name:8s} {rule:4s} batch={BATCH} group={group} C={NUM_CTAS}: median "
              f"{median_us:7.1f} us, min {min_us:7.1f} us ({p.num_items} items, "
              f"{p.num_partials} partials, tile_q={p.tile_q})")
        records.append({"case": case, "metric": "plan_us", "value": median_us, "unit": "us",
                        "peers": {}})
        records.append({"case": case, "metric": "plan_us_min", "value": min_us, "unit": "us",
                        "peers": {}})
        records.append({"case": dict(case, layers=LAYERS, h_us=0.0),
                        "metric": "break_even_gain_per_layer_us",
                        "value": median_us / LAYERS, "unit": "us", "peers": {}})
    return records


def sim_records():
    cost = CostModel()
    workloads = [make_workload(name, SIM_BATCH, seed=0) for name in WORKLOADS]
    records = []
    print(f"\nsimulated decode, batch {SIM_BATCH}, C={NUM_CTAS}, cost model {asdict(cost)}")
    print(f"{'workload':10s} {'policy':12s} {'util':>6s} {'makespan':>10s} {'/bound':>7s}")
    for r in compare_policies(workloads, NUM_CTAS, policies=POLICIES, cost=cost):
        case = {"workload": r.workload, "policy": r.policy, "batch": SIM_BATCH,
                "num_ctas": NUM_CTAS, "tile_q": r.tile_q, "num_chunks": r.num_chunks,
                "num_partials": r.num_partials, **{f"cost_{k}": v for k, v in asdict(cost).items()}}
        print(f"{r.workload:10s} {r.policy:12s} {r.utilization:6.3f} {r.makespan:10.0f} "
              f"{r.makespan_over_bound:7.2f}")
        for metric, value, unit in (
            ("sim_utilization", r.utilization, "ratio"),
            ("sim_makespan", r.makespan, "cost units"),
            ("sim_lower_bound", r.lower_bound, "cost units"),
            ("sim_makespan_over_bound", r.makespan_over_bound, "ratio"),
        ):
            records.append({"case": case, "metric": metric, "value": float(value), "unit": unit,
                            "peers": {}})
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000, help="timed plan() calls per case")
    parser.add_argument("--root", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args(argv)

    records = plan_records(args.runs) + sim_records()
    versions = {"python": platform.python_version(), "numpy": np.__version__,
                "numba": numba.__version__, "cpu": platform.processor() or platform.machine()}
    command = "python benchmarks/bench_plan.py" + (f" --runs {args.runs}" if args.runs != 2000 else "")
    path = write_suite("sched_cpu", records, gpu="none (CPU)", command=command,
                       versions=versions, copy_bandwidth_GBps=None, root=args.root)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
