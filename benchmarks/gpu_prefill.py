"""Prefill, cascade and page-size benchmarks on the GPU, peers in the same run.

    PYTHONPATH=$PWD python3 benchmarks/gpu_prefill.py [cascade] [page1] [prefill_8k] [--commit SHA] [--out DIR]
    (writes --out, default $OUT or benchmarks/results; --commit names the tree measured)

Suites (result-file format, docs/gpu.md):
- prefill.json: batch 1 x 8k x 8k, 32 query / 8 KV heads, head_dim 128, fp16,
  causal and not: nbattn's tensor-core path beside torch SDPA (flash, cuDNN)
  and FlexAttention (compiled); TFLOP/s.  Page size 1 (and 16) vs contiguous
  KV at batch 1 x 32k (prefill TFLOP/s; decode bandwidth fraction with the
  default split decode path).  (The CUDA-core prefill path is measured by its
  own script.)
- cascade.json: shared-prefix decode, suffix 128, page 16, batch {16, 64} x
  prefix {1024, 32768}: cascade vs flat paged decode (the default
  nbattn.cuda.batch_decode_paged path, split as choose_chunk splits it); the
  cascade's prefix pass alone (TFLOP/s); a sweep of the prefix split size; other
  ``CascadeTuning`` values (``min_blocks_split``, ``decode_levels``) passed as
  ``tuning=``.

Every timing: CUDA events around the kernels only (host planning recorded
once, :class:`nbattn.cuda.prefill.recording`), after warm-up, median of many
runs; the short ones (cascade, decode) as CUDA-graph replays of 10 calls, so
host launch gaps are not counted on either side; first-call (compile) time
kept apart; outputs poisoned with NaN first and checked fully written and
close to a peer.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import numpy as np
import torch
from numba import cuda

import nbattn  # noqa: F401  (compat shim before numba.cuda kernels)
from nbattn import layout as L
from nbattn.cuda.cascade import cascade as cuda_cascade
from nbattn.cuda import prefill as P
from nbattn.cuda.host.driver import launch as launch_kernel
from nbattn.cuda.tuning import CASCADE

from _timing import events_ms, graph_ms  # noqa: E402  (benchmarks/ is the script's folder)

OUT = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")   # --out's default
COMMIT = "unknown"                                                                  # --commit
DEV = "cuda"


def torch_stream():
    """torch's current stream as a numba stream (inside a graph capture: the capture stream)."""
    return cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = events_ms(lambda: y.copy_(x), 20)
    return 2 * x.numel() / (ms * 1e-3) / 1e9


def prefill_flops(q_len: int, kv_len: int, heads: int, d: int, causal: bool) -> float:
    if causal:   # bottom-right: query i sees kv_len - q_len + i + 1 keys
        seen = q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2
    else:
        seen = q_len * kv_len
    return 4.0 * heads * d * seen


def ours(fn, *args, **kw):
    """(recording, result, first_call_s): record the launches of one call once."""
    torch.cuda.synchronize()
    t = time.time()
    res = fn(*args, **kw)               # first call: compiles
    torch.cuda.synchronize()
    first = time.time() - t
    with P.recording() as rec:
        res = fn(*args, **kw)
    rec.replay()
    torch.cuda.synchronize()
    return rec, res, first


def replay_fn(launches):
    """Launch recorded launches on torch's current stream (graph-capturable)."""
    def run():
        s = torch_stream()
        for kernel, grid, threads, args in launches:
            launch_kernel(kernel, grid, threads, s, args)     # passes a tile's dynamic shared memory
    return run


def poisoned(run, out) -> bool:
    """Fill the output with NaN, run, check every element was written."""
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    return bool(torch.isfinite(out).all())


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def record(recs, case, metric, value, unit, peers=None, **extra):
    r = {"case": case, "metric": metric, "value": float(value), "unit": unit, "peers": peers or {}}
    r.update(extra)
    recs.append(r)
    print(f"  {metric:>12} {value:10.3f} {unit:8} {case} peers={ {k: round(v, 3) for k, v in (peers or {}).items()} }",
          flush=True)


