"""Rotary position embeddings (RoPE) on ragged q and k (docs/concepts/rope.md).

FlashInfer's standalone RoPE functions, with its names and arguments.  The
first ``rotary_dim`` dimensions of every head are split into pairs, and each
pair is turned by an angle that grows with the row's position; the remaining
dimensions are copied unchanged.  Two pairings exist:

- non-interleaved (``interleave=False``, "rotate half", Llama/NeoX): dimension
  ``i`` pairs with ``i + rotary_dim/2``;
- interleaved (``interleave=True``, GPT-J): dimension ``2i`` pairs with
  ``2i + 1``.

Pair ``i`` (``0 <= i < rotary_dim/2``) turns at the frequency
``rope_theta ** (-2i / rotary_dim)``; plain RoPE uses the angle
``(pos / rope_scale) * freq``, Llama 3.1 rescales the frequencies instead and
uses ``pos * freq``.  A pair ``(x1, x2)`` becomes
``(x1 cos a - x2 sin a, x1 sin a + x2 cos a)``.

Everything is computed in float64 and rounded once to the input's element
type.  NumPy in gives NumPy out; a torch tensor (bfloat16 included) gives a
torch tensor of the same dtype and device.  Inputs are never modified, and
every argument is checked before anything is computed: a bad one raises
:class:`nbattn.layout.LayoutError` (a ``ValueError``) whose message starts
with the argument's name.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, NamedTuple

import numpy as np

from .. import layout as L
from .attention import float_input
from .rotary import inv_freq, rotate

__all__ = ["apply_rope", "apply_rope_pos_ids", "apply_llama31_rope", "apply_llama31_rope_pos_ids",
           "RopeArgs", "rope_args", "check_qk_shapes", "ragged_positions", "pos_ids_positions"]


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------

def check_qk_shapes(q_shape: tuple, k_shape: tuple) -> None:
    """The rules on the shapes of ``q [nnz, num_qo_heads, head_dim]`` and
    ``k [nnz, num_kv_heads, head_dim]`` (a LayoutError naming the argument)."""
    if len(q_shape) != 3:
        raise L.LayoutError(f"q: must have rank 3, shape [nnz, num_qo_heads, head_dim], got {tuple(q_shape)}")
    if len(k_shape) != 3:
        raise L.LayoutError(f"k: must have rank 3, shape [nnz, num_kv_heads, head_dim], got {tuple(k_shape)}")
    if k_shape[0] != q_shape[0]:
        raise L.LayoutError(f"k: must have as many rows (nnz) as q ({q_shape[0]}), got {k_shape[0]}")
    if k_shape[2] != q_shape[2]:
        raise L.LayoutError(f"k: head_dim {k_shape[2]} must equal q's head_dim {q_shape[2]}")


def _non_negative(name: str, x: Any, length: int, what: str) -> np.ndarray:
    arr = L.as_int32(name, x)
    if len(arr) != length:
        raise L.LayoutError(f"{name}: must have one entry per {what} ({length}), got {len(arr)}")
    if arr.size and arr.min() < 0:
        i = int(np.argmax(arr < 0))
        raise L.LayoutError(f"{name}: must be >= 0, got {name}[{i}]={int(arr[i])}")
    return arr


def ragged_positions(indptr: Any, offsets: Any, nnz: int) -> np.ndarray:
    """Position of every row (checked): ``offsets[i] + j`` for row ``j`` of request ``i``."""
    ptr = L.check_indptr("indptr", indptr, total=nnz, total_name="nnz, the number of rows of q and k")
    lens = np.diff(ptr.astype(np.int64))
    off = _non_negative("offsets", offsets, len(lens), "request")
    local = np.arange(nnz, dtype=np.int64) - np.repeat(ptr[:-1].astype(np.int64), lens)
    return np.repeat(off.astype(np.int64), lens) + local


def pos_ids_positions(pos_ids: Any, nnz: int) -> np.ndarray:
    """Position of every row (checked): ``pos_ids`` itself, one entry per row, ``>= 0``."""
    return _non_negative("pos_ids", pos_ids, nnz, "row of q and k").astype(np.int64)


def _rotary_dim(rotary_dim: Any, head_dim: int) -> int:
    if rotary_dim is None:
        rotary_dim, given = head_dim, f"{head_dim} (the default, head_dim)"
    else:
        given = repr(rotary_dim)
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral):
        raise L.LayoutError(f"rotary_dim: must be an even integer in 1..head_dim ({head_dim}), got {given}")
    r = int(rotary_dim)
    if r <= 0 or r > head_dim or r % 2:
        raise L.LayoutError(f"rotary_dim: must be even and 0 < rotary_dim <= head_dim ({head_dim}), "
                            f"got {given}")
    return r


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise L.LayoutError(f"{name}: must be a finite number > 0, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise L.LayoutError(f"{name}: must be a finite number > 0, got {value!r}")
    return v


def _llama31_factors(low_freq_factor: Any, high_freq_factor: Any,
                     old_context_len: Any) -> tuple[float, float, float]:
    low = _positive("low_freq_factor", low_freq_factor)
    high = _positive("high_freq_factor", high_freq_factor)
    if not high > low:
        raise L.LayoutError(f"high_freq_factor: must be > low_freq_factor ({low_freq_factor!r}), "
                            f"got {high_freq_factor!r}")
    return low, high, _positive("old_context_len", old_context_len)


# ---------------------------------------------------------------------------
# The computation
# ---------------------------------------------------------------------------

def _llama31_freq(inv_freq: np.ndarray, rope_scale: float, low: float, high: float,
                  old_context_len: float) -> np.ndarray:
    """Llama 3.1's frequencies: short wavelengths kept, long ones divided by
    ``rope_scale``, a linear blend of the two in between."""
    wavelen = 2.0 * math.pi / inv_freq
    smooth = (old_context_len / wavelen - low) / (high - low)
    blend = (1.0 - smooth) * inv_freq / rope_scale + smooth * inv_freq
    return np.where(wavelen < old_context_len / high, inv_freq,
                    np.where(wavelen > old_context_len / low, inv_freq / rope_scale, blend))


def _round_bf16(x: np.ndarray) -> np.ndarray:
    """float64 rounded once (to nearest, ties to even) to bfloat16, returned as float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        m, e = np.frexp(x)                                       # x = m * 2**e, 0.5 <= |m| < 1
        r = np.ldexp(np.round(m * 256.0) / 256.0, e)             # 8 significant bits
        tiny = np.abs(x) < 2.0 ** -126                           # bf16 subnormals: a fixed step
        r = np.where(tiny, np.round(x * 2.0 ** 133) * 2.0 ** -133, r)
        return r.astype(np.float32)                              # exact, or inf past bf16's range


