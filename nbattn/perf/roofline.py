"""Roofline and traffic models (docs/concepts/performance.md).

Everything here is a pure, NumPy-vectorized function: scalar arguments give
NumPy scalars (or Python numbers), array arguments broadcast.  Units are
explicit in the names: FLOPs and bytes are counts, ``*_GBps`` is 1e9 bytes/s,
``*_tflops`` is 1e12 FLOP/s, times are seconds unless the name says otherwise.

The models are deliberately first-order: they count the work attention cannot
avoid, so measured numbers can be read as a fraction of that ideal.
"""
from __future__ import annotations

import numpy as np

__all__ = [
    "causal_visible_pairs",
    "attention_flops",
    "attention_bytes",
    "operational_intensity",
    "intensity_approx",
    "ridge_point",
    "attainable_tflops",
    "roofline_time_s",
    "bandwidth_fraction",
    "peak_fraction",
    "decode_bandwidth_fraction",
    "prefill_peak_fraction",
    "naive_prefix_tokens",
    "reuse_prefix_tokens",
    "prefix_traffic_ratio",
    "planning_breakeven_layers",
    "planning_pays",
    "amdahl_speedup",
    "decode_bandwidth_model",
    "split_kv_speedup_model",
]


def _f(x):
    return np.asarray(x, dtype=np.float64)


def _out(x):
    """0-d arrays back to NumPy scalars so scalar callers get scalars."""
    x = np.asarray(x)
    return x[()] if x.ndim == 0 else x


# --------------------------------------------------------------------------
# Work and traffic of one attention call
# --------------------------------------------------------------------------

def causal_visible_pairs(l_q, l_kv):
    """Number of (query, key) pairs the bottom-right causal mask keeps.

    Local query ``i`` sees key ``j`` iff ``j <= l_kv - l_q + i``,
    so row ``i`` sees ``min(l_kv, l_kv - l_q + i + 1)`` keys (never fewer than 0).
    Summed over the rows this is ``l_q*l_kv - l_q*(l_q-1)/2`` when
    ``l_q <= l_kv``; when ``l_q > l_kv`` the first ``l_q - l_kv`` rows see
    nothing and the rest see ``1..l_kv`` keys, i.e. ``l_kv*(l_kv+1)/2``.
    A decode step (``l_q = 1``) sees all ``l_kv`` keys.
    """
    q, k = _f(l_q), _f(l_kv)
    return _out(np.where(q <= k, q * k - q * (q - 1) / 2, k * (k + 1) / 2))


def attention_flops(l_q, l_kv, head_dim, num_qo_heads=1, causal=False):
    """FLOPs of attention: ``4 * l_q * l_kv * head_dim`` per query head.

    Two matmuls (``Q K^T`` and ``P V``) of ``2 * l_q * l_kv * head_dim`` FLOPs
    each; softmax is ignored, as the performance model does.  With ``causal=True`` only
    the pairs the bottom-right mask keeps are counted
    (:func:`causal_visible_pairs`), which is what a kernel that skips masked
    tiles can hope for.
    """
    pairs = causal_visible_pairs(l_q, l_kv) if causal else _f(l_q) * _f(l_kv)
    return _out(4.0 * _f(pairs) * _f(head_dim) * _f(num_qo_heads))


def attention_bytes(l_q, l_kv, head_dim, num_qo_heads=1, num_kv_heads=None,
                    bytes_per_elem=2):
    """Minimal DRAM traffic.

    ``b * head_dim * (l_q*H_qo + 2*l_kv*H_kv + l_q*H_qo)``: read Q, read K and V
    once, write O once.  ``num_kv_heads`` defaults to ``num_qo_heads`` (MHA).
    """
    h_qo = _f(num_qo_heads)
    h_kv = h_qo if num_kv_heads is None else _f(num_kv_heads)
    q, k = _f(l_q), _f(l_kv)
    return _out(_f(bytes_per_elem) * _f(head_dim)
                * (q * h_qo + 2.0 * k * h_kv + q * h_qo))


def operational_intensity(l_q, l_kv, head_dim=128, num_qo_heads=1,
                          num_kv_heads=None, bytes_per_elem=2, causal=False):
    """FLOP per byte: :func:`attention_flops` / :func:`attention_bytes`."""
    flops = attention_flops(l_q, l_kv, head_dim, num_qo_heads, causal=causal)
    nbytes = attention_bytes(l_q, l_kv, head_dim, num_qo_heads, num_kv_heads,
                             bytes_per_elem)
    return _out(_f(flops) / _f(nbytes))