def write(suite, recs, copy_bw):
    os.makedirs(OUT, exist_ok=True)
    doc = {"suite": suite, "gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "command": "PYTHONPATH=$PWD python3 benchmarks/gpu_prefill.py --commit <sha>",
           "versions": {"nbattn_commit": COMMIT, "torch": torch.__version__, "numpy": np.__version__,
                        "numba_cuda": __import__("importlib.metadata").metadata.version("numba-cuda"),
                        "python": sys.version.split()[0]},
           "copy_bandwidth_GBps": copy_bw, "records": recs}
    with open(os.path.join(OUT, f"{suite}.json"), "w") as f:
        json.dump(doc, f, indent=1)


# ---------------------------------------------------------------------------

def bench_prefill_8k(recs):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch._dynamo.config.recompile_limit = 64
    S, HQ, HK, D = 8192, 32, 8, 128
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(S, HQ, D, device=DEV, dtype=torch.float16, generator=g)
    k = torch.randn(S, HK, D, device=DEV, dtype=torch.float16, generator=g)
    v = torch.randn(S, HK, D, device=DEV, dtype=torch.float16, generator=g)
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    flex = torch.compile(flex_attention)
    for causal in (False, True):
        flops = prefill_flops(S, S, HQ, D, causal)
        case = {"batch": 1, "q_len": S, "kv_len": S, "num_qo_heads": HQ, "num_kv_heads": HK,
                "head_dim": D, "dtype": "fp16", "causal": causal}
        peers, ref = {}, None
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    run = lambda: torch.nn.functional.scaled_dot_product_attention(
                        qt, kt, vt, is_causal=causal, enable_gqa=True)
                    o = run()
                    peers[name] = flops / (events_ms(run, 20) * 1e-3) / 1e12
                    ref = o if ref is None else ref
            except Exception as e:
                print(f"  {name} failed: {e!r}"[:300])
        try:
            bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, S, S) if causal else None
            run = lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=True)
            run()
            peers["flex"] = flops / (events_ms(run, 20) * 1e-3) / 1e12
        except Exception as e:
            print(f"  flex failed: {e!r}"[:300])
        ref_o = ref[0].transpose(0, 1) if ref is not None else None
        print(f"  peers causal={causal}: { {k: round(v, 1) for k, v in peers.items()} }", flush=True)
        try:
            out = torch.empty_like(q)
            rec, res, first = ours(P.single_prefill, q, k, v, causal=causal, tensor_cores=True, out=out)
            run = replay_fn(rec.launches)
            written = poisoned(run, out)
            err = rel_err(out, ref_o) if ref_o is not None else float("nan")
            ms = events_ms(run, 10, warm=1)
            tflops = flops / (ms * 1e-3) / 1e12
            # peers hold only the same metric measured in this run; ratios travel beside them
            record(recs, dict(case, path="tensor_cores"), "tflops", tflops, "TFLOP/s", dict(peers),
                   compile_s=first, rel_err_vs_sdpa=err, all_written=written, ms=ms,
                   ratio_to_peers={k: tflops / v for k, v in peers.items()})
        except Exception:
            traceback.print_exc()


def _decode_runner(Dec, p, chunk):
    """The flat decode's launches as ``Dec.run_split`` makes them (``Dec.split_runner``:
    work lists uploaded once), on torch's current stream.  Returns (run, path)."""
    launch = Dec.split_runner(p, chunk)
    cuda.synchronize()

    def run():
        p.stream = torch_stream()
        launch()
    return run, p.config().path


