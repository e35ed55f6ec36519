"""``nbattn verify``: a seeded differential-testing campaign of every public
kernel of :mod:`nbattn.cuda` against the golden model :mod:`nbattn.reference`.

Run it after changing a kernel.  Every case is drawn from ``(seed, index)``
alone, so a failure is reproduced by ``nbattn verify --seed S --case I``.
Cases are grouped by kernel configuration (kernel, dtype, head_dim, GQA group,
page size, layout, variant) and run group by group, so each configuration
compiles once on a GPU (about 15 s each on an H200) instead of once per case.

What a campaign draws: page sizes 1..64 (tiny in the simulator), shuffled
pages in a larger pool with a shared first page, GQA groups 1/4/8, head dims
64/128/256 on a GPU (8/16 in the simulator), every variant the kernels
compile (causal, sliding window with sinks, ALiBi, soft cap, sigmoid), fp16,
bf16 and fp32, ragged batches with empty requests, the two plan()/run()
wrappers with a re-plan between runs, and NaN-rule cases (a non-finite q, K
or V element, visible or hidden).

Tolerance rule (also in docs/verify.md).  The inputs are rounded to the
case's dtype; the golden model then computes in float64 on those rounded
values.  A kernel result ``x`` matches the float64 result ``y`` when

    * NaN exactly where ``y`` is NaN, ``-inf`` LSE exactly where ``y`` is -inf;
    * elsewhere ``|x - y| <= tol * (1 + |y|)`` for outputs, with
      ``tol = 2e-3`` (fp32), ``8e-3`` (fp16), ``6e-2`` (bf16):
      a few units of the output's last place, plus the GPU's approximate
      ``ex2`` and fp32 accumulation over up to a few thousand keys;
    * a sigmoid row is an unnormalized sum ``sum_j w_j v_j`` whose elements can
      cancel to near 0 while each term keeps its rounding (the tensor-core
      tiles round ``w_j`` to the input dtype), so its scale is the row's
      largest magnitude: ``|x - y| <= tol * (1 + max_d |y_d|)``;
    * LSE (base 2, always fp32): ``|x - y| <= 2e-3 * (1 + |y|)``.

Exit status 1 when any case mismatches (or errors), 0 otherwise.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

TOL = {"f32": 2e-3, "f16": 8e-3, "bf16": 6e-2}
LSE_TOL = 2e-3
KERNELS = ("decode", "prefill_paged", "prefill_ragged", "single_prefill", "single_decode", "block_sparse",
           "cascade", "split_kv", "merge_states", "decode_wrapper", "prefill_wrapper")
VARIANTS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"causal": True, "window_left": 5, "sink_size": 2},
    "alibi": {"causal": True, "pos_encoding_mode": "ALIBI"},
    "softcap": {"logits_soft_cap": 8.0},
    "sigmoid": {"use_sigmoid": True, "sigmoid_bias": 0.5},
}
# variants a kernel cannot take (the decode wrapper's plan() has no causal flag: one row sees all)
NO_VARIANT = {"merge_states": set(VARIANTS) - {"plain"}}


@dataclass(frozen=True)
class Config:
    kernel: str
    dtype: str
    head_dim: int
    group: int
    page_size: int
    layout: str
    variant: str


@dataclass
class Outcome:
    index: int
    config: Config
    ok: bool
    detail: str
    max_err: float


def _sizes(gpu: bool) -> dict:
    if gpu:
        return dict(head_dims=(64, 128, 256), page_sizes=(1, 2, 3, 8, 16, 32, 64), max_kv=700, max_q=24, batch=6,
                    groups=(1, 4, 8))
    return dict(head_dims=(8, 16), page_sizes=(1, 2, 3, 4), max_kv=12, max_q=4, batch=3, groups=(1, 4))


CASES_PER_CONFIG = 8


def _random_config(rng, kernel: str, gpu: bool) -> Config:
    sz = _sizes(gpu)
    variants = [v for v in VARIANTS if v not in NO_VARIANT.get(kernel, set())]
    return Config(kernel, str(rng.choice(["f32", "f16", "bf16"])), int(rng.choice(sz["head_dims"])),
                  int(rng.choice(sz["groups"])), int(rng.choice(sz["page_sizes"])),
                  str(rng.choice(["NHD", "HND"])) if kernel not in ("block_sparse", "split_kv") else "NHD",
                  str(rng.choice(variants)))


def draw_config(seed: int, index: int, kernels, gpu: bool, cases: int,
                per_config: int = CASES_PER_CONFIG) -> Config:
    """Case ``index``'s configuration: kernels in turn, each from a pool of about
    ``cases / (len(kernels) * per_config)`` configurations drawn from the seed,
    so that cases share compiled kernels (a larger ``per_config`` draws fewer
    configurations, each with more cases: fewer compilations on a GPU)."""
    kernel = kernels[index % len(kernels)]
    pool = max(1, -(-cases // (len(kernels) * per_config)))
    pick = int(np.random.default_rng([seed, index, 0]).integers(pool))
    return _random_config(np.random.default_rng([seed, KERNELS.index(kernel), pick, 2]), kernel, gpu)


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------

def _round(x: np.ndarray, code: str) -> np.ndarray:
    """x rounded to the dtype, kept as float32 (what the golden model reads)."""
    if code == "f16":
        return x.astype(np.float16).astype(np.float32)
    if code == "bf16":
        b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint32) << 16
        return b.astype(np.uint32).view(np.float32)
    return x.astype(np.float32)


def _kernel_input(x: np.ndarray, code: str):
    """What the kernel gets: torch tensors for bf16 (the golden model reads them too)."""
    if code == "f16":
        return x.astype(np.float16)
    if code == "bf16":
        import torch
        return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16)
    return x


def _simulator() -> bool:
    from ._compat import simulator_enabled
    return simulator_enabled()


def _device_input(x: np.ndarray, code: str):
    """A torch CUDA tensor of the case's dtype (what a wrapper's run() takes on a GPU)."""
    import torch
    dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[code]
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(dt).cuda()


def _workspace(nbytes: int, on_gpu: bool):
    if on_gpu:
        import torch
        return torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    return np.zeros(nbytes, np.uint8)


def _poison(rng, arrays: list, nan_case: bool):
    """NaN-rule cases: one non-finite element in q, K or V (visible or not: the mask decides)."""
    if not nan_case:
        return
    target = arrays[int(rng.integers(len(arrays)))]
    idx = tuple(int(rng.integers(s)) for s in target.shape)
    if target.size:
        target[idx] = [np.nan, np.inf, -np.inf][int(rng.integers(3))]


def _lens(rng, batch, max_q, max_kv, decode: bool, causal: bool):
    kv = rng.integers(0, max_kv + 1, size=batch)
    if rng.random() < 0.5:
        kv[int(rng.integers(batch))] = 0                 # an empty request
    if decode:
        qo = np.ones(batch, np.int64)
        if causal:
            kv = np.maximum(kv, 1)
    else:
        qo = np.array([int(rng.integers(0, max_q + 1)) for _ in range(batch)])
        if causal:
            qo = np.minimum(qo, kv)
    return qo.astype(np.int64), kv.astype(np.int64)


def _paged(rng, cfg: Config, qo, kv, hkv):
    ps = cfg.page_size
    n_pages = [-(-int(x) // ps) for x in kv]
    pool = sum(n_pages) + int(rng.integers(1, 4))
    perm = rng.permutation(pool)
    pages, pos = [], 0
    for n in n_pages:
        pages.append(perm[pos:pos + n].copy())
        pos += n
    if len(pages) > 1 and len(pages[0]) and rng.random() < 0.5:      # shared first page
        for p in pages[1:]:
            if len(p) > 1 and kv[0] >= ps:
                p[0] = pages[0][0]
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    indices = (np.concatenate(pages) if pages else np.zeros(0)).astype(np.int32)
    last = np.array([0 if n == 0 else int(l) - (n - 1) * ps for n, l in zip(n_pages, kv)], np.int32)
    shape = (pool, 2, ps, hkv, cfg.head_dim) if cfg.layout == "NHD" else (pool, 2, hkv, ps, cfg.head_dim)
    cache = _round(rng.standard_normal(shape) * rng.choice([1.0, 3.0]), cfg.dtype)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    return cache, qo_indptr, indptr, indices, last


# ---------------------------------------------------------------------------
# Cases: (golden in float64, kernel) for one configuration and case index
# ---------------------------------------------------------------------------

def build_case(seed: int, index: int, cfg: Config, gpu: bool):
    """``(golden(), kernel(), description)``; both return (o, lse) or o."""
    import nbattn.cuda as C
    from nbattn import layout as L
    from nbattn import reference as R

    rng = np.random.default_rng([seed, index, 1])
    sz = _sizes(gpu)
    var = dict(VARIANTS[cfg.variant])
    lse = not var.get("use_sigmoid")
    hkv = int(rng.choice([1, 2]))
    hq = hkv * cfg.group
    d = cfg.head_dim
    nan_case = rng.random() < 0.2
    code = cfg.dtype
    g64 = dict(dtype=np.float64, return_lse=lse)
    kin = lambda x: _kernel_input(x, code)            # noqa: E731
    desc = dict(config=asdict(cfg), num_kv_heads=hkv, nan_case=bool(nan_case))

    def q_rows(n):
        return _round(rng.standard_normal((n, hq, d)), code)

    k = cfg.kernel
    if k in ("decode", "prefill_paged", "cascade", "decode_wrapper", "prefill_wrapper"):
        decode = k in ("decode", "decode_wrapper")
        if k == "decode_wrapper":
            var.pop("causal", None)
        qo, kv = _lens(rng, sz["batch"], sz["max_q"], sz["max_kv"], decode, var.get("causal", False))
        cache, qo_indptr, indptr, indices, last = _paged(rng, cfg, qo, kv, hkv)
        q = q_rows(int(qo.sum()))
        _poison(rng, [q, cache], nan_case)
        desc.update(qo_lens=qo.tolist(), kv_lens=kv.tolist())
        pt = (indptr, indices, last)
        if k == "decode":
            return (lambda: R.batch_decode_paged(q, cache, *pt, kv_layout=cfg.layout, **var, **g64),
                    lambda: C.batch_decode_paged(kin(q), kin(cache), *pt, kv_layout=cfg.layout,
                                                 return_lse=lse, **var), desc)
        if k == "prefill_paged":
            return (lambda: R.batch_prefill_paged(q, cache, qo_indptr, *pt, kv_layout=cfg.layout, **var, **g64),
                    lambda: C.batch_prefill_paged(kin(q), kin(cache), qo_indptr, *pt, kv_layout=cfg.layout,
                                                  return_lse=lse, **var), desc)
        if k == "cascade":
            pkv = L.PagedKV.validate(indptr, indices, last, cfg.page_size, cache.shape[0])
            levels = L.cascade_decompose(qo_indptr, pkv) if cfg.layout == "NHD" else [
                L.CascadeLevel(qo_indptr, indptr, indices, last)]
            return (lambda: R.cascade(q, levels, cache, kv_layout=cfg.layout, **var, **g64),
                    lambda: C.cascade(kin(q), levels, kin(cache), kv_layout=cfg.layout, return_lse=lse, **var),
                    desc)
        # wrappers: plan, run, then re-plan a smaller batch and run again.  On a GPU a
        # wrapper's workspace and run() inputs are device tensors, as a user's are.
        on_gpu = not _simulator()
        ws = _workspace(8 << 20, on_gpu)
        wkin = (lambda x: _device_input(x, code)) if on_gpu else kin      # noqa: E731
        names = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
        half = max(1, len(qo) // 2)

        def wrap():
            outs = []
            W = C.BatchDecodeWithPagedKVCacheWrapper if decode else C.BatchPrefillWithPagedKVCacheWrapper
            w = W(ws, cfg.layout, num_ctas=int(rng.integers(1, 9)))
            for nb in (len(qo), half):
                ip, ix, la = indptr[:nb + 1], indices[:int(indptr[nb])], last[:nb]
                rows = int(qo_indptr[nb])
                if decode:
                    w.plan(ip, ix, la, hq, hkv, d, cfg.page_size, q_data_type=names[code],
                           chunk_overhead=0.0, chunk_limit=None, **var)
                else:
                    w.plan(qo_indptr[:nb + 1], ip, ix, la, hq, hkv, d, cfg.page_size, q_data_type=names[code], **var)
                outs.append(w.run(wkin(q[:rows]), wkin(cache), return_lse=lse))
            return outs

        def gold():
            outs = []
            for nb in (len(qo), half):
                ip, ix, la = indptr[:nb + 1], indices[:int(indptr[nb])], last[:nb]
                rows = int(qo_indptr[nb])
                outs.append(R.batch_prefill_paged(q[:rows], cache, qo_indptr[:nb + 1], ip, ix, la,
                                                  kv_layout=cfg.layout, **var, **g64))
            return outs
        return gold, wrap, desc
    if k in ("prefill_ragged", "single_prefill", "single_decode", "block_sparse", "split_kv"):
        causal = var.get("causal", False)
        if k == "prefill_ragged":
            qo, kv = _lens(rng, sz["batch"], sz["max_q"], sz["max_kv"], False, causal)
        else:
            nk = int(rng.integers(1, sz["max_kv"] + 1))
            nq = 1 if k == "single_decode" else int(rng.integers(1, sz["max_q"] + 1))
            if causal:
                nq = min(nq, nk)
            qo, kv = np.array([nq]), np.array([nk])
        shape_k = (int(kv.sum()), hkv, d) if cfg.layout == "NHD" else (hkv, int(kv.sum()), d)
        kk, vv = _round(rng.standard_normal(shape_k), code), _round(rng.standard_normal(shape_k), code)
        q = q_rows(int(qo.sum()))
        _poison(rng, [q, kk, vv], nan_case)
        desc.update(qo_lens=qo.tolist(), kv_lens=kv.tolist())
        lay = dict(kv_layout=cfg.layout)
        if k == "prefill_ragged":
            qi = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
            ki = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
            return (lambda: R.batch_prefill_ragged(q, kk, vv, qi, ki, **lay, **var, **g64),
                    lambda: C.batch_prefill_ragged(kin(q), kin(kk), kin(vv), qi, ki, return_lse=lse, **lay, **var),
                    desc)
        if k == "single_prefill":
            return (lambda: R.single_prefill(q, kk, vv, **lay, **var, **g64),
                    lambda: C.single_prefill(kin(q), kin(kk), kin(vv), return_lse=lse, **lay, **var), desc)
        if k == "single_decode":
            return (lambda: R.single_decode(q[0], kk, vv, **lay, **var, **g64),
                    lambda: C.single_decode(kin(q[0]), kin(kk), kin(vv), return_lse=lse, **lay, **var), desc)
        if k == "split_kv":
            cuts = np.unique(np.concatenate([[0, int(kv[0])], rng.integers(0, int(kv[0]) + 1, size=3)]))
            cuts = cuts.astype(np.int32)
            desc.update(kv_chunk_indptr=cuts.tolist())
            return (lambda: R.split_kv(q, kk, vv, cuts, **var, **g64),
                    lambda: C.split_kv(kin(q), kin(kk), kin(vv), cuts, return_lse=lse, **var), desc)
        br, bc = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        mask = rng.random((-(-int(qo[0]) // br), -(-int(kv[0]) // bc))) < 0.6
        bsr = L.BSR.from_block_mask(mask, (br, bc), (int(qo[0]), int(kv[0])))
        desc.update(block_shape=[br, bc], block_mask=mask.astype(int).tolist())
        return (lambda: R.block_sparse(q, kk, vv, bsr, **var, **g64),
                lambda: C.block_sparse(kin(q), kin(kk), kin(vv), bsr, return_lse=lse, **var), desc)
    if k == "merge_states":
        rows, n = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        v = _round(rng.standard_normal((rows, n, hq, d)), code)
        s = (rng.standard_normal((rows, n, hq)) * 4).astype(np.float32)
        s[rng.random(s.shape) < 0.2] = -np.inf
        _poison(rng, [s, v], nan_case)
        desc.update(rows=rows, num_states=n)
        return (lambda: R.merge_states(v.astype(np.float64), s.astype(np.float64)),
                lambda: C.merge_states(kin(v), s), desc)
    raise ValueError(f"kernel: unknown kernel {k!r}; choose from {KERNELS}")


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------

def _host(x) -> np.ndarray:
    from nbattn.layout import to_numpy
    a = to_numpy(x)
    if a.dtype.kind == "V":
        a = (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(a, np.float64)


def compare(got, want, code: str, rowwise: bool = False) -> tuple[bool, str, float]:
    """The tolerance rule of the module doc; (ok, what differs, worst error / allowed).
    ``rowwise``: the output's scale is its row's largest magnitude (sigmoid rows)."""
    if isinstance(want, list):
        worst = 0.0
        for i, (g, w) in enumerate(zip(got, want)):
            ok, why, e = compare(g, w, code, rowwise)
            worst = max(worst, e)
            if not ok:
                return False, f"run {i}: {why}", worst
        return True, "", worst
    pairs = [("o", got[0] if isinstance(got, tuple) else got, want[0] if isinstance(want, tuple) else want, TOL[code])]
    if isinstance(want, tuple):
        pairs.append(("lse", got[1], want[1], LSE_TOL))
    worst = 0.0
    for name, g, w, tol in pairs:
        g, w = _host(g), _host(w)
        if g.shape != w.shape:
            return False, f"{name}: shape {g.shape} != golden {w.shape}", math.inf
        if name == "lse" and np.isnan(w).all() and np.isnan(g).all():
            continue
        if not np.array_equal(np.isnan(g), np.isnan(w)):
            extra, lost = int((np.isnan(g) & ~np.isnan(w)).sum()), int((np.isnan(w) & ~np.isnan(g)).sum())
            return False, (f"{name}: NaN at {extra} places where the golden model is not, and not NaN at "
                           f"{lost} where it is"), math.inf
        if not np.array_equal(np.isneginf(g), np.isneginf(w)) or not np.array_equal(np.isposinf(g), np.isposinf(w)):
            return False, f"{name}: infinities differ from the golden model", math.inf
        fin = np.isfinite(w)
        if fin.any():
            mag = np.abs(np.where(fin, w, 0.0))
            if rowwise and name == "o" and w.ndim >= 1:
                mag = np.broadcast_to(mag.max(axis=-1, keepdims=True), w.shape)
            err = np.abs(g[fin] - w[fin]) / (tol * (1 + mag[fin]))
            worst = max(worst, float(err.max()))
            if err.max() > 1:
                return False, f"{name}: error {float(err.max()):.2f}x the tolerance", worst
    return True, "", worst


def run_case(seed: int, index: int, cfg: Config, gpu: bool) -> Outcome:
    try:
        golden, kernel, desc = build_case(seed, index, cfg, gpu)
        with np.errstate(all="ignore"):
            want = golden()
        got = kernel()
        ok, why, err = compare(got, want, cfg.dtype, rowwise=bool(VARIANTS[cfg.variant].get("use_sigmoid")))
        return Outcome(index, cfg, ok, why, err)
    except Exception as e:       # a kernel error is a failure to report, not a crash of the campaign
        return Outcome(index, cfg, False, f"{type(e).__name__}: {e} | {traceback.format_exc(limit=3)[-600:]}",
                       math.inf)


def campaign(seed: int, cases: int, kernels, gpu: bool, time_budget: float | None = None,
             only: int | None = None, progress: bool = True, per_config: int = CASES_PER_CONFIG) -> dict:
    """Draw ``cases`` cases, run them grouped by configuration, return the report dict."""
    # with --case, --cases and --kernel must be the ones that drew it
    indices = [only] if only is not None else list(range(cases))
    cfgs = {i: draw_config(seed, i, kernels, gpu, cases, per_config) for i in indices}
    order = _run_order(indices, cfgs, seed)
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    skipped = 0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(order), desc="nbattn verify", unit="case", file=sys.stderr)
    for i in order:
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            skipped = len(order) - len(outcomes)
            break
        outcomes.append(run_case(seed, i, cfgs[i], gpu))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(fail=sum(not o.ok for o in outcomes))
    if bar is not None:
        bar.close()
    failures = [o for o in outcomes if not o.ok]
    per_kernel: dict = {}
    for o in outcomes:
        pk = per_kernel.setdefault(o.config.kernel, {"cases": 0, "mismatches": 0, "worst_error_ratio": 0.0})
        pk["cases"] += 1
        pk["mismatches"] += int(not o.ok)
        if math.isfinite(o.max_err):
            pk["worst_error_ratio"] = max(pk["worst_error_ratio"], o.max_err)
    kflag = ",".join(kernels)
    return {
        "tool": "nbattn verify",
        "backend": "gpu" if gpu else "simulator",
        "seed": seed,
        "kernels": list(kernels),
        "cases_per_configuration": per_config,
        "cases_requested": len(indices),
        "cases_run": len(outcomes),
        "cases_skipped_for_time": skipped,
        "configurations": len({astuple_key(cfgs[o.index]) for o in outcomes}),
        "mismatches": len(failures),
        "seconds": round(time.perf_counter() - t0, 2),
        "tolerance": {"o": TOL, "lse": LSE_TOL, "rule": "|x - y| <= tol * (1 + |y|) vs float64 golden; "
                                                          "NaN and inf positions exact"},
        "per_kernel": per_kernel,
        "failures": [{"case": o.index, "config": asdict(o.config), "detail": o.detail,
                      "case_inputs": _describe(seed, o.index, o.config, gpu),
                      "reproduce": f"nbattn verify --seed {seed} --cases {cases} --per-config {per_config} "
                                   f"--kernel {kflag} --case {o.index}"
                                   + (" --gpu-sizes" if gpu else "")}
                     for o in failures],
    }


def _run_order(indices, cfgs, seed: int = 0) -> list:
    """Cases grouped by configuration (each compiles once), the configurations
    taken kernel by kernel in turn, so a campaign cut short by its time budget
    has still tested every kernel; the seed rotates which kernel goes first, so
    seeds run side by side start on different kernels."""
    groups: dict = {}
    for i in indices:
        groups.setdefault(astuple_key(cfgs[i]), []).append(i)
    rank: dict = {}
    keyed = []
    for key in sorted(groups):
        r = rank[key[0]] = rank.get(key[0], -1) + 1          # this configuration's turn within its kernel
        keyed.append(((r, (KERNELS.index(key[0]) - seed) % len(KERNELS), key), groups[key]))
    return [i for _, members in sorted(keyed) for i in sorted(members)]


def astuple_key(cfg: Config) -> tuple:
    return (cfg.kernel, cfg.dtype, cfg.head_dim, cfg.group, cfg.page_size, cfg.layout, cfg.variant)


def _describe(seed, index, cfg, gpu):
    try:
        return build_case(seed, index, cfg, gpu)[2]
    except Exception as e:          # noqa: BLE001
        return {"error": str(e)}


def main(argv=None) -> int:
    from ._compat import simulator_enabled

    p = argparse.ArgumentParser(prog="nbattn verify", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=200, help="cases to draw (default 200)")
    p.add_argument("--per-config", type=int, default=CASES_PER_CONFIG,
                   help=f"cases per kernel configuration (default {CASES_PER_CONFIG}); more means fewer "
                        "configurations, so fewer compilations")
    p.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--kernel", default=",".join(KERNELS),
                   help=f"comma-separated kernels to test (default all: {','.join(KERNELS)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case", type=int, default=None, help="run only this case index (a reproduction)")
    p.add_argument("--gpu-sizes", action="store_true",
                   help="GPU shapes (head_dim 64/128/256, page sizes to 64, longer KV); the default on a GPU")
    p.add_argument("--sim-sizes", action="store_true", help="the simulator's tiny shapes even on a GPU")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    kernels = [k.strip() for k in args.kernel.split(",") if k.strip()]
    bad = [k for k in kernels if k not in KERNELS]
    if bad or not kernels:
        p.error(f"--kernel: unknown kernel(s) {bad}; choose from {', '.join(KERNELS)}")
    if args.cases < 1:
        p.error("--cases: must be >= 1")
    if args.per_config < 1:
        p.error("--per-config: must be >= 1")
    gpu = (not simulator_enabled() or args.gpu_sizes) and not args.sim_sizes
    report = campaign(args.seed, args.cases, kernels, gpu, args.time_budget, args.case,
                      progress=not args.no_progress, per_config=args.per_config)
    text = json.dumps(report, indent=2, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(f"nbattn verify: {report['cases_run']} cases in {report['configurations']} configurations, "
          f"{report['mismatches']} mismatches ({report['backend']}, seed {args.seed}, {report['seconds']} s)")
    for fl in report["failures"][:10]:
        print(f"  case {fl['case']} {fl['config']}: {fl['detail'][:300]}\n    {fl['reproduce']}")
    return 1 if report["mismatches"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
