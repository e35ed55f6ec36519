"""Variants and RoPE through the public API, beside same-run peers (issue 19, item 5;
the counterparts of the paper's Figure 9 and of its variant tables).

Suites ``variants`` (``<out>/variants.json``: the rope and decode parts) and
``variants_prefill`` (``<out>/variants_prefill.json``: the prefill part, which
compiles a prefill kernel per variant and so gets a GPU visit of its own), one
figure ``<out>/variants.png`` drawn from both files; fp16, head_dim 128, 32
query heads, group 4, page 16:

1. ``part=rope``, the StreamingLLM case (keys stored unrotated), decode b64 x 4k
   and b1 x 32k, ``latency_us`` of eager back-to-back calls per ``mode``:

   * ``fused``: ``batch_decode_paged(..., pos_encoding_mode="ROPE_LLAMA")``, the
     kernel turns q and every key as it reads them;
   * ``separate``: ``apply_rope_pos_ids`` turns every cached key to its position
     in the request (and q to the last one), the turned keys are copied into a
     second cache, then the plain ``batch_decode_paged``;
   * ``none``: the plain decode with no RoPE (what either way adds to it).

   ``max_abs_err`` records fused against separate on the same data.
2. ``part=decode`` (b64 x 4k) and ``part=prefill`` (one request, 4k x 4k,
   causal): each variant through the plain public call beside FlexAttention
   compiled with the same ``score_mod`` / ``mask_mod`` (on the dense K/V; a
   ``BlockMask`` for the masks), and SDPA where it has the variant (``plain``,
   and ``window`` through a boolean mask for decode).  Variants: ``plain``,
   ``soft_cap`` (30), ``window`` (1023 keys back), ``alibi``, ``mask_mod``
   (a user function hiding every fourth key), ``sinks`` (learnable sink
   logits; no peer has them, so the plain nbattn call is its peer).  Metrics:
   ``latency_us`` with the peers' times, ``bw_fraction`` (decode: K/V bytes
   over time, of the same run's copy bandwidth) or ``tflops`` (prefill: the
   causal FLOPs, window and mask not discounted), and ``max_abs_err`` against
   FlexAttention's output.  The issue's targets: nbattn at least FlexAttention
   on every decode variant, at least 0.5x on prefill.

fp8 against fp16 is ``benchmarks/gpu_fp8.py`` (``fp8.json``).

    PYTHONPATH=$PWD python3 benchmarks/gpu_variants.py --commit SHA [--out DIR] [--parts rope decode prefill]
    PYTHONPATH=$PWD python3 benchmarks/gpu_variants.py --commit SHA --out benchmarks/results --replot   # figure only

A run writes only the files of the parts it ran; ``--replot`` draws the figure
from whichever of the two files are there.

Under numba's CUDA simulator (no GPU) it is a dry run at tiny shapes, timed with
the host clock and with FlexAttention uncompiled: it checks that the script runs
and that nbattn and FlexAttention compute the same variant
(``tests/test_gpu_variants_script.py``), not how fast anything is.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import nbattn  # noqa: E402,F401
import nbattn.cuda as NC  # noqa: E402
from nbattn import layout as L  # noqa: E402
from nbattn.cuda.blocks.primitives import SIMULATOR  # noqa: E402
from nbattn.variants import alibi_slopes  # noqa: E402
from _timing import copy_bandwidth, eager_ms  # noqa: E402

HQ, D, PS, GROUP = (4, 16, 4, 2) if SIMULATOR else (32, 128, 16, 4)
HKV = HQ // GROUP
DEV = "cpu" if SIMULATOR else "cuda"
REPS = 20
SOFT_CAP, WINDOW = 30.0, (5 if SIMULATOR else 1023)
ROPE_CASES = [(2, 24), (1, 40)] if SIMULATOR else [(64, 4096), (1, 32768)]
ROPE_PREFILL_LEN = 12 if SIMULATOR else 8192          # one request, q and keys this long, causal
DECODE_CASE = (2, 24) if SIMULATOR else (64, 4096)
PREFILL_LEN = 12 if SIMULATOR else 4096
VARIANTS = ("plain", "soft_cap", "window", "alibi", "mask_mod", "sinks")


def sync():
    if not SIMULATOR:
        torch.cuda.synchronize()


def timed_ms(fn) -> float:
    """Milliseconds per eager call (``_timing.eager_ms``: a dry run times one call)."""
    return eager_ms(fn, REPS, SIMULATOR)


def max_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


# ---------------------------------------------------------------------------
# A paged decode batch, its dense copy, and each key's position
# ---------------------------------------------------------------------------

def decode_batch(batch: int, kv_len: int, seed: int):
    pkv = L.PagedKV.allocate(np.full(batch, kv_len), PS, rng=np.random.default_rng(seed))
    gen = torch.Generator(device=DEV).manual_seed(seed)
    cache = torch.randn((pkv.num_pages, 2, PS, HKV, D), dtype=torch.float16, device=DEV, generator=gen)
    q = torch.randn((batch, HQ, D), dtype=torch.float16, device=DEV, generator=gen)
    meta = (pkv.paged_kv_indptr, pkv.paged_kv_indices, pkv.paged_kv_last_page_len)
    return q, cache, meta, pkv


def dense_kv(cache, pkv, batch: int, kv_len: int):
    """K and V as [batch, HKV, kv_len, D] (the peers' layout)."""
    idx = torch.from_numpy(pkv.paged_kv_indices.astype(np.int64)).to(DEV)
    k = cache[idx, 0].reshape(batch, -1, HKV, D)[:, :kv_len].transpose(1, 2).contiguous()
    v = cache[idx, 1].reshape(batch, -1, HKV, D)[:, :kv_len].transpose(1, 2).contiguous()
    return k, v


def slot_positions(pkv) -> np.ndarray:
    """The position in its request of every slot of the page pool, [num_pages * PS]
    (0 for pages no request uses)."""
    pos = np.zeros((pkv.num_pages, PS), np.int32)
    for r in range(len(pkv.paged_kv_indptr) - 1):
        pages = pkv.paged_kv_indices[pkv.paged_kv_indptr[r]:pkv.paged_kv_indptr[r + 1]]
        pos[pages] = np.arange(len(pages) * PS, dtype=np.int32).reshape(len(pages), PS)
    return pos.reshape(-1)


# ---------------------------------------------------------------------------
# Part 1: RoPE fused into the decode, or a separate rotation first
# ---------------------------------------------------------------------------

def bench_rope(recs, copy_bw):
    for i, (batch, kv_len) in enumerate(ROPE_CASES):
        q, cache, meta, pkv = decode_batch(batch, kv_len, 40 + i)
        pos = slot_positions(pkv)
        q_pos = np.full(batch, kv_len - 1, np.int32)
        turned = cache.clone()
        k_rows = cache[:, 0].reshape(-1, HKV, D)
        no_q = torch.empty((k_rows.shape[0], 0, D), dtype=q.dtype, device=DEV)   # keys alone: q with no heads
        no_k = torch.empty((batch, 0, D), dtype=q.dtype, device=DEV)             # q alone

        def separate():
            q_rot, _ = NC.apply_rope_pos_ids(q, no_k, q_pos)
            _, k_rot = NC.apply_rope_pos_ids(no_q, k_rows, pos)
            turned[:, 0] = k_rot.view(turned[:, 0].shape)
            return NC.batch_decode_paged(q_rot, turned, *meta)

        fused = lambda: NC.batch_decode_paged(q, cache, *meta, pos_encoding_mode="ROPE_LLAMA")  # noqa: E731
        none = lambda: NC.batch_decode_paged(q, cache, *meta)  # noqa: E731
        a, b = fused(), separate()
        sync()
        case = {"part": "rope", "op": "decode", "batch": batch, "kv_len": kv_len, "num_qo_heads": HQ,
                "num_kv_heads": HKV, "head_dim": D, "page_size": PS, "dtype": "float16"}
        recs.append({"case": dict(case, compared="fused vs separate"), "metric": "max_abs_err",
                     "value": max_err(a, b), "unit": "", "peers": {}})
        times = {name: timed_ms(fn) * 1e3 for name, fn in (("none", none), ("separate", separate),
                                                           ("fused", fused))}
        for name, us in times.items():
            recs.append({"case": dict(case, mode=name), "metric": "latency_us", "value": us, "unit": "us",
                         "peers": {k: v for k, v in times.items() if k != name}})
        print(f"rope b{batch} x {kv_len}: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items())
              + f"; max |fused - separate| {recs[-4]['value']:.2e}", flush=True)
    bench_rope_prefill(recs)


def bench_rope_prefill(recs):
    """single_prefill, causal, q and K/V of ROPE_PREFILL_LEN rows: no RoPE, RoPE fused
    (q and keys turned inside the kernel), and the two standalone rotations first."""
    n = ROPE_PREFILL_LEN
    gen = torch.Generator(device=DEV).manual_seed(7)
    q, k, v = (torch.randn((n, h, D), dtype=torch.float16, device=DEV, generator=gen) for h in (HQ, HKV, HKV))
    pos = np.arange(n, dtype=np.int32)

    def separate():
        q_rot, k_rot = NC.apply_rope_pos_ids(q, k, pos)
        return NC.single_prefill(q_rot, k_rot, v, causal=True)

    fused = lambda: NC.single_prefill(q, k, v, causal=True, pos_encoding_mode="ROPE_LLAMA")  # noqa: E731
    none = lambda: NC.single_prefill(q, k, v, causal=True)  # noqa: E731
    a, b = fused(), separate()
    sync()
    case = {"part": "rope", "op": "prefill", "qo_len": n, "kv_len": n, "causal": True, "num_qo_heads": HQ,
            "num_kv_heads": HKV, "head_dim": D, "dtype": "float16"}
    recs.append({"case": dict(case, compared="fused vs separate"), "metric": "max_abs_err",
                 "value": max_err(a, b), "unit": "", "peers": {}})
    times = {name: timed_ms(fn) * 1e3 for name, fn in (("none", none), ("separate", separate), ("fused", fused))}
    flops = 4.0 * HQ * D * n * (n + 1) / 2                    # causal: half the score matrix
    for name, us in times.items():
        recs.append({"case": dict(case, mode=name), "metric": "latency_us", "value": us, "unit": "us",
                     "tflops": flops / us * 1e-6, "peers": {k: v for k, v in times.items() if k != name}})
    print(f"rope prefill {n} x {n} causal: " + ", ".join(f"{k} {v:.1f} us ({flops / v * 1e-6:.0f} TFLOP/s)"
                                                          for k, v in times.items())
          + f"; max |fused - separate| {recs[-4]['value']:.2e}", flush=True)


# ---------------------------------------------------------------------------
# Part 2: variants against FlexAttention (and SDPA where it has them)
# ---------------------------------------------------------------------------

def variant_pair(name: str, q_offset: int, causal: bool):
    """(nbattn keywords, FlexAttention score_mod, FlexAttention mask_mod or None): the same
    variant twice.  Flex counts query rows from 0; nbattn's row ``i`` sits at
    ``q_offset + i`` (bottom-right alignment), so flex adds the offset."""
    slopes = torch.from_numpy(alibi_slopes(HQ).astype(np.float32)).to(DEV)

    def keep_causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + q_offset

    def hide_every_fourth(b, h, q_idx, kv_idx):          # the user mask_mod, for nbattn and flex alike
        return kv_idx % 4 != 3

    kw = {"causal": causal} if causal else {}
    score, mask = None, (keep_causal if causal else None)
    if name == "soft_cap":
        kw["logits_soft_cap"] = SOFT_CAP
        score = lambda s, b, h, q_idx, kv_idx: SOFT_CAP * torch.tanh(s / SOFT_CAP)  # noqa: E731
    elif name == "window":
        kw["window_left"] = WINDOW
        mask = ((lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx + q_offset) & (q_idx + q_offset - kv_idx <= WINDOW))
                if causal else (lambda b, h, q_idx, kv_idx: q_idx + q_offset - kv_idx <= WINDOW))
    elif name == "alibi":
        kw["pos_encoding_mode"] = "ALIBI"
        score = lambda s, b, h, q_idx, kv_idx: s - slopes[h] * (q_idx + q_offset - kv_idx)  # noqa: E731
    elif name == "mask_mod":
        kw["mask_mod"] = hide_every_fourth
        mask = ((lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx + q_offset) & (kv_idx % 4 != 3))
                if causal else hide_every_fourth)
    elif name == "sinks":
        kw["sinks"] = torch.linspace(-1.0, 2.0, HQ, dtype=torch.float32)
    return kw, score, mask