def _like(out: np.ndarray, given: Any, host: np.ndarray) -> Any:
    """The float64 result in the element type and kind (NumPy or torch) of the input."""
    if L.is_torch(given):
        import torch
        if given.dtype == torch.bfloat16:
            return torch.from_numpy(_round_bf16(out)).to(device=given.device, dtype=torch.bfloat16)
        return torch.from_numpy(out.astype(host.dtype)).to(given.device)
    dt = given.dtype if isinstance(given, np.ndarray) else host.dtype
    if dt.kind == "V" and dt.itemsize == 2:                      # raw bfloat16 bytes
        return (_round_bf16(out).view(np.uint32) >> 16).astype(np.uint16).view(dt)
    return out.astype(dt)


class RopeArgs(NamedTuple):
    """Checked arguments of a RoPE call.  Pair ``p`` of row ``r`` turns by
    ``(pos[r] / position_scale) * freq[p]`` (float64)."""
    pos: np.ndarray           # int64 [nnz]
    rotary_dim: int
    position_scale: float     # rope_scale for plain RoPE, 1 for Llama 3.1
    freq: np.ndarray          # float64 [rotary_dim / 2]


def rope_args(q_shape: tuple, k_shape: tuple, positions: Callable[[int], np.ndarray], rotary_dim: Any,
              rope_scale: Any, rope_theta: Any, llama31: tuple | None = None) -> RopeArgs:
    """Every argument of a RoPE call checked, in the order the functions list
    them (the golden model and the kernels share this).  ``positions(nnz)``
    checks and returns the rows' positions; ``llama31`` is
    ``(low_freq_factor, high_freq_factor, old_context_len)`` or None."""
    check_qk_shapes(q_shape, k_shape)
    pos = positions(q_shape[0]).astype(np.int64)
    rd = _rotary_dim(rotary_dim, q_shape[2])
    theta = _positive("rope_theta", rope_theta)
    scale = _positive("rope_scale", rope_scale)
    inv = inv_freq(rd, theta)
    if llama31 is None:
        return RopeArgs(pos, rd, scale, inv)
    low, high, old = _llama31_factors(*llama31)
    return RopeArgs(pos, rd, 1.0, _llama31_freq(inv, scale, low, high, old))


