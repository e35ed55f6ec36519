"""Prefill, cascade and page-size benchmarks on the GPU, peers in the same run.

    PYTHONPATH=$PWD python3 benchmarks/gpu_prefill.py      (writes $OUT or benchmarks/results)

Suites (result format of shared/GPU.md):
- prefill.json: batch 1 x 8k x 8k, 32 query / 8 KV heads, head_dim 128, fp16,
  causal and not: nbattn tensor-core and CUDA-core paths beside torch SDPA
  (flash, cuDNN) and FlexAttention (compiled); TFLOP/s.  Also page size 1 vs
  contiguous KV at batch 1 x 32k (prefill TFLOP/s, decode bandwidth fraction).
- cascade.json: shared-prefix decode, suffix 128, batch {16, 64} x prefix
  {1024, 32768}: cascade vs flat paged decode (nbattn.cuda.batch_decode_paged).

Every timing: CUDA events around the kernels only (host planning recorded
once, :class:`nbattn.cuda.prefill.recording`), after warm-up, median of many
runs; first-call (compile) time kept apart; outputs poisoned with NaN first
and checked fully written and close to a peer.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback

import numpy as np
import torch

import nbattn  # noqa: F401
from nbattn import layout as L
from nbattn.cuda.cascade import cascade as cuda_cascade
from nbattn.cuda import prefill as P

OUT = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
DEV = "cuda"
FP32_FMA_PEAK_TFLOPS = 67.0      # H200/H100 SXM datasheet (a lead, not measured)


def events_ms(fn, reps: int, warm: int = 2) -> float:
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
    return float(np.median(times))


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = events_ms(lambda: y.copy_(x), 20)
    return 2 * x.numel() / (ms * 1e-3) / 1e9


def prefill_flops(q_len: int, kv_len: int, heads: int, d: int, causal: bool) -> float:
    if causal:   # bottom-right: query i sees kv_len - q_len + i + 1 keys
        seen = sum(kv_len - q_len + i + 1 for i in range(q_len)) if q_len < 4096 else \
            q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2
    else:
        seen = q_len * kv_len
    return 4.0 * heads * d * seen


def ours(fn, *args, **kw):
    """(replay, result, first_call_s): record launches once, then replay them."""
    torch.cuda.synchronize()
    t = time.time()
    res = fn(*args, **kw)               # first call: compiles
    torch.cuda.synchronize()
    first = time.time() - t
    with P.recording() as rec:
        res = fn(*args, **kw)
    rec.replay()
    torch.cuda.synchronize()
    return rec.replay, res, first


def poisoned_replay(replay, out) -> bool:
    """Fill the output with NaN, run the recorded launches, check every element was written."""
    out.fill_(float("nan"))
    replay()
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
           "command": "PYTHONPATH=$PWD python3 benchmarks/gpu_prefill.py",
           "versions": {"torch": torch.__version__, "numpy": np.__version__,
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
        for tc, reps in ((True, 10), (False, 2)):
            try:
                out = torch.empty_like(q)
                replay, res, first = ours(P.single_prefill, q, k, v, causal=causal, tensor_cores=tc, out=out)
                written = poisoned_replay(replay, out)
                err = rel_err(out, ref_o) if ref_o is not None else float("nan")
                ms = events_ms(replay, reps, warm=1)
                tflops = flops / (ms * 1e-3) / 1e12
                c = dict(case, path="tensor_cores" if tc else "cuda_cores")
                # peers hold only the same metric measured in this run; ratios and
                # datasheet peaks travel beside them as extra fields.
                if tc:
                    record(recs, c, "tflops", tflops, "TFLOP/s", dict(peers), compile_s=first,
                           rel_err_vs_sdpa=err, all_written=written, ms=ms,
                           ratio_to_peers={k: tflops / v for k, v in peers.items()})
                else:
                    record(recs, c, "tflops", tflops, "TFLOP/s", {}, compile_s=first, rel_err_vs_sdpa=err,
                           all_written=written, ms=ms, fp32_fma_peak_datasheet=FP32_FMA_PEAK_TFLOPS,
                           fraction_of_fp32_peak=tflops / FP32_FMA_PEAK_TFLOPS)
            except Exception:
                traceback.print_exc()


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
    indices = perm.to(torch.int32).cpu().numpy()
    indptr = np.array([0, S], np.int32)
    last = np.array([1], np.int32)
    flops = prefill_flops(S, S, HQ, D, True)
    q = torch.randn(S, HQ, D, device=DEV, dtype=torch.float16, generator=g)
    case = {"batch": 1, "q_len": S, "kv_len": S, "num_qo_heads": HQ, "num_kv_heads": HK, "head_dim": D,
            "dtype": "fp16", "causal": True, "path": "tensor_cores"}
    replay_c, oc, _ = ours(P.single_prefill, q, k, v, causal=True)
    poisoned_replay(replay_c, oc)
    ms_c = events_ms(replay_c, 3, warm=1)
    replay_p, op, _ = ours(P.batch_prefill_paged, q, cache1, np.array([0, S], np.int32), indptr, indices, last,
                           causal=True)
    written = poisoned_replay(replay_p, op)
    ms_p = events_ms(replay_p, 3, warm=1)
    err = rel_err(op, oc)
    record(recs, dict(case, kv="page_size_1"), "tflops", flops / (ms_p * 1e-3) / 1e12, "TFLOP/s",
           {"contiguous": flops / (ms_c * 1e-3) / 1e12}, rel_err_vs_contiguous=err,
           all_written=written)
    # decode: one query over 32k keys, the decode engineer's kernel, page 1 vs one 32k page
    qd = torch.randn(1, HQ, D, device=DEV, dtype=torch.float16, generator=g)
    cache_c = torch.stack([k, v]).unsqueeze(0)                   # [1, 2, S, HK, D]
    bytes_moved = 2 * S * HK * D * 2 + 2 * HQ * D * 2
    res = {}
    for name, cache, ind, ps_last in (("page_size_1", cache1, indices, last),
                                      ("contiguous", cache_c, np.zeros(1, np.int32), np.array([S], np.int32))):
        ip = np.array([0, len(ind)], np.int32)
        fn = lambda: Dec.batch_decode_paged(qd, cache, ip, ind, ps_last)
        fn()
        p = Dec.prepare_decode(qd, cache, ip, ind, ps_last)
        chunk = Dec.choose_chunk(p)
        run = _decode_runner(Dec, p, chunk)
        ms = events_ms(run, 30)
        res[name] = bytes_moved / (ms * 1e-3) / 1e9 / copy_bw
    record(recs, {"batch": 1, "kv_len": S, "num_qo_heads": HQ, "num_kv_heads": HK, "head_dim": D,
                  "dtype": "fp16", "kernel": "nbattn.cuda.batch_decode_paged", "kv": "page_size_1"},
           "bw_fraction", res["page_size_1"], "fraction", {"contiguous": res["contiguous"]})


def _decode_runner(Dec, p, chunk):
    """The flat decode's launches with their work lists uploaded once."""
    from nbattn.cuda.merge import MergeMap, run_merge_partials
    (cta_indptr, req, ks, ke, slot, m_indptr, m_row, m_slots, n_slots) = Dec.split_work(p.kv_lens, chunk)
    work = Dec.WorkList(*Dec._upload(p.stream, cta_indptr, req, ks, ke, slot))
    if n_slots == 0:
        return lambda: Dec.run_decode_work(p, work)
    from numba import cuda
    po = cuda.device_array((n_slots, p.num_qo_heads, p.head_dim), np.float32)
    pl = cuda.device_array((n_slots, p.num_qo_heads), np.float32)
    mmap = MergeMap(*Dec._upload(p.stream, m_indptr, m_row, m_slots))

    def run():
        Dec.run_decode_work(p, work, po, pl)
        run_merge_partials(po, pl, mmap, p.out_dev, p.lse_dev, code=p.code,
                           use_sigmoid=p.variant.use_sigmoid, stream=p.stream)
    return run


