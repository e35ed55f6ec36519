"""Where the decode wrapper's ``plan()`` and the plain decode call spend their host time
on a GPU machine, statement by statement, and what one driver call per copy costs
against one batched call.

    PYTHONPATH=$PWD python3 benchmarks/gpu_plan_host.py --commit SHA [--out FILE]

1. ``plan()`` of ``BatchDecodeWithPagedKVCacheWrapper`` at batch 1 / 64 / 1024 (lengths
   1..8191, page 16, 32/8 heads, head_dim 128, real copies into a torch workspace): the
   median host microseconds of each statement of its body (the body is re-executed with
   a clock read after every statement; 400 calls after 100), and the whole call.
2. The plain ``batch_decode_paged`` (torch CUDA tensors, NumPy page table) at b1 x 32k
   group 4 and 8 and b64 x 4k group 4, the same way (``decode_call.fast_decode``'s body,
   the statements inside its ``with`` block each timed).
3. The staging copies of a batch-64 plan alone, from the pinned image to the workspace:
   one ``cuMemcpyHtoDAsync`` per span (what ``plan()`` does) against one
   ``cuMemcpyBatchAsync`` (CUDA 12.8+) for all of them, checked by reading the words back,
   both on a stream of their own (the batched call refuses the legacy default stream;
   ``batched_error_on_current_stream`` records its answer there).

Prints and writes one JSON object.  Runs only on a GPU.
"""
from __future__ import annotations

import argparse
import ast
import collections
import ctypes
import inspect
import json
import os
import sys
import textwrap
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import host_us  # noqa: E402


def timed_body(obj, name: str, module) -> tuple:
    """``obj.name`` (a class's method or a module's function) re-compiled with a clock
    read after each statement, the statements inside ``with`` blocks included; returns
    (function, source lines, list the reads go to)."""
    src = textwrap.dedent(inspect.getsource(getattr(obj, name)))
    tree = ast.parse(src)
    fn = tree.body[0]
    reads: list = []

    def clocked(stmts):
        out = []
        for st in stmts:
            if isinstance(st, ast.With):
                st.body = clocked(st.body)
            out += [st, ast.parse(f"_READS.append(({st.lineno}, _clock()))").body[0]]
        return out
    fn.body = [ast.parse("_READS.append((0, _clock()))").body[0]] + clocked(fn.body)
    fn.decorator_list = []
    ast.fix_missing_locations(tree)
    env = dict(vars(module), _READS=reads, _clock=time.perf_counter)
    exec(compile(tree, f"<timed {name}>", "exec"), env)
    return env[name], src.splitlines(), reads


def per_statement(fn, args, lines, reads, n: int = 500, warm: int = 100) -> tuple:
    """Median microseconds of each statement of ``fn(*args)`` over ``n - warm`` calls
    (the stream drained every 20 calls), as [[us, text], ...] largest first, and their sum."""
    import torch
    per = collections.defaultdict(list)
    for i in range(n):
        reads.clear()
        fn(*args)
        if i % 20 == 19:
            torch.cuda.synchronize()
        if i >= warm:
            for (_, t0), (line, t1) in zip(reads, reads[1:]):
                per[line].append(t1 - t0)
    rows = sorted(((float(np.median(v)) * 1e6, lines[ln - 1].strip()[:90]) for ln, v in per.items()), reverse=True)
    torch.cuda.synchronize()
    return [[round(us, 2), text] for us, text in rows if us >= 0.3], sum(us for us, _ in rows)


def plain_lines(batch: int, kv_len: int, hkv: int, rng) -> dict:
    """The plain ``batch_decode_paged`` call (torch CUDA tensors, NumPy page table) statement
    by statement: ``decode_call.fast_decode``'s body."""
    import torch
    import nbattn.cuda as NC
    import nbattn.cuda.decode_call as DC
    from nbattn import layout as L
    pkv = L.PagedKV.allocate(np.full(batch, kv_len), 16, rng=rng)
    cache = torch.randn((pkv.num_pages, 2, 16, hkv, 128), dtype=torch.float16, device="cuda")
    q = torch.randn((batch, 32, 128), dtype=torch.float16, device="cuda")
    meta = (pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len)
    whole = host_us(lambda: NC.batch_decode_paged(q, cache, *meta), 400, 100)
    fn, lines, reads = timed_body(DC, "fast_decode", DC)
    args = (q, cache, *meta)
    kw = dict(kv_layout="NHD", return_lse=False, out=None, lse=None, variant={})
    rows, total = per_statement(lambda *a: fn(*a, **kw), args, lines, reads)
    return {"plain_us": whole, "statements_us": rows, "sum_of_statements_us": total}


def plan_lines(batch: int, rng) -> dict:
    import torch
    import nbattn.cuda as NC
    import nbattn.cuda.decode_wrapper as DW
    from nbattn import layout as L
    pkv = L.PagedKV.allocate(rng.integers(1, 8192, size=batch), 16, rng=rng)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = NC.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    args = (pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len, 32, 8, 128, 16)
    whole = host_us(lambda: w.plan(*args), 400, 100)
    fn, lines, reads = timed_body(DW.BatchDecodeWithPagedKVCacheWrapper, "plan", DW)
    rows, total = per_statement(fn, (w, *args), lines, reads)
    return {"plan_us": whole, "num_items": int(w.last_plan.num_items), "num_ctas": int(w.last_plan.num_ctas),
            "statements_us": rows, "sum_of_statements_us": total}