def _golden(q, k, positions, rotary_dim, interleave, rope_scale, rope_theta, llama31=None):
    qa, ka = float_input("q", q), float_input("k", k)
    a = rope_args(qa.shape, ka.shape, positions, rotary_dim, rope_scale, rope_theta, llama31)
    angle = (a.pos.astype(np.float64) / a.position_scale)[:, None] * a.freq[None, :]
    q_rope = rotate(qa, angle, a.rotary_dim, bool(interleave))
    k_rope = rotate(ka, angle, a.rotary_dim, bool(interleave))
    return _like(q_rope, q, qa), _like(k_rope, k, ka)


# ---------------------------------------------------------------------------
# Public functions (their docstrings share the parameter texts below)
# ---------------------------------------------------------------------------

_PARAM_DOCS = {
    "q_k": """\
    q : array, shape [nnz, num_qo_heads, head_dim]
        Queries.
    k : array, shape [nnz, num_kv_heads, head_dim]
        Keys, one row per row of ``q``.""",
    "pos_ids": """\
    pos_ids : int array, shape [nnz]
        Position of every row, ``>= 0``.""",
    "ragged": """\
    indptr : int array, shape [batch_size + 1]
        Row pointer: starts at 0, non-decreasing, ends at ``nnz``.
    offsets : int array, shape [batch_size]
        Position of each request's first row, ``>= 0``.""",
    "pairs": """\
    rotary_dim : int, optional
        Even, in ``1..head_dim``; ``None`` means ``head_dim``.
    interleave : bool
        The pairing: ``False`` rotate half, ``True`` GPT-J.""",
    "theta": """\
    rope_theta : float
        Base of the frequencies; finite, ``> 0``.""",
    "llama31": """\
    rope_scale : float
        Divides the low frequencies; finite, ``> 0``.
    rope_theta : float
        Base of the frequencies; finite, ``> 0``.
    low_freq_factor : float
        ``> 0``; sets the wavelength ``w_low`` above which frequencies are scaled.
    high_freq_factor : float
        ``> low_freq_factor``; sets the wavelength ``w_high`` below which they are kept.
    old_context_len : float
        The context length the model was trained with, ``> 0``.""",
    "returns": """\
    Returns
    -------
    q_rope : array, shape [nnz, num_qo_heads, head_dim]
    k_rope : array, shape [nnz, num_kv_heads, head_dim]
        New arrays of the inputs' dtypes.

    Raises
    ------
    nbattn.layout.LayoutError
        Naming the first bad argument, raised before any work.""",
}