def flex_runner(q4, k4, v4, score, mask):
    """FlexAttention on [B, H, L, D] tensors: compiled on a GPU, eager in the dry run."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    fn = flex_attention if SIMULATOR else torch.compile(flex_attention, dynamic=False)
    bm = None
    if mask is not None:
        bm = create_block_mask(mask, q4.shape[0], None, q4.shape[2], k4.shape[2], device=DEV)
    return lambda: fn(q4, k4, v4, score_mod=score, block_mask=bm, enable_gqa=True)


def sdpa_runner(q4, k4, v4, name: str, q_offset: int, causal: bool):
    """SDPA on the variants it has (plain; a window as a boolean mask, decode only); None otherwise."""
    import torch.nn.functional as F
    if name == "plain":
        return lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True)
    if name == "window" and not causal:
        kv = torch.arange(k4.shape[2], device=DEV)
        keep = (q_offset + torch.arange(q4.shape[2], device=DEV))[:, None] - kv[None, :] <= WINDOW
        return lambda: F.scaled_dot_product_attention(q4, k4, v4, attn_mask=keep, enable_gqa=True)
    return None


def bench_variants(recs, part: str, copy_bw):
    if part == "decode":
        batch, kv_len = DECODE_CASE
        q, cache, meta, pkv = decode_batch(batch, kv_len, 60)
        k4, v4 = dense_kv(cache, pkv, batch, kv_len)
        q4 = q.view(batch, HQ, 1, D)
        q_offset, causal = kv_len - 1, False
        ours = lambda kw: (lambda: NC.batch_decode_paged(q, cache, *meta, **kw))  # noqa: E731
        as_rows = lambda o: o.reshape(batch, HQ, D)  # noqa: E731
        nbytes = 2 * batch * kv_len * HKV * D * 2
        rate = lambda ms: ("bw_fraction", nbytes / (ms * 1e-3) / 1e9 / copy_bw, "of copy bandwidth")  # noqa: E731
        case = {"part": "decode", "batch": batch, "kv_len": kv_len}
    else:
        n = PREFILL_LEN
        gen = torch.Generator(device=DEV).manual_seed(61)
        q, k, v = (torch.randn((n, h, D), dtype=torch.float16, device=DEV, generator=gen) for h in (HQ, HKV, HKV))
        q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
        q_offset, causal = 0, True
        ours = lambda kw: (lambda: NC.single_prefill(q, k, v, **kw))  # noqa: E731
        as_rows = lambda o: o[0].transpose(0, 1)  # noqa: E731
        flops = 4.0 * n * n * HQ * D * 0.5
        rate = lambda ms: ("tflops", flops / (ms * 1e-3) / 1e12, "TFLOP/s")  # noqa: E731
        case = {"part": "prefill", "batch": 1, "q_len": n, "kv_len": n, "causal": True}
    case.update(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS, dtype="float16")
    plain_us = None
    for name in VARIANTS:
        kw, score, mask = variant_pair(name, q_offset, causal)
        if "sinks" in kw:
            kw["sinks"] = kw["sinks"].to(DEV)
        fn = ours(kw)
        got = fn()
        sync()
        peers, err = {}, None
        if name != "sinks":
            flex = flex_runner(q4, k4, v4, score, mask)
            want = as_rows(flex())
            sync()
            err = max_err(got, want)
            peers["flex_us"] = timed_ms(flex) * 1e3
            sdpa = sdpa_runner(q4, k4, v4, name, q_offset, causal)
            if sdpa is not None:
                peers["sdpa_us"] = timed_ms(sdpa) * 1e3
        else:
            peers["nbattn_plain_us"] = plain_us
        us = timed_ms(fn) * 1e3
        if name == "plain":
            plain_us = us
        c = dict(case, variant=name)
        metric, value, unit = rate(us * 1e-3)
        recs.append({"case": c, "metric": "latency_us", "value": us, "unit": "us", "peers": peers})
        recs.append({"case": c, "metric": metric, "value": value, "unit": unit,
                     "peers": {k[:-3]: rate(v * 1e-3)[1] for k, v in peers.items() if v is not None}})
        if err is not None:
            recs.append({"case": dict(c, compared="nbattn vs flex"), "metric": "max_abs_err", "value": err,
                         "unit": "", "peers": {}})
        print(f"{part} {name:9s}: nbattn {us:9.1f} us, " + ", ".join(f"{k} {v:.1f}" for k, v in peers.items()
                                                                   if v is not None)
              + (f"; max |nbattn - flex| {err:.2e}" if err is not None else ""), flush=True)


def figure(recs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    rope = [r for r in recs if r["case"].get("part") == "rope" and r["metric"] == "latency_us"]

    def rope_label(c):
        if c.get("op") == "prefill":
            return f"prefill {c['qo_len']} causal"
        return f"decode b{c['batch']} x {c['kv_len']}"

    labels = sorted({rope_label(r["case"]) for r in rope})
    for j, mode in enumerate(("none", "separate", "fused")):
        vals = [next((r["value"] for r in rope if rope_label(r["case"]) == lab
                      and r["case"]["mode"] == mode), np.nan) for lab in labels]
        axes[0].bar(np.arange(len(labels)) + (j - 1) * 0.27, vals, 0.27, label=mode)
    axes[0].set_xticks(np.arange(len(labels)), labels)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("microseconds per call (eager)")
    axes[0].set_title("RoPE: fused, separate, none")
    axes[0].legend(fontsize=8)
    for ax, part in zip(axes[1:], ("decode", "prefill")):
        sel = [r for r in recs if r["case"].get("part") == part and r["metric"] == "latency_us"]
        ax.set_title(f"variants, {part}")
        if not sel:
            ax.text(0.5, 0.5, "not measured in this file", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        names = [r["case"]["variant"] for r in sel]
        for j, (key, label) in enumerate((("nbattn", "nbattn"), ("flex_us", "FlexAttention (compiled)"),
                                          ("sdpa_us", "SDPA"))):
            vals = [r["value"] if key == "nbattn" else (r["peers"].get(key) or np.nan) for r in sel]
            ax.bar(np.arange(len(sel)) + (j - 1) * 0.27, vals, 0.27, label=label)
        ax.set_xticks(np.arange(len(sel)), names, fontsize=8)
        ax.set_ylabel("microseconds per call (eager)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


#: Each suite file and the parts it holds.
SUITES = {"variants": ("rope", "decode"), "variants_prefill": ("prefill",)}


def stored_records(out: Path) -> list:
    """The records of every suite file of this script found in ``out``."""
    import json
    recs = []
    for suite in SUITES:
        path = out / f"{suite}.json"
        if path.exists():
            recs += json.loads(path.read_text())["records"]
    return recs


def main(argv=None) -> int:
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", required=True, help="the nbattn commit measured (recorded in the file)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/nbattn_out"))
    ap.add_argument("--parts", nargs="*", default=["rope", "decode", "prefill"],
                    choices=["rope", "rope_prefill", "decode", "prefill"],
                    help="rope_prefill: only the prefill case of the rope part")
    ap.add_argument("--replot", action="store_true",
                    help="only draw <out>/variants.png again from the suite files in <out> (no GPU)")
    args = ap.parse_args(argv)
    if args.replot:
        figure(stored_records(Path(args.out)), Path(args.out) / "variants.png")
        return 0
    if not SIMULATOR:
        import importlib
        importlib.import_module("torch._dynamo").config.recompile_limit = 64
    copy_bw = copy_bandwidth(SIMULATOR)
    print(f"copy bandwidth {copy_bw:.0f} GB/s{' (simulator dry run: host memory)' if SIMULATOR else ''}",
          flush=True)
    recs: list = []

    def save():
        from nbattn.perf import results
        paths = []
        for suite, parts in SUITES.items():
            mine = [r for r in recs if r["case"]["part"] in parts]
            if mine:
                paths.append(write(results, suite, mine))
        return paths

    def write(results, suite, mine):
        return results.write_suite(
            suite, mine, gpu="numba CUDA simulator (dry run)" if SIMULATOR else torch.cuda.get_device_name(),
            command="PYTHONPATH=$PWD python3 benchmarks/gpu_variants.py " + " ".join(argv or sys.argv[1:]),
            versions={"nbattn_commit": args.commit, "torch": torch.__version__, "numpy": np.__version__,
                      "python": platform.python_version()},
            date=datetime.date.today().isoformat(), root=Path(args.out), copy_bandwidth_GBps=copy_bw)

    for part in args.parts:
        if part == "rope":
            bench_rope(recs, copy_bw)
        elif part == "rope_prefill":
            bench_rope_prefill(recs)
        else:
            bench_variants(recs, part, copy_bw)
        save()
        if not SIMULATOR:
            torch.cuda.empty_cache()
    paths = save()
    figure(stored_records(Path(args.out)), Path(args.out) / "variants.png")
    print(f"wrote {', '.join(map(str, paths))} ({len(recs)} records) in {time.perf_counter() - t0:.0f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
