"""Standalone rotary embeddings on the GPU: FlashInfer's ``apply_rope``,
``apply_rope_pos_ids``, ``apply_llama31_rope`` and ``apply_llama31_rope_pos_ids``,
the kernel twins of :mod:`nbattn.reference.rope` (docs/concepts/rope.md).

Same arguments, same checks and messages (:func:`nbattn.reference.rope.rope_args`
runs before anything reaches the device), same results up to the rounding the
kernel module describes (:mod:`nbattn.cuda.kernels.rope`).  ``q`` and ``k`` are
float16, bfloat16 or float32, of any input kind the other kernels take: NumPy
or CPU torch in gives the same kind back; torch CUDA tensors (contiguous) give
new torch CUDA tensors, computed on torch's current stream.  The inputs are
never modified.  The positions (``indptr`` / ``offsets`` or ``pos_ids``) are
host metadata: a GPU tensor there is copied to the host once, to be checked.

One launch turns ``q`` and one turns ``k``.  To rotate at attention time
instead, keep the cache unrotated and pass ``pos_encoding_mode="ROPE_LLAMA"``
to the attention functions.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from .. import layout as L
from ..reference import rope as R
from .blocks.primitives import SIMULATOR
from .host import arrays as A
from .host.driver import launch
from .kernels.rope import rope_kernel

__all__ = ["apply_rope", "apply_rope_pos_ids", "apply_llama31_rope", "apply_llama31_rope_pos_ids"]

THREADS = 32 if SIMULATOR else 256
CODES = ("f16", "bf16", "f32")


def _rotate(q: Any, k: Any, positions, rotary_dim, interleave, rope_scale, rope_theta, llama31=None):
    codes = {}
    for name, x in (("q", q), ("k", k)):
        try:
            codes[name] = A.dtype_code(x, name)
        except L.LayoutError:
            codes[name] = None
        if codes[name] not in CODES:
            raise L.LayoutError(f"{name}: must be a floating-point array of float16, bfloat16 or float32 "
                                f"(the kernels' element types), got {L.dtype_of(x)}")
    args = R.rope_args(tuple(q.shape), tuple(k.shape), positions, rotary_dim, rope_scale, rope_theta, llama31)
    L.check_same_device(q=q, k=k)
    for name, x in (("q", q), ("k", k)):
        if A.is_device_kind(A.kind_of(x)):
            A.check_contiguous(x, name)
    stream = A.launch_stream(q, k)
    nnz = int(q.shape[0])
    pos = cuda.to_device(np.ascontiguousarray(args.pos, np.int64), stream=stream) if nnz else None
    freq = cuda.to_device(np.ascontiguousarray(args.freq, np.float64), stream=stream)
    results = []
    for name, x in (("q", q), ("k", k)):
        kind, code, shape = A.kind_of(x), codes[name], tuple(int(n) for n in x.shape)
        user, out = A.new_output(kind, shape, code, stream, like=x)
        pairs = nnz * shape[1] * (args.rotary_dim // 2)
        if pairs:
            src = A.to_device(x, name, stream, code)
            launch(rope_kernel(code, bool(interleave)), (pairs + THREADS - 1) // THREADS, THREADS, stream,
                   (A.flat(src), A.flat(out), pos, float(args.position_scale), freq, shape[1], shape[2],
                    args.rotary_dim))
        results.append(A.finish(kind, user, out, code, stream))
    return results[0], results[1]


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1.0, rope_theta=1e4):
    """RoPE on ragged ``q [nnz, num_qo_heads, head_dim]`` and ``k [nnz,
    num_kv_heads, head_dim]``; row ``j`` of request ``i`` sits at position
    ``offsets[i] + j``.  Arguments and results as :func:`nbattn.reference.apply_rope`."""
    return _rotate(q, k, lambda nnz: R.ragged_positions(indptr, offsets, nnz), rotary_dim, interleave,
                   rope_scale, rope_theta)


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1.0, rope_theta=1e4):
    """RoPE with one position per row, ``pos_ids [nnz]``.  Arguments and results
    as :func:`nbattn.reference.apply_rope_pos_ids`."""
    return _rotate(q, k, lambda nnz: R.pos_ids_positions(pos_ids, nnz), rotary_dim, interleave,
                   rope_scale, rope_theta)


def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8.0,
                       rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192):
    """Llama 3.1 RoPE on ragged ``q`` and ``k`` (positions as :func:`apply_rope`).
    Arguments and results as :func:`nbattn.reference.apply_llama31_rope`."""
    return _rotate(q, k, lambda nnz: R.ragged_positions(indptr, offsets, nnz), rotary_dim, interleave,
                   rope_scale, rope_theta, (low_freq_factor, high_freq_factor, old_context_len))


def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8.0,
                               rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
                               old_context_len=8192):
    """Llama 3.1 RoPE with one position per row.  Arguments and results as
    :func:`nbattn.reference.apply_llama31_rope_pos_ids`."""
    return _rotate(q, k, lambda nnz: R.pos_ids_positions(pos_ids, nnz), rotary_dim, interleave,
                   rope_scale, rope_theta, (low_freq_factor, high_freq_factor, old_context_len))