def _shared_params(fn):
    """Fill ``{name}`` fields of ``fn``'s docstring with the texts of ``_PARAM_DOCS``."""
    if fn.__doc__:                     # None under python -OO
        fn.__doc__ = fn.__doc__.format(**_PARAM_DOCS)
    return fn


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1.0,
               rope_theta=1e4):
    """RoPE on ragged ``q`` and ``k``, positions counted from each request's offset.

    Request ``i`` owns rows ``indptr[i]:indptr[i+1]`` of both ``q`` and ``k``;
    its ``j``-th row sits at position ``offsets[i] + j``.  Pair ``p`` of a row
    at position ``pos`` turns by ``(pos / rope_scale) * rope_theta ** (-2p / rotary_dim)``.

    Parameters
    ----------
    q : array, shape [nnz, num_qo_heads, head_dim]
        Queries (float16, float32, float64; torch bfloat16 too).
    k : array, shape [nnz, num_kv_heads, head_dim]
        Keys, one row per row of ``q``; ``num_kv_heads`` may differ from
        ``num_qo_heads`` (GQA).
    indptr : int array, shape [batch_size + 1]
        Row pointer: starts at 0, non-decreasing, ends at ``nnz``.  Equal
        neighbours are empty requests.
    offsets : int array, shape [batch_size]
        Position of each request's first row, ``>= 0``.
    rotary_dim : int, optional
        How many leading dimensions of each head rotate: even, in
        ``1..head_dim``; ``None`` means ``head_dim``.  The others are copied.
    interleave : bool
        ``False``: dimension ``i`` pairs with ``i + rotary_dim/2`` (rotate
        half, Llama/NeoX).  ``True``: ``2i`` pairs with ``2i+1`` (GPT-J).
    rope_scale : float
        Positions are divided by it (linear position interpolation); finite, ``> 0``.
    rope_theta : float
        Base of the frequencies; finite, ``> 0``.

    Returns
    -------
    q_rope : array, shape [nnz, num_qo_heads, head_dim]
        New array of ``q``'s dtype (and kind: NumPy or torch).
    k_rope : array, shape [nnz, num_kv_heads, head_dim]
        New array of ``k``'s dtype.

    Raises
    ------
    nbattn.layout.LayoutError
        A ``ValueError`` naming the first bad argument, raised before any work.
    """
    return _golden(q, k, lambda nnz: ragged_positions(indptr, offsets, nnz), rotary_dim, interleave,
                   rope_scale, rope_theta)


@_shared_params
def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1.0,
                       rope_theta=1e4):
    """RoPE on ``q`` and ``k`` with one position per row.

    Row ``r`` of ``q`` and of ``k`` sits at position ``pos_ids[r]``; otherwise
    as :func:`apply_rope`.

    Parameters
    ----------
{q_k}
{pos_ids}
{pairs}
    rope_scale : float
        Positions are divided by it; finite, ``> 0``.
{theta}

{returns}
    """
    return _golden(q, k, lambda nnz: pos_ids_positions(pos_ids, nnz), rotary_dim, interleave,
                   rope_scale, rope_theta)


@_shared_params
def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8.0,
                       rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
                       old_context_len=8192):
    """Llama 3.1 RoPE on ragged ``q`` and ``k`` (positions as in :func:`apply_rope`).

    The frequency ``f = rope_theta ** (-2p / rotary_dim)`` of pair ``p`` has
    the wavelength ``w = 2 pi / f``.  With ``w_high = old_context_len /
    high_freq_factor`` and ``w_low = old_context_len / low_freq_factor``, the
    pair uses ``f`` when ``w < w_high``, ``f / rope_scale`` when ``w > w_low``,
    and in between ``(1 - s) f / rope_scale + s f`` with
    ``s = (old_context_len / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    The angle is ``pos * frequency``: positions are not divided by ``rope_scale``.

    Parameters
    ----------
{q_k}
{ragged}
{pairs}
{llama31}

{returns}
    """
    return _golden(q, k, lambda nnz: ragged_positions(indptr, offsets, nnz), rotary_dim, interleave,
                   rope_scale, rope_theta, (low_freq_factor, high_freq_factor, old_context_len))


@_shared_params
def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8.0,
                               rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
                               old_context_len=8192):
    """Llama 3.1 RoPE with one position per row (frequencies as in
    :func:`apply_llama31_rope`, positions as in :func:`apply_rope_pos_ids`).

    Parameters
    ----------
{q_k}
{pos_ids}
{pairs}
{llama31}

{returns}
    """
    return _golden(q, k, lambda nnz: pos_ids_positions(pos_ids, nnz), rotary_dim, interleave,
                   rope_scale, rope_theta, (low_freq_factor, high_freq_factor, old_context_len))