def bench_page1_vs_contiguous(recs, copy_bw):
    from nbattn.cuda import decode as Dec
    S, HQ, HK, D = 32768, 32, 8, 128
    g = torch.Generator(device=DEV).manual_seed(1)
    k = torch.randn(S, HK, D, device=DEV, dtype=torch.float16, generator=g)
    v = torch.randn(S, HK, D, device=DEV, dtype=torch.float16, generator=g)
    perm = torch.randperm(S, device=DEV, generator=g)
    cache1 = torch.empty(S, 2, 1, HK, D, device=DEV, dtype=torch.float16)
    cache1[perm, 0, 0] = k
    cache1[perm, 1, 0] = v
    indices1 = perm.to(torch.int32).cpu().numpy()
    # page 16: the same keys in shuffled 16-key pages
    n16 = S // 16
    perm16 = torch.randperm(n16, device=DEV, generator=g)
    cache16 = torch.empty(n16, 2, 16, HK, D, device=DEV, dtype=torch.float16)
    cache16[perm16, 0] = k.view(n16, 16, HK, D)
    cache16[perm16, 1] = v.view(n16, 16, HK, D)
    indices16 = perm16.to(torch.int32).cpu().numpy()
    flops = prefill_flops(S, S, HQ, D, True)
    q = torch.randn(S, HQ, D, device=DEV, dtype=torch.float16, generator=g)
    case = {"batch": 1, "q_len": S, "kv_len": S, "num_qo_heads": HQ, "num_kv_heads": HK, "head_dim": D,
            "dtype": "fp16", "causal": True, "path": "tensor_cores"}
    rec_c, oc, _ = ours(P.single_prefill, q, k, v, causal=True)
    run_c = replay_fn(rec_c.launches)
    poisoned(run_c, oc)
    ms_c = events_ms(run_c, 5, warm=1)
    tf_c = flops / (ms_c * 1e-3) / 1e12
    # page_size 0 = contiguous KV (the key nbattn.plots.paper pairs page 1 against)
    record(recs, dict(case, kv="contiguous", page_size=0), "tflops", tf_c, "TFLOP/s", {}, ms=ms_c)
    for name, cache, ind, ps in (("page_size_1", cache1, indices1, 1), ("page_size_16", cache16, indices16, 16)):
        rec_p, op, first = ours(P.batch_prefill_paged, q, cache, np.array([0, S], np.int32),
                                np.array([0, len(ind)], np.int32), ind, np.array([ps], np.int32), causal=True)
        run_p = replay_fn(rec_p.launches)
        written = poisoned(run_p, op)
        err = rel_err(op, oc)
        ms_p = events_ms(run_p, 5, warm=1)
        tf_p = flops / (ms_p * 1e-3) / 1e12
        record(recs, dict(case, kv=name, page_size=ps), "tflops", tf_p, "TFLOP/s", {"contiguous": tf_c},
               rel_err_vs_contiguous=err, all_written=written, compile_s=first, ms=ms_p, contiguous_ms=ms_c,
               ratio_to_contiguous=tf_p / tf_c, paper_ratio={"fa2_template": 347 / 370, "fa3_template": 532 / 627})
    # decode: one query over 32k keys, the default decode path (split as choose_chunk splits it),
    # page 1 vs one 32k page
    qd = torch.randn(1, HQ, D, device=DEV, dtype=torch.float16, generator=g)
    cache_c = torch.stack([k, v]).unsqueeze(0)                   # [1, 2, S, HK, D]
    bytes_moved = 2 * S * HK * D * 2 + 2 * HQ * D * 2
    res, chunks, paths = {}, {}, {}
    for name, cache, ind, ps_last in (("page_size_1", cache1, indices1, np.array([1], np.int32)),
                                      ("contiguous", cache_c, np.zeros(1, np.int32), np.array([S], np.int32))):
        ip = np.array([0, len(ind)], np.int32)
        Dec.batch_decode_paged(qd, cache, ip, ind, ps_last)
        p = Dec.prepare_decode(qd, cache, ip, ind, ps_last)
        chunks[name] = Dec.choose_chunk(p)
        run, paths[name] = _decode_runner(Dec, p, chunks[name])
        ms, graphed = graph_ms(run, iters=20)
        res[name] = bytes_moved / (ms * 1e-3) / 1e9 / copy_bw
    record(recs, {"batch": 1, "kv_len": S, "num_qo_heads": HQ, "num_kv_heads": HK, "head_dim": D,
                  "dtype": "fp16", "kernel": "nbattn.cuda.batch_decode_paged", "kv": "page_size_1",
                  "page_size": 1},
           "bw_fraction", res["page_size_1"], "fraction", {"contiguous": res["contiguous"]},
           kv_chunk=chunks["page_size_1"], kv_chunk_contiguous=chunks["contiguous"], graphed=graphed,
           decode_path=paths["page_size_1"])