def batched_copies(rng) -> dict:
    """Per-span copies against one batched call, over the spans of a batch-64 plan."""
    import torch
    from numba import cuda
    import nbattn.cuda as NC
    from nbattn import layout as L
    from nbattn.cuda.host.driver import stream_handle
    pkv = L.PagedKV.allocate(rng.integers(1, 8192, size=64), 16, rng=rng)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = NC.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    spans = []
    real = w._h2d.copy
    w._h2d.copy = lambda dst, a, b, stream, ptr=None: spans.append((a, b))
    w.plan(pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len, 32, 8, 128, 16)
    w._h2d.copy = real
    n_words = max(b for _, b in spans)
    host = cuda.pinned_array(n_words, np.int32)
    host[:] = rng.integers(-2**31, 2**31 - 1, n_words, dtype=np.int64).astype(np.int32)
    dev = torch.zeros(n_words, dtype=torch.int32, device="cuda")
    hp, dp = host.ctypes.data, dev.data_ptr()
    # a stream of its own: the batched copy refuses the legacy default stream (torch's
    # current stream unless the caller set another; CUDA_ERROR_INVALID_VALUE there at 5a4b675)
    default_stream = stream_handle(dev)
    side = torch.cuda.Stream()
    stream = side.cuda_stream
    lib = ctypes.CDLL("libcuda.so.1")
    one = lib.cuMemcpyHtoDAsync_v2
    one.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    one.restype = ctypes.c_int

    def per_span():
        for a, b in spans:
            one(dp + 4 * a, hp + 4 * a, 4 * (b - a), stream)

    out = {"spans": len(spans), "words": int(sum(b - a for a, b in spans)),
           "per_span_us": host_us(per_span, 2000, 100)}
    torch.cuda.synchronize()

    class Loc(ctypes.Structure):         # CUmemLocation
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class Attrs(ctypes.Structure):       # CUmemcpyAttributes
        _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", Loc), ("dstLocHint", Loc),
                    ("flags", ctypes.c_uint)]
    batch = getattr(lib, "cuMemcpyBatchAsync_v2", None)       # CUDA 13: no failIdx argument
    if batch is None:
        out["batched"] = "cuMemcpyBatchAsync_v2 not in libcuda"
        return out
    u64p, szp = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
    batch.argtypes = [u64p, u64p, szp, ctypes.c_size_t, ctypes.POINTER(Attrs), szp, ctypes.c_size_t,
                      ctypes.c_void_p]
    batch.restype = ctypes.c_int
    k = len(spans)
    dsts = (ctypes.c_uint64 * k)(*[dp + 4 * a for a, _ in spans])
    srcs = (ctypes.c_uint64 * k)(*[hp + 4 * a for a, _ in spans])
    sizes = (ctypes.c_size_t * k)(*[4 * (b - a) for a, b in spans])
    attrs = Attrs(1, Loc(0, 0), Loc(0, 0), 0)       # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    idx = (ctypes.c_size_t * 1)(0)
    dev.zero_()
    torch.cuda.synchronize()
    out["batched_error_on_current_stream"] = int(batch(dsts, srcs, sizes, k, ctypes.byref(attrs), idx, 1,
                                                       default_stream))
    torch.cuda.synchronize()
    dev.zero_()
    torch.cuda.synchronize()
    err = batch(dsts, srcs, sizes, k, ctypes.byref(attrs), idx, 1, stream)
    torch.cuda.synchronize()
    got = dev.cpu().numpy()
    same = all(np.array_equal(got[a:b], host[a:b]) for a, b in spans)
    out.update(batched_error=int(err), batched_words_equal=bool(same))
    if err == 0 and same:
        def batched():
            batch(dsts, srcs, sizes, k, ctypes.byref(attrs), idx, 1, stream)

        def rebuilt():           # the arrays filled per call, as plan() would
            d = (ctypes.c_uint64 * k)(*[dp + 4 * a for a, _ in spans])
            s = (ctypes.c_uint64 * k)(*[hp + 4 * a for a, _ in spans])
            z = (ctypes.c_size_t * k)(*[4 * (b - a) for a, b in spans])
            batch(d, s, z, k, ctypes.byref(attrs), idx, 1, stream)
        out["batched_us"] = host_us(batched, 2000, 100)
        out["batched_with_arrays_us"] = host_us(rebuilt, 2000, 100)
        out["per_span_again_us"] = host_us(per_span, 2000, 100)
    torch.cuda.synchronize()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    rng = np.random.default_rng(5)
    res = {"commit": args.commit, "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "command": "PYTHONPATH=$PWD python3 benchmarks/gpu_plan_host.py --commit " + args.commit,
           "plan": {}}
    for batch in (1, 64, 1024):
        res["plan"][f"b{batch}"] = plan_lines(batch, rng)
        print(f"b{batch}", json.dumps(res["plan"][f"b{batch}"])[:1500], flush=True)
    res["plain"] = {}
    for batch, kv_len, hkv in ((1, 32768, 8), (1, 32768, 4), (64, 4096, 8)):
        key = f"b{batch}x{kv_len}_g{32 // hkv}"
        res["plain"][key] = plain_lines(batch, kv_len, hkv, rng)
        print("plain", key, json.dumps(res["plain"][key])[:1500], flush=True)
    res["copies"] = batched_copies(rng)
    print("copies", json.dumps(res["copies"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