def intensity_approx(l_q, l_kv, group=1, bytes_per_elem=2):
    """The performance model's closed form ``(2/b) * l_q*l_kv/(l_q+l_kv) * group``.

    Exact for MHA (``group = 1``).  For GQA the exact ratio is
    ``(2/b) * group * l_q*l_kv / (group*l_q + l_kv)``; the two agree when
    ``group*l_q << l_kv`` (decode: intensity -> ``(2/b)*group``, memory-bound)
    and the closed form overstates long prefills.  It is kept because it is the
    one-line argument "prefill is O(l), decode is O(group)".
    """
    q, k = _f(l_q), _f(l_kv)
    return _out(2.0 / _f(bytes_per_elem) * q * k / (q + k) * _f(group))


# --------------------------------------------------------------------------
# Roofline
# --------------------------------------------------------------------------

def ridge_point(peak_tflops, bandwidth_GBps):
    """Intensity (FLOP/byte) at which the bandwidth slope meets the compute roof."""
    return _out(_f(peak_tflops) * 1e3 / _f(bandwidth_GBps))


def attainable_tflops(intensity, peak_tflops, bandwidth_GBps):
    """Roofline bound ``min(peak, bw * intensity)`` in TFLOP/s.

    ``bw`` in GB/s times FLOP/byte is GFLOP/s, hence the 1e-3.
    """
    return _out(np.minimum(_f(peak_tflops), _f(bandwidth_GBps) * _f(intensity) * 1e-3))


def roofline_time_s(flops, nbytes, peak_tflops, bandwidth_GBps):
    """Lower bound on run time: the slower of computing and moving the data."""
    return _out(np.maximum(_f(flops) / (_f(peak_tflops) * 1e12),
                           _f(nbytes) / (_f(bandwidth_GBps) * 1e9)))


def bandwidth_fraction(nbytes, seconds, copy_bandwidth_GBps):
    """Achieved bandwidth over the measured copy bandwidth (the decode report)."""
    return _out(_f(nbytes) / _f(seconds) / (_f(copy_bandwidth_GBps) * 1e9))


def peak_fraction(flops, seconds, peak_tflops):
    """Achieved FLOP/s over the device peak (the prefill report)."""
    return _out(_f(flops) / _f(seconds) / (_f(peak_tflops) * 1e12))


def decode_bandwidth_fraction(seconds, *, batch, l_kv, head_dim, num_qo_heads,
                              num_kv_heads, copy_bandwidth_GBps, bytes_per_elem=2):
    """Decode report of the performance model for ``batch`` requests of ``l_kv`` keys each.

    Bytes are the minimal traffic of :func:`attention_bytes` with ``l_q = 1``.
    """
    nbytes = _f(batch) * _f(attention_bytes(1, l_kv, head_dim, num_qo_heads,
                                            num_kv_heads, bytes_per_elem))
    return bandwidth_fraction(nbytes, seconds, copy_bandwidth_GBps)


def prefill_peak_fraction(seconds, *, batch, l_q, l_kv, head_dim, num_qo_heads,
                          peak_tflops, causal=False):
    """Prefill report of the performance model: achieved FLOP/s over peak.

    FLOPs follow :func:`attention_flops`, so a causal run is credited only with
    the visible pairs (no credit for work on masked tiles).
    """
    flops = _f(batch) * _f(attention_flops(l_q, l_kv, head_dim, num_qo_heads,
                                           causal=causal))
    return peak_fraction(flops, seconds, peak_tflops)


# --------------------------------------------------------------------------
# Shared-prefix (cascade) traffic model
# --------------------------------------------------------------------------

def naive_prefix_tokens(n, prefix_len, suffix_len):
    """KV tokens read when each of ``n`` requests re-reads the prefix: ``n(P+S)``."""
    return _out(_f(n) * (_f(prefix_len) + _f(suffix_len)))


def reuse_prefix_tokens(n, prefix_len, suffix_len):
    """KV tokens read when the shared prefix is read once: ``P + nS``."""
    return _out(_f(prefix_len) + _f(n) * _f(suffix_len))


def prefix_traffic_ratio(n, prefix_len, suffix_len):
    """``n(P+S) / (P+nS)``: the traffic saved by reuse.

    For a memory-bound kernel this is the speedup the cascade could reach at
    best; measured speedups sit below it (merge cost, launch overhead).
    """
    return _out(_f(naive_prefix_tokens(n, prefix_len, suffix_len))
                / _f(reuse_prefix_tokens(n, prefix_len, suffix_len)))


# --------------------------------------------------------------------------
# Planning economics and Amdahl
# --------------------------------------------------------------------------

def planning_breakeven_layers(u, v, p, h=0.0):
    """Smallest layer count ``L`` with ``L*(u - v) > p + h``.

    ``u``/``v``: per-layer time without/with the plan, ``p``: plan cost paid
    once per step, ``h``: integration overhead, all in the same unit.  Returns
    ``inf`` where the plan does not speed a layer up (``u <= v``): no number of
    layers amortizes it.
    """
    gain = _f(u) - _f(v)
    cost = _f(p) + _f(h)
    with np.errstate(divide="ignore", invalid="ignore"):
        layers = np.floor(cost / gain) + 1.0
    layers = np.where(gain > 0, np.maximum(layers, 1.0), np.inf)
    return _out(layers)