def _torch_ref(q, cache, indptr, indices, batch_rows):
    """fp32 attention of a few requests, keys gathered from the page table (torch, on the GPU)."""
    HQ, D = q.shape[1], q.shape[2]
    HK = cache.shape[3]
    outs = []
    for b in batch_rows:
        pages = torch.as_tensor(indices[indptr[b]:indptr[b + 1]], device=DEV, dtype=torch.long)
        kk = cache[pages, 0].reshape(-1, HK, D).float().repeat_interleave(HQ // HK, dim=1)
        vv = cache[pages, 1].reshape(-1, HK, D).float().repeat_interleave(HQ // HK, dim=1)
        s = torch.einsum("hd,khd->hk", q[b].float(), kk) / D ** 0.5
        outs.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), vv))
    return torch.stack(outs)


def bench_cascade(recs, copy_bw):
    from nbattn.cuda import decode as Dec
    HQ, HK, D, PS, SUF = 32, 8, 128, 16, 128
    sweep = (128, 256, 512, 1024, 2048, 4096, 8192)
    for batch in (16, 64):
        for prefix in (1024, 32768):
            g = torch.Generator(device=DEV).manual_seed(batch + prefix)
            n_pre, n_suf = prefix // PS, SUF // PS
            pool = n_pre + batch * n_suf
            cache = torch.randn(pool, 2, PS, HK, D, device=DEV, dtype=torch.float16, generator=g)
            rng = np.random.default_rng(batch)
            ids = rng.permutation(pool).astype(np.int32)
            pre, own = ids[:n_pre], ids[n_pre:].reshape(batch, n_suf)
            indices = np.concatenate([np.concatenate([pre, own[b]]) for b in range(batch)]).astype(np.int32)
            indptr = (np.arange(batch + 1) * (n_pre + n_suf)).astype(np.int32)
            last = np.full(batch, PS, np.int32)
            qo = np.arange(batch + 1, dtype=np.int32)
            pkv = L.PagedKV.validate(indptr, indices, last, PS, pool)
            levels = L.cascade_decompose(qo, pkv)
            q = torch.randn(batch, HQ, D, device=DEV, dtype=torch.float16, generator=g)
            case = {"batch": batch, "prefix": prefix, "suffix": SUF, "page_size": PS, "num_qo_heads": HQ,
                    "num_kv_heads": HK, "head_dim": D, "dtype": "fp16"}
            # flat paged decode: the default path (choose_chunk's split)
            flat = Dec.batch_decode_paged(q, cache, indptr, indices, last)
            p = Dec.prepare_decode(q, cache, indptr, indices, last)
            flat_chunk = Dec.choose_chunk(p)
            run_f, flat_path = _decode_runner(Dec, p, flat_chunk)
            ms_f, graphed_f = graph_ms(run_f)
            try:        # the timed launches give what batch_decode_paged gave
                got = torch.from_numpy(np.ascontiguousarray(p.out_dev.copy_to_host()).view(np.float16))
                flat_runner_err = rel_err(got, flat.cpu())
            except Exception as e:  # noqa: BLE001
                print(f"  flat runner check failed: {e!r}"[:200])
                flat_runner_err = None

            def measure(split_blocks, kv_chunk=None, parts=True, decode_levels=True):
                """The cascade's recorded launches timed whole and (parts) pass by pass, with
                its split levels built for ``split_blocks`` CTAs per SM (and single-row levels
                as batch decodes, or on the prefill tile): a CascadeTuning."""
                tuning = CASCADE.replace(min_blocks_split=split_blocks, decode_levels=decode_levels)
                rec, oc, first = ours(cuda_cascade, q, levels, cache, kv_chunk=kv_chunk, tuning=tuning)
                run_c = replay_fn(rec.launches)
                m = {"written": poisoned(run_c, oc), "err": rel_err(oc, flat), "first": first}
                m["us"], m["graphed"] = graph_ms(run_c)
                m["us"] *= 1e3
                work0 = rec.launches[0][3][4].copy_to_host()
                m["chunk"] = int(work0[0, 6] - work0[0, 5])
                m["ctas"] = int(rec.launches[0][1][0]) * int(rec.launches[0][1][1])
                if parts:
                    for name, sl in (("prefix_us", slice(0, 1)), ("suffix_us", slice(1, 2)),
                                     ("merge_us", slice(2, None))):
                        m[name] = graph_ms(replay_fn(rec.launches[sl]))[0] * 1e3
                    ref = _torch_ref(q, cache, indptr, indices, range(min(batch, 8)))
                    m["err_ref"] = rel_err(oc[:len(ref)], ref)
                return m

            default_blocks = CASCADE.min_blocks_split
            main = measure(default_blocks)
            ms_c, ms_pre = main["us"] * 1e-3, main["prefix_us"] * 1e-3
            ms_rest = (main["suffix_us"] + main["merge_us"]) * 1e-3
            pre_flops = 4.0 * batch * HQ * D * prefix
            pre_tflops = pre_flops / (ms_pre * 1e-3) / 1e12
            # what the prefix pass would need for 10x over flat, the rest unchanged
            budget = ms_f / 10 - ms_rest
            need = pre_flops / (budget * 1e-3) / 1e12 if budget > 0 else None      # None: unreachable
            tile = measure(default_blocks, decode_levels=False)      # the suffix level on the prefill tile
            other = {"suffix_on_prefill_tile": {k: tile[k] for k in ("us", "prefix_us", "suffix_us", "merge_us",
                                                                     "err", "written")}}
            for mb in (2, 3):
                if mb == default_blocks:
                    continue
                try:
                    o = measure(mb)
                    other[str(mb)] = {k: o[k] for k in ("us", "prefix_us", "suffix_us", "merge_us", "chunk",
                                                        "ctas", "err", "written")}
                    other[str(mb)]["prefix_tflops"] = pre_flops / (o["prefix_us"] * 1e-6) / 1e12
                except Exception as e:  # noqa: BLE001
                    print(f"  min_blocks {mb} failed: {e!r}"[:300])
            sw = {}
            for ch in sweep:
                if ch >= prefix or ch < prefix // 64:
                    continue
                try:
                    o = measure(default_blocks, ch, parts=False)
                    sw[str(ch)], sw[str(ch) + "_err"] = o["us"], o["err"]
                except Exception as e:  # noqa: BLE001
                    print(f"  sweep {ch} failed: {e!r}"[:200])
            print(f"  batch {batch} prefix {prefix}: flat {ms_f * 1e3:.1f} us, cascade {main['us']:.1f} "
                  f"(prefix {main['prefix_us']:.1f}, suffix {main['suffix_us']:.1f}, merge {main['merge_us']:.1f}; "
                  f"suffix on the prefill tile: {tile['us']:.1f} = suffix {tile['suffix_us']:.1f}) "
                  f"other split min_blocks { {k: round(v['us'], 1) for k, v in other.items()} } sweep "
                  f"{ {k: round(v, 1) for k, v in sw.items() if not k.endswith('_err')} }", flush=True)
            record(recs, case, "latency_us", ms_c * 1e3, "us", {"flat_decode": ms_f * 1e3},
                   compile_s=main["first"], rel_err_vs_flat=main["err"],
                   rel_err_vs_torch_fp32_first8=main["err_ref"], all_written=main["written"],
                   graphed=main["graphed"] and graphed_f, flat_kv_chunk=flat_chunk,
                   flat_decode_path=flat_path, flat_timed_vs_call_rel_err=flat_runner_err,
                   split_min_blocks=default_blocks, prefix_kv_chunk=main["chunk"], prefix_ctas=main["ctas"],
                   prefix_pass_us=main["prefix_us"], suffix_pass_us=main["suffix_us"], merge_us=main["merge_us"],
                   prefix_chunk_sweep_us=sw, other_split_min_blocks=other)
            paper = {(64, 32768): 16.07, (16, 1024): 1.03}.get((batch, prefix))
            record(recs, case, "speedup", ms_f / ms_c, "x", {},
                   **({"paper_flashinfer_h100": paper} if paper else {}))
            record(recs, dict(case, part="prefix_pass"), "tflops", pre_tflops, "TFLOP/s", {},
                   us=ms_pre * 1e3, flops=pre_flops, tflops_needed_for_10x=need,
                   note="10x needs cascade <= flat/10; with suffix+merge as measured, the prefix pass must "
                        "reach tflops_needed_for_10x")