def bench_cascade(recs, copy_bw):
    from nbattn.cuda import decode as Dec
    HQ, HK, D, PS, SUF = 32, 8, 128, 16, 128
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
            replay, oc, first = ours(cuda_cascade, q, levels, cache)
            written = poisoned_replay(replay, oc)
            ms_c = events_ms(replay, 50)
            flat = Dec.batch_decode_paged(q, cache, indptr, indices, last)
            p = Dec.prepare_decode(q, cache, indptr, indices, last)
            ms_f = events_ms(_decode_runner(Dec, p, Dec.choose_chunk(p)), 50)
            err = rel_err(oc, flat)
            case = {"batch": batch, "prefix": prefix, "suffix": SUF, "page_size": PS, "num_qo_heads": HQ,
                    "num_kv_heads": HK, "head_dim": D, "dtype": "fp16"}
            record(recs, case, "latency_us", ms_c * 1e3, "us", {"flat_decode": ms_f * 1e3},
                   compile_s=first, rel_err_vs_flat=err, all_written=written)
            paper = {(64, 32768): 16.07, (16, 1024): 1.03}.get((batch, prefix))
            record(recs, case, "speedup", ms_f / ms_c, "x", {},
                   **({"paper_flashinfer_h100": paper} if paper else {}))


def inspect_tc():
    """Registers and local-memory use of the tensor-core kernel (spills show as ld.local)."""
    from nbattn.variants import Variant
    for d in (64, 128, 256):
        spec = P.make_spec("contig", "NHD", "f16", d, 32, 8, Variant(causal=True), True)
        kern = P.get_kernel(spec)
        regs = kern.get_regs_per_thread()
        for sig, ptx in kern.inspect_asm().items():
            print(f"  tc D={d}: ld.local={ptx.count('ld.local')} st.local={ptx.count('st.local')} "
                  f"mma={ptx.count('mma.sync')} regs={regs}")


def main():
    torch.cuda.init()
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    prefill, cascade = [], []
    for name, fn, recs in (("prefill_8k", lambda r: bench_prefill_8k(r), prefill),
                           ("cascade", lambda r: bench_cascade(r, copy_bw), cascade),
                           ("page1", lambda r: bench_page1_vs_contiguous(r, copy_bw), prefill)):
        print(f"== {name}", flush=True)
        try:
            fn(recs)
        except Exception:
            traceback.print_exc()
        write("prefill", prefill, copy_bw)
        write("cascade", cascade, copy_bw)
    try:
        inspect_tc()
    except Exception:
        traceback.print_exc()


if __name__ == "__main__":
    main()