def planning_pays(layers, u, v, p, h=0.0):
    """Whether ``L*(u - v) > p + h`` for ``L = layers``."""
    return _out(_f(layers) * (_f(u) - _f(v)) > _f(p) + _f(h))


def amdahl_speedup(f, k):
    """Whole-step speedup when a fraction ``f`` of it (attention) gets ``k`` x faster.

    ``1 / ((1 - f) + f / k)``; tends to ``1 / (1 - f)`` however fast attention gets.
    """
    f, k = _f(f), _f(k)
    return _out(1.0 / ((1.0 - f) + f / k))


# --------------------------------------------------------------------------
# Split-KV (FlashDecoding) occupancy model
# --------------------------------------------------------------------------

def _split_kv_times(batch, l_kv, split, num_qo_heads, num_kv_heads, head_dim,
                    bytes_per_elem, num_sms, bandwidth_GBps, sm_bandwidth_share,
                    min_chunk):
    b, k = _f(batch), _f(l_kv)
    bw = _f(bandwidth_GBps) * 1e9
    sms = _f(num_sms)
    per_sm = sm_bandwidth_share * bw / sms
    ctas = b * _f(num_kv_heads)
    kv_bytes = b * _f(attention_bytes(1, k, head_dim, num_qo_heads, num_kv_heads,
                                      bytes_per_elem))
    if split:
        starved = ctas * sm_bandwidth_share < sms
        splits = np.where(
            starved,
            np.minimum(np.ceil(sms / ctas), np.maximum(1.0, np.floor(k / min_chunk))),
            1.0)
    else:
        splits = np.ones_like(ctas * k)
    partial_bytes = np.where(
        splits > 1, 2.0 * b * _f(num_qo_heads) * splits * (_f(head_dim) + 1.0) * 4.0, 0.0)
    seconds = (kv_bytes + partial_bytes) / np.minimum(bw, ctas * splits * per_sm)
    return kv_bytes, seconds, bw


def decode_bandwidth_model(batch, l_kv, *, split=True, num_qo_heads=32, num_kv_heads=8,
                           head_dim=128, bytes_per_elem=2, num_sms=132,
                           bandwidth_GBps=4300.0, sm_bandwidth_share=2.0,
                           min_chunk=256):
    """Modelled decode bandwidth fraction (minimal bytes / time / bandwidth).

    A non-split decode kernel runs one CTA per (request, KV head), so at small
    batch only ``batch*num_kv_heads`` SMs pull data.  The model assumes one SM
    can draw at most ``sm_bandwidth_share`` times its fair share
    ``bandwidth/num_sms`` (an assumption, not a measurement: a lone SM cannot
    keep enough loads in flight to use the whole memory system).  With
    ``split=True`` each KV range is cut into ``s`` chunks (enough to cover the
    SMs, none shorter than ``min_chunk`` tokens; ``s = 1`` when the SMs are
    already covered, as a planner would choose); each chunk writes an fp32
    partial state ``(o, lse)`` per query head that the merge of two states
    (docs/concepts/state.md) reads back, which is the split's price.
    Reported against the minimal bytes of :func:`attention_bytes`, like a
    measured decode.
    """
    kv_bytes, seconds, bw = _split_kv_times(
        batch, l_kv, split, num_qo_heads, num_kv_heads, head_dim, bytes_per_elem,
        num_sms, bandwidth_GBps, sm_bandwidth_share, min_chunk)
    return _out(kv_bytes / seconds / bw)


def split_kv_speedup_model(batch, l_kv, *, num_qo_heads=32, num_kv_heads=8,
                           head_dim=128, bytes_per_elem=2, num_sms=132,
                           bandwidth_GBps=4300.0, sm_bandwidth_share=2.0,
                           min_chunk=256):
    """Modelled speedup ``t_nosplit / t_split`` of FlashDecoding's split-KV.

    The ratio of :func:`decode_bandwidth_model` with and without splitting (see
    there for the assumptions).  Large at small batch and long context, 1 once
    ``batch*num_kv_heads`` CTAs already keep the memory system busy.
    """
    kw = dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
              bytes_per_elem=bytes_per_elem, num_sms=num_sms,
              bandwidth_GBps=bandwidth_GBps, sm_bandwidth_share=sm_bandwidth_share,
              min_chunk=min_chunk)
    return _out(_f(decode_bandwidth_model(batch, l_kv, split=True, **kw))
                / _f(decode_bandwidth_model(batch, l_kv, split=False, **kw)))
