"""Batch-1 split decode on the GPU, taken apart: where the microseconds go.

    PYTHONPATH=$PWD python3 benchmarks/gpu_decode_b1.py [--out DIR] [--toggle FIELD=V1,V2]
                                                  (writes DIR/decode_b1.json; DIR defaults to $OUT)

Shape of issue 3's batch-1 target: 1 x 32k keys, fp16, head_dim 128, 32 query
heads, 8 or 4 KV heads, page size 16, the default path and chunk
(``decode.choose_chunk``).  All times are CUDA-graph replays (``_timing.graph_ms``)
in one process, beside the device copy bandwidth measured first:

* ``total``: decode kernel + merge launch, as ``batch_decode_paged`` runs them:
  the decode kernel launched programmatically (``DecodeTuning.programmatic``:
  its CTAs start while the previous call's merge ends and read their work items
  before they wait) with the one-round merge launched programmatically
  (``MergeTuning.few_programmatic``: it starts during the decode kernel and waits for
  its partials); then the decode launched plainly with that merge, launched
  plainly, and with the two-pass merge;
* ``kernel``: the decode kernel alone (partials written, no merge), launched
  programmatically and plainly;
* ``merge``: each merge form alone, over the partials the kernel wrote.

Each total's output is poisoned first and checked fully written; the
outputs of the merge forms are compared with each other and the last one
with torch math on the same pages.

``--toggle FIELD=V1,V2,...`` runs everything once per value of a
:class:`~nbattn.cuda.tuning.DecodeTuning` field (tuples as ``AxB``, e.g.
``tc_split_shape=8x1,4x2``; ``--toggle FIELD`` alone: a boolean field on, then
off), groups 4 and 8, in one process; each record names the value under the
field's name.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
from numba import cuda

sys.path.insert(0, os.path.dirname(__file__))
import gpu_decode as G  # noqa: E402  (copy bandwidth, inputs, timing, dense check)
from nbattn.cuda import decode as DEC  # noqa: E402
from nbattn.cuda import merge as MRG  # noqa: E402
from nbattn.cuda.tuning import DECODE  # noqa: E402


def on_torch_stream(p, fn):
    def run():
        p.stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        fn()
    return run


def case(hkv: int, copy_bw: float, tuning=DECODE) -> list:
    hq, d, ps, L = 32, 128, 16, 32768
    q, cache, indptr, indices, last = G.make_case_fast(np.array([L]), ps, hkv, d)
    meta = [torch.from_numpy(a).cuda() for a in (indptr, indices, last)]
    nbytes = 2 * d * (hq * 2 + 2 * L * hkv)
    p = DEC.prepare_decode(q, cache, *meta, return_lse=True, tuning=tuning)
    chunk = DEC.choose_chunk(p)
    cfg = p.config()
    (cta_indptr, req, ks, ke, slot, m_indptr, m_row, m_slots, n_slots) = DEC.split_work(p.kv_lens, chunk)
    work = DEC.WorkList(*DEC.upload_int32(p.stream, cta_indptr, req, ks, ke, slot))
    po = cuda.device_array((n_slots, hq, d), np.float32)
    pl = cuda.device_array((n_slots, hq), np.float32)
    mmap = MRG.MergeMap(*DEC.upload_int32(p.stream, m_indptr, m_row, m_slots))
    most = int(np.diff(m_indptr).max())
    base = dict(batch=1, kv_len=L, num_qo_heads=hq, num_kv_heads=hkv, group=hq // hkv, head_dim=d,
                page_size=ps, dtype="f16", path=cfg.path, kv_chunk=chunk, partials=most,
                warps=cfg.nthreads // 32, min_blocks=cfg.min_blocks)
    recs, outs = [], {}

    def timed(part, fn, **extra):
        ms, graphed = G.bench(on_torch_stream(p, fn))
        us = ms * 1e3
        frac = nbytes / (ms * 1e-3) / 1e9 / copy_bw
        recs.append(dict(case=dict(base, part=part, **extra), metric="latency_us", value=us, unit="us",
                         peers={}, graphed=graphed, bw_fraction=frac))
        G.log(f"hkv={hkv} {part:22s} {us:7.2f} us  ({frac:.3f} of copy bw) chunk {chunk} partials {most}")
        return us

    forms = (("one_round_programmatic", True, True), ("one_round", True, False), ("two_pass", False, False))

    def use(form):
        return tuning.merge.replace(few_form=form[1], few_programmatic=form[2])

    for form, pdl in [(forms[0], True)] + [(f, False) for f in forms]:
        p.tuning = tuning.replace(programmatic=pdl, merge=use(form))
        run = DEC.split_runner(p, chunk)
        timed("total", run, merge=form[0], decode_programmatic=pdl)
        p.out_user.fill_(float("nan"))          # poisoned: the checks below see every element written
        on_torch_stream(p, run)()
        torch.cuda.synchronize()
        outs[form[0] + ("_pdl" if pdl else "")] = p.out_user.float().clone()
    p.tuning = tuning
    err = G.dense_check(p, q, cache, indptr, indices, 1, L, hkv, ps, d, rows=1)
    diffs = {f"{k}_vs_two_pass_max_abs_diff": float((v - outs["two_pass"]).abs().max()) for k, v in outs.items()}
    written = {f"{k}_all_written": bool(torch.isfinite(v).all()) for k, v in outs.items()}
    recs.append(dict(case=dict(base, part="check"), metric="max_abs_err_vs_torch", value=err, unit="",
                     peers={}, **diffs, **written))
    G.log(f"hkv={hkv} check: max|err| vs torch {err:.2e} (last run: two-pass), {diffs}, {written}")
    for pdl in (True, False):
        timed("kernel", lambda pdl=pdl: DEC.run_decode_work(p, work, po, pl, pdl), decode_programmatic=pdl)
    for form in forms:
        timed("merge", lambda mt=use(form): MRG.run_merge_partials(po, pl, mmap, p.out_dev, p.lse_dev, code=p.code,
                                                                   max_partials=most, stream=p.stream,
                                                                   tuning=mt), merge=form[0])
    return recs


def parse_toggle(text: str):
    """``FIELD=V1,V2`` (or ``FIELD``: True, then False) as (field, [tunings' values])."""
    name, _, values = text.partition("=")
    default = getattr(DECODE, name)           # an unknown field fails here

    def parse(v):
        if isinstance(default, tuple):
            return tuple(int(x) for x in v.split("x"))
        if isinstance(default, bool):
            return v.lower() in ("1", "true", "on", "yes")
        return type(default)(v)
    return name, [parse(v) for v in values.split(",")] if values else [True, False]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--toggle", default="", help="FIELD=V1,V2,...: a DecodeTuning field, value by value")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bw = G.copy_bandwidth()
    copy_bw = max(bw.values())
    G.log("copy bandwidth GB/s", {k: round(v) for k, v in bw.items()})
    recs = []
    if args.toggle:
        name, settings = parse_toggle(args.toggle)
        for hkv in (8, 4):
            for value in settings:
                for r in case(hkv, copy_bw, DECODE.replace(**{name: value})):
                    r["case"][name] = "x".join(map(str, value)) if isinstance(value, tuple) else value
                    recs.append(r)
    else:
        for hkv in (8, 4):
            recs += case(hkv, copy_bw)
    G.write_gpu_suite("decode_b1", recs, copy_bw, args.out, "gpu_decode_b1.py")


if __name__ == "__main__":
    main()