def inspect_tc():
    """Registers and local-memory use of the tensor-core kernels this run compiled."""
    from numba.cuda.dispatcher import CUDADispatcher
    for key, kern in list(P.KERNELS.items()):
        if not isinstance(kern, CUDADispatcher) or not getattr(key, "tensor_cores", False):
            continue
        try:
            regs = kern.get_regs_per_thread()
            for sig, ptx in kern.inspect_asm().items():
                print(f"  tc {key.mode} D={key.head_dim} out={key.out_kind}: ld.local={ptx.count('ld.local')} "
                      f"div.s64={ptx.count('div.s64')} mma={ptx.count('mma.sync')} regs={regs}")
        except Exception as e:  # noqa: BLE001
            print(f"  inspect failed: {e!r}"[:200])


def main(argv=None):
    global OUT, COMMIT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sections", nargs="*", help="the parts to run: cascade, page1, prefill_8k (default: all)")
    ap.add_argument("--commit", default=COMMIT, help="the nbattn commit measured (recorded in the files)")
    ap.add_argument("--out", default=OUT, help="folder for prefill.json and cascade.json")
    args = ap.parse_args(argv)
    if set(args.sections) - {"cascade", "page1", "prefill_8k"}:
        ap.error(f"sections: choose from cascade, page1, prefill_8k, got {args.sections}")
    OUT, COMMIT = args.out, args.commit
    torch.cuda.init()
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    only = set(args.sections)
    prefill, cascade = [], []
    for name, fn, recs in (("cascade", lambda r: bench_cascade(r, copy_bw), cascade),
                           ("page1", lambda r: bench_page1_vs_contiguous(r, copy_bw), prefill),
                           ("prefill_8k", lambda r: bench_prefill_8k(r), prefill)):
        if only and name not in only:
            continue
        print(f"== {name}", flush=True)
        t = time.time()
        try:
            fn(recs)
        except Exception:
            traceback.print_exc()
        print(f"   ({time.time() - t:.1f} s)", flush=True)
        if not only or "prefill_8k" in only or "page1" in only:
            write("prefill", prefill, copy_bw)
        if not only or "cascade" in only:
            write("cascade", cascade, copy_bw)
    try:
        inspect_tc()
    except Exception:
        traceback.print_exc()


if __name__ == "__main__":
    main()
