"""An independent brute-force reference for the tests (float64, explicit masks).

Written separately from :mod:`nbattn.reference` on purpose: one head and one
query at a time where that keeps it obvious, explicit boolean masks, pages
gathered token by token.  Slow, so only for small shapes.
"""
from __future__ import annotations

import math

import numpy as np


def slopes_pow2(n: int) -> np.ndarray:
    return np.array([2.0 ** (-8.0 * (h + 1) / n) for h in range(n)])


def brute_attention(q, k, v, *, q_pos=None, kv_pos=None, causal=False, sm_scale=None,
                    logits_soft_cap=None, alibi=False, window_left=-1, sink_size=0,
                    use_sigmoid=False, sigmoid_bias=0.0, score_mod=None, mask_mod=None,
                    b=0, extra_mask=None):
    """q [Q,Hq,D], k/v [K,Hkv,D] -> (o [Q,Hq,D], lse2 [Q,Hq]) in float64."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    nq, hq, d = q.shape
    nk, hkv = k.shape[:2]
    g = hq // hkv
    if q_pos is None:
        q_pos = np.arange(nk - nq, nk)
    if kv_pos is None:
        kv_pos = np.arange(nk)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    slopes = slopes_pow2(hq) if alibi else None
    o = np.zeros((nq, hq, d))
    lse = np.full((nq, hq), -np.inf)
    for h in range(hq):
        kh, vh = k[:, h // g], v[:, h // g]
        for i in range(nq):
            qi = int(q_pos[i])
            s = (kh @ q[i, h]) * scale
            if alibi:
                s = s - slopes[h] * (qi - kv_pos)
            if logits_soft_cap:
                s = logits_soft_cap * np.tanh(s / logits_soft_cap)
            if score_mod is not None:
                s = np.array([score_mod(s[j], b, h, qi, int(kv_pos[j])) for j in range(nk)], dtype=np.float64)
            keep = np.ones(nk, dtype=bool)
            for j in range(nk):
                kj = int(kv_pos[j])
                if causal and kj > qi:
                    keep[j] = False
                if window_left >= 0 and qi - kj > window_left and not kj < sink_size:
                    keep[j] = False
                if mask_mod is not None and not mask_mod(b, h, qi, kj):
                    keep[j] = False
                if extra_mask is not None and not extra_mask[i, j]:
                    keep[j] = False
            if use_sigmoid:
                p = np.where(keep, 1.0 / (1.0 + np.exp(-(s + sigmoid_bias))), 0.0)
                o[i, h] = p @ vh
                lse[i, h] = np.nan
                continue
            if not keep.any():
                continue
            m = s[keep].max()
            w = np.where(keep, np.exp(s - m), 0.0)
            o[i, h] = (w @ vh) / w.sum()
            lse[i, h] = (m + math.log(w.sum())) / math.log(2.0)
    return o, lse


def gather_pages(cache, indptr, indices, last_page_len, r, kv_layout="NHD"):
    """Token-by-token gather of request r's K and V from a paged cache."""
    ps = cache.shape[2] if kv_layout == "NHD" else cache.shape[3]
    n = int(indptr[r + 1] - indptr[r])
    length = 0 if n == 0 else (n - 1) * ps + int(last_page_len[r])
    ks, vs = [], []
    for t in range(length):
        page = int(indices[int(indptr[r]) + t // ps])
        slot = t % ps
        if kv_layout == "NHD":
            ks.append(cache[page, 0, slot])
            vs.append(cache[page, 1, slot])
        else:
            ks.append(cache[page, 0, :, slot])
            vs.append(cache[page, 1, :, slot])
    hkv, d = (cache.shape[3], cache.shape[4]) if kv_layout == "NHD" else (cache.shape[2], cache.shape[4])
    if not ks:
        return np.zeros((0, hkv, d)), np.zeros((0, hkv, d))
    return np.stack(ks), np.stack(vs)


def indptr_of(lens):
    """``[0, cumsum(lens)]`` as int32 (an indptr array)."""
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def random_paged_batch(rng, *, qo_lens, kv_lens, page_size, num_kv_heads, group, head_dim,
                       kv_layout="NHD", extra_pages=3, share_first_page=False, dtype=np.float32):
    """A random batch: shuffled pages in a larger pool, optional shared first page.

    Returns dict(q, cache, qo_indptr, indptr, indices, last).
    """
    qo_lens = np.asarray(qo_lens)
    kv_lens = np.asarray(kv_lens)
    n_pages = [-(-int(l) // page_size) for l in kv_lens]
    pool = sum(n_pages) + extra_pages
    perm = rng.permutation(pool)
    indices, pos = [], 0
    for n in n_pages:
        indices.append(perm[pos:pos + n])
        pos += n
    if share_first_page and len(indices) > 1:
        # requests with >= 2 pages reuse request 0's first page (prefix sharing)
        for r in range(1, len(indices)):
            if n_pages[r] >= 2 and n_pages[0] >= 2:
                indices[r] = indices[r].copy()
                indices[r][0] = indices[0][0]
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = np.array([0 if n == 0 else int(l) - (n - 1) * page_size for n, l in zip(n_pages, kv_lens)],
                    dtype=np.int32)
    hq = num_kv_heads * group
    if kv_layout == "NHD":
        shape = (pool, 2, page_size, num_kv_heads, head_dim)
    else:
        shape = (pool, 2, num_kv_heads, page_size, head_dim)
    cache = rng.standard_normal(shape).astype(dtype)
    q = rng.standard_normal((int(qo_lens.sum()), hq, head_dim)).astype(dtype)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    ind = np.concatenate(indices).astype(np.int32) if indices else np.zeros(0, np.int32)
    return dict(q=q, cache=cache, qo_indptr=qo_indptr, indptr=indptr, indices=ind, last=last)


def shuffled_pages(rng, kv_lens, page_size):
    """A page table over shuffled pages of a pool two pages larger than needed:
    ``(pool, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)``; an empty
    request has no pages and last_page_len 0."""
    n_pages = [-(-int(n) // page_size) for n in kv_lens]
    pool = sum(n_pages) + 2
    perm = rng.permutation(pool).astype(np.int32)
    indptr = indptr_of(n_pages)
    last = np.array([0 if n == 0 else int(l) - (n - 1) * page_size for n, l in zip(n_pages, kv_lens)], np.int32)
    return pool, indptr, perm[:indptr[-1]], last


def ragged_batch(rng, qo_lens, kv_lens, hkv=2, group=2, d=16):
    q = rng.standard_normal((int(sum(qo_lens)), hkv * group, d)).astype(np.float32)
    k = rng.standard_normal((int(sum(kv_lens)), hkv, d)).astype(np.float32)
    v = rng.standard_normal((int(sum(kv_lens)), hkv, d)).astype(np.float32)
    return q, k, v, indptr_of(qo_lens), indptr_of(kv_lens)

def paged_batch(rng, qo_lens, kv_lens, page_size, kv_layout, hkv=2, group=3, d=8):
    """Shuffled pages in a larger pool; empty requests have no pages and last_page_len 0."""
    pool, indptr, indices, last = shuffled_pages(rng, kv_lens, page_size)
    shape = (pool, 2, page_size, hkv, d) if kv_layout == "NHD" else (pool, 2, hkv, page_size, d)
    cache = rng.standard_normal(shape).astype(np.float32)
    q = rng.standard_normal((int(sum(qo_lens)), hkv * group, d)).astype(np.float32)
    return q, cache, indptr_of(qo_lens), indptr, indices, last


def fresh():
    """A fresh generator (what ``np.random.default_rng()`` would draw) and its seed,
    for assertion messages that reproduce a failure."""
    seed = np.random.SeedSequence().entropy
    return np.random.default_rng(seed), seed


# Variants that every optional golden argument is checked against: passing it as
# None must give the bytes of not passing it.
VARIANT_SAMPLES = [{}, dict(causal=True), dict(window_left=2, sink_size=1), dict(logits_soft_cap=3.0),
                   dict(pos_encoding_mode="ALIBI"), dict(use_sigmoid=True, sigmoid_bias=0.5),
                   dict(mask_mod=lambda b, h, qi, kj: (qi + kj) % 2 == 0)]


def dense_batch(q, ks, vs, qo_lens, *, masks=None, sinks=None, sm_scale=None, causal=False, window_left=-1,
                sink_size=0, mask_mod=None):
    """float64 softmax attention of a batch, key by key, with the NaN rule.

    ``q [rows, Hq, D]``; ``ks[r], vs[r]``: request r's ``[K_r, Hkv, D]``; query row i
    of request r sits at position ``K_r - Q_r + i`` (bottom-right).  A key is visible
    when causal, the window (with ``sink_size`` always-visible first keys),
    ``masks[r][i, j]`` (a bool ``[Q_r, K_r]``, or None) and ``mask_mod(r, h, qi, j)``
    all keep it.  A visible key with a non-finite score or V makes the (row, head)
    NaN.  ``sinks [Hq]``: one more column of logit ``sinks[h]`` and value 0.
    Returns ``(o [rows, Hq, D], lse base 2 [rows, Hq])``; a row with no column is
    ``o = 0, lse = -inf``."""
    q = np.asarray(q, np.float64)
    rows, hq, d = q.shape
    o = np.zeros((rows, hq, d))
    lse = np.full((rows, hq), -np.inf)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    start = 0
    for r, nq in enumerate(qo_lens):
        k, v = np.asarray(ks[r], np.float64), np.asarray(vs[r], np.float64)
        nk, hkv = k.shape[0], k.shape[1]
        g = hq // hkv
        mask = None if masks is None else masks[r]
        for i in range(nq):
            qi = nk - nq + i
            vis = [j for j in range(nk)
                   if not (causal and j > qi)
                   and not (window_left >= 0 and qi - j > window_left and not j < sink_size)
                   and not (mask is not None and not mask[i, j])]
            for h in range(hq):
                seen = vis if mask_mod is None else [j for j in vis if mask_mod(r, h, qi, j)]
                with np.errstate(invalid="ignore", over="ignore"):
                    s = [float(k[j, h // g] @ q[start + i, h]) * scale for j in seen]
                vals = [v[j, h // g] for j in seen]
                if any(not math.isfinite(x) for x in s) or any(not np.isfinite(x).all() for x in vals):
                    o[start + i, h] = np.nan
                    lse[start + i, h] = np.nan
                    continue
                if sinks is not None:
                    s.append(float(sinks[h]))
                    vals.append(np.zeros(d))
                if not s:
                    continue
                s = np.array(s)
                m = s.max()
                w = np.exp(s - m)
                o[start + i, h] = (w @ np.array(vals)) / w.sum()
                lse[start + i, h] = (m + math.log(w.sum())) / math.log(2.0)
        start += nq
    return o, lse


def shared_prefix_batch(rng, page_size, min_batch=1):
    """A paged batch whose requests all start with the same 1-2 pages (a shared prefix),
    then 0-6 keys of their own pages; 0-3 query rows each, 4 query / 2 KV heads,
    head_dim 4.  Returns ``(q, cache, qo_lens, qo_indptr, pkv, prefix_pages)``."""
    from nbattn import layout as L
    batch = int(rng.integers(min_batch, 5))
    prefix_pages = int(rng.integers(1, 3))
    suffix = rng.integers(0, 7, batch)
    pool = prefix_pages + int(np.sum(-(-suffix // page_size))) + 2
    perm = rng.permutation(pool)
    shared = perm[:prefix_pages]
    pos, indices, indptr, last = prefix_pages, [], [0], []
    for s in suffix:
        n = -(-int(s) // page_size)
        indices.append(np.concatenate([shared, perm[pos:pos + n]]))
        pos += n
        indptr.append(indptr[-1] + prefix_pages + n)
        last.append(page_size if n == 0 else int(s) - (n - 1) * page_size)
    kv_lens = prefix_pages * page_size + suffix
    qo_lens = np.array([int(rng.integers(0, min(3, kv) + 1)) for kv in kv_lens])
    pkv = L.PagedKV.validate(np.array(indptr, np.int32), np.concatenate(indices).astype(np.int32),
                             np.array(last, np.int32), page_size, pool)
    cache = rng.standard_normal((pool, 2, page_size, 2, 4)).astype(np.float32)
    q = rng.standard_normal((int(qo_lens.sum()), 4, 4)).astype(np.float32)
    return q, cache, qo_lens, indptr_of(qo_lens), pkv, prefix_pages


def bytes_of(x):
    """An input's dtype and bytes (NumPy arrays and torch tensors of any dtype), to prove it unchanged."""
    if hasattr(x, "detach"):
        import torch
        return str(x.dtype), x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return str(x.dtype), x.tobytes()


def assert_refused(call, d, arg, rule, what, exc=ValueError):
    """``call(d)`` raises ``exc`` (a ValueError) whose message starts with ``arg:`` and
    states ``rule``, and leaves every input in ``d`` byte for byte as it was."""
    import pytest
    before = {key: bytes_of(x) for key, x in d.items()}
    with pytest.raises(exc) as e:
        call(d)
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert msg.startswith(f"{arg}:"), msg
    assert rule in msg, msg
    for key, x in d.items():
        assert bytes_of(x) == before[key], f"{key} changed ({what})"


def turn(x, pos, rope_scale, rope_theta):
    """x [n, H, D] (float64) rotated row by row by RoPE at positions ``pos``: each pair
    ``(x_p, x_{p + D/2})`` as the complex number ``x_p + i x_{p + D/2}`` times
    ``e^{i a}``, ``a = (pos / rope_scale) * rope_theta ** (-2p / D)`` (non-interleaved)."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    half = d // 2
    freq = np.array([rope_theta ** (-2.0 * p / d) for p in range(half)])
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        z = (x[r, :, :half] + 1j * x[r, :, half:]) * np.exp(1j * (pos[r] / rope_scale) * freq)
        out[r, :, :half], out[r, :, half:] = z.real, z.imag
    return out


def brute_rope(q, k, v, rope_scale, rope_theta, causal=False):
    """Attention of one request with RoPE at attention time: q turned to its own
    positions (bottom-right aligned), each key to its position, then :func:`brute_attention`."""
    nq, nk = q.shape[0], k.shape[0]
    q_pos, kv_pos = np.arange(nk - nq, nk), np.arange(nk)
    return brute_attention(turn(q, q_pos, rope_scale, rope_theta), turn(k, kv_pos, rope_scale, rope_theta), v,
                           causal=causal)
