"""NumPy evaluation of a :class:`~nbattn.variants.Variant` (docs/concepts/masks.md).

Scores arrive as ``s[h, i, j]`` (query head, query, key) already multiplied by
``sm_scale``; positions are sequence positions (``q_idx = K - Q + i``,
``kv_idx = j``, see :mod:`nbattn.variants`).
"""
from __future__ import annotations

import types

import numpy as np

from ..layout import is_torch, to_numpy
from ..variants import Variant, alibi_slopes, code_names


def _on_device(x) -> bool:
    if isinstance(x, (np.ndarray, type)):
        return False
    if is_torch(x):
        return x.device.type != "cpu"
    return hasattr(x, "copy_to_host") or hasattr(x, "__cuda_array_interface__")


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:                 # an empty cell
        return None


def host_function(fn):
    """``fn``, or a copy of it that reads host copies of the device arrays it captures
    (in the globals it names or in its closure cells; torch CUDA tensors, numba device
    arrays, anything with ``__cuda_array_interface__``): FlexAttention's captured
    tensors, read by the golden model as they are at the moment of the call.  Arrays
    that functions it calls capture are not looked at."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return fn
    glob = fn.__globals__
    swap = {n: to_numpy(glob[n]) for n in code_names(code) if n in glob and _on_device(glob[n])}
    cells = fn.__closure__ or ()
    moved = [_on_device(_contents(c)) for c in cells]
    if not swap and not any(moved):
        return fn
    new_cells = tuple(types.CellType(to_numpy(c.cell_contents)) if m else c for c, m in zip(cells, moved))
    return types.FunctionType(code, {**glob, **swap}, fn.__name__, fn.__defaults__, new_cells or None)


def _call_user(fn, args, shape, dtype):
    """Call a user score_mod/mask_mod on broadcast arrays; fall back to an
    element-wise loop for functions that only accept scalars (``if``, ``math``)."""
    fn = host_function(fn)
    try:
        out = np.asarray(fn(*args))
        if out.shape == shape or np.broadcast_shapes(out.shape, shape) == shape:
            return np.broadcast_to(out, shape).astype(dtype)
    except (TypeError, ValueError):
        pass
    full = [np.broadcast_to(a, shape) for a in args]
    return np.vectorize(lambda *xs: fn(*xs), otypes=[dtype])(*full)


def transform_logits(s: np.ndarray, variant: Variant, b: int, heads: np.ndarray,
                     q_pos: np.ndarray, kv_pos: np.ndarray) -> np.ndarray:
    """ALiBi bias, soft-cap and ``score_mod`` applied to scaled scores ``s[h, i, j]``."""
    h = heads[:, None, None]
    qi = q_pos[None, :, None]
    kj = kv_pos[None, None, :]
    if variant.has_alibi:
        slopes = alibi_slopes(len(heads)).astype(s.dtype)[:, None, None]
        s = s - slopes * (qi - kj).astype(s.dtype)
    if variant.has_soft_cap:
        c = s.dtype.type(variant.logits_soft_cap)
        s = c * np.tanh(s / c)
    if variant.score_mod is not None:
        s = _call_user(variant.score_mod, (s, np.int64(b), h, qi, kj), s.shape, s.dtype)
    return s


def keep_mask(variant: Variant, b: int, heads: np.ndarray, q_pos: np.ndarray,
              kv_pos: np.ndarray) -> np.ndarray | None:
    """Boolean ``[H or 1, Q, K]`` of the keys each query keeps; None when all are kept."""
    qi = q_pos[None, :, None]
    kj = kv_pos[None, None, :]
    keep = None

    def both(a, m):
        return m if a is None else a & m

    if variant.causal:
        keep = both(keep, kj <= qi)
    if variant.window_left >= 0:
        in_window = (qi - kj) <= variant.window_left
        if variant.sink_size > 0:
            in_window = in_window | (kj < variant.sink_size)
        keep = both(keep, in_window)
    if variant.mask_mod is not None:
        h = heads[:, None, None]
        shape = (len(heads), len(q_pos), len(kv_pos))
        keep = both(keep, _call_user(variant.mask_mod, (np.int64(b), h, qi, kj), shape, np.bool_))
    return keep
