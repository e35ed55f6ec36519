"""Runtime custom masks (tree / speculative decoding), FlashInfer's layout.

A custom mask says, per request, which keys each query row keeps: request
``r`` with ``Q = qo_len[r]`` rows and ``K = kv_len[r]`` keys owns a row-major
boolean ``[Q, K]`` block (True = the key is kept).  The batch forms take the
blocks flattened and concatenated, request after request, so request ``r``'s
block starts at ``qk_indptr[r] = sum(qo_len[i] * kv_len[i] for i < r)``
(:func:`mask_indptr`).  ``single_prefill`` also takes the block unflattened.

The packed form holds the same bits, eight to a byte, little-endian within a
byte (bit ``t`` of a segment is ``(byte[t // 8] >> (t % 8)) & 1``); every
request's segment is packed on its own and padded to whole bytes, so segment
``r`` starts at ``sum(ceil(qo_len[i] * kv_len[i] / 8) for i < r)``: what
:func:`segment_packbits` gives for ``qk_indptr``.  Padding bits are ignored.

The attention functions only take the argument; :func:`request_masks` checks
it and gives each request's ``[Q, K]`` block, which the golden model ANDs
into the other masks (docs/concepts/custom_mask.md).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import layout as L

__all__ = ["packbits", "segment_packbits", "mask_indptr", "check_mask_choice", "request_masks"]

BITORDERS = ("big", "little")


def _like(result: np.ndarray, x: Any):
    """``result`` as a torch tensor on ``x``'s device when ``x`` is one."""
    if not L.is_torch(x):
        return result
    import torch
    return torch.from_numpy(np.ascontiguousarray(result)).to(x.device)


def _bits(name: str, x: Any) -> np.ndarray:
    arr = L.to_numpy(x)
    if arr.dtype != np.bool_ and arr.dtype.kind not in "iu":
        raise L.LayoutError(f"{name}: must be a bool (or integer, nonzero = 1) array, got {arr.dtype}")
    if arr.ndim != 1:
        raise L.LayoutError(f"{name}: must be 1-D, got shape {tuple(arr.shape)}")
    return arr


def _bitorder(bitorder: str) -> str:
    if bitorder not in BITORDERS:
        raise L.LayoutError(f"bitorder: must be 'big' or 'little', got {bitorder!r}")
    return bitorder


def packbits(x: Any, bitorder: str = "big"):
    """Pack a 1-D binary array into uint8, eight elements a byte, as
    ``np.packbits(x, bitorder=bitorder)`` (the last byte is padded with 0).

    Returns ``uint8 [(len(x) + 7) // 8]`` (a torch tensor for a torch ``x``).
    The default is ``"big"``, as in FlashInfer and NumPy; a packed custom
    mask is read little-endian, so build one with ``bitorder="little"``.
    """
    arr = _bits("x", x)
    return _like(np.packbits(arr, bitorder=_bitorder(bitorder)), x)


def segment_packbits(x: Any, indptr: Any, bitorder: str = "big"):
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` on its own, as
    :func:`packbits` does, and concatenate the results.

    Returns ``(packed, new_indptr)``: ``packed[new_indptr[i]:new_indptr[i+1]]``
    holds segment i's bits, and ``new_indptr[i+1] - new_indptr[i] ==
    (indptr[i+1] - indptr[i] + 7) // 8``; ``new_indptr`` is int32 (torch
    tensors for a torch ``x``).  Note: FlashInfer's ``segment_packbits``
    defaults to ``"big"``.
    """
    arr = _bits("x", x)
    order = _bitorder(bitorder)
    ptr = L.check_indptr("indptr", indptr, total=arr.shape[0], total_name="len(x)")
    seg = np.diff(ptr.astype(np.int64))
    new_ptr = np.zeros(ptr.shape[0], np.int64)
    np.cumsum((seg + 7) // 8, out=new_ptr[1:])
    packed = np.zeros(int(new_ptr[-1]), np.uint8)
    for i in range(seg.shape[0]):
        packed[new_ptr[i]:new_ptr[i + 1]] = np.packbits(arr[ptr[i]:ptr[i + 1]], bitorder=order)
    return _like(packed, x), _like(new_ptr.astype(np.int32), x)


def mask_indptr(qo_lens: Any, kv_lens: Any) -> np.ndarray:
    """``qk_indptr``: where each request's flattened ``[qo_len, kv_len]`` block
    starts in a custom mask (int64, length ``batch_size + 1``)."""
    n = np.asarray(qo_lens, np.int64) * np.asarray(kv_lens, np.int64)
    out = np.zeros(n.shape[0] + 1, np.int64)
    np.cumsum(n, out=out[1:])
    return out


def check_mask_choice(custom_mask: Any, packed_custom_mask: Any, *, causal: bool) -> None:
    """The rules that need no lengths: not both forms, and no ``causal`` beside a mask."""
    if custom_mask is None and packed_custom_mask is None:
        return
    if custom_mask is not None and packed_custom_mask is not None:
        raise L.LayoutError("packed_custom_mask: give custom_mask or packed_custom_mask, not both "
                            "(packed_custom_mask is the packed form of the same mask)")
    name = "custom_mask" if custom_mask is not None else "packed_custom_mask"
    if causal:
        raise L.LayoutError(f"{name}: causal=True cannot be combined with a custom mask (FlashInfer "
                            f"ignores causal when a custom mask is given); write the causal rule into "
                            f"the mask and pass causal=False")


def request_masks(custom_mask: Any, packed_custom_mask: Any, qo_lens: Any, kv_lens: Any, *,
                  causal: bool, single: bool = False) -> list[np.ndarray] | None:
    """Check a custom mask against the requests' lengths and give request r's
    boolean ``[qo_lens[r], kv_lens[r]]`` block; None when neither is given.

    ``single=True`` (``single_prefill``) also accepts ``custom_mask`` as
    ``[qo_len, kv_len]``.  Raises :class:`~nbattn.layout.LayoutError` (a
    ValueError) naming the argument; reads its inputs only.
    """
    if custom_mask is None and packed_custom_mask is None:
        return None
    check_mask_choice(custom_mask, packed_custom_mask, causal=causal)
    qo = np.asarray(qo_lens, np.int64)
    kv = np.asarray(kv_lens, np.int64)
    ptr = mask_indptr(qo, kv)
    total = int(ptr[-1])
    how = "qo_len * kv_len" if single else "sum(qo_len[i] * kv_len[i])"
    why = ("" if single else " (request i's row-major [qo_len[i], kv_len[i]] block after request i-1's; "
           "qo_len from qo_indptr, kv_len from the KV layout)")
    if custom_mask is not None:
        m = L.to_numpy(custom_mask)
        if m.dtype != np.bool_:
            raise L.LayoutError(f"custom_mask: must be bool (True keeps the key), got {m.dtype}")
        if single and m.ndim == 2:
            if m.shape != (int(qo[0]), int(kv[0])):
                raise L.LayoutError(f"custom_mask: must have shape [qo_len, kv_len] = "
                                    f"[{int(qo[0])}, {int(kv[0])}] (or be flattened to [{total}]), "
                                    f"got {tuple(m.shape)}")
            return [m]
        if m.ndim != 1 or m.shape[0] != total:
            shapes = f"[qo_len, kv_len] = [{int(qo[0])}, {int(kv[0])}] or " if single else ""
            raise L.LayoutError(f"custom_mask: must be {shapes}1-D of length {how} = {total}{why}, "
                                f"got shape {tuple(m.shape)}")
        return [m[ptr[r]:ptr[r + 1]].reshape(int(qo[r]), int(kv[r])) for r in range(qo.shape[0])]
    p = L.to_numpy(packed_custom_mask)
    if p.dtype != np.uint8:
        raise L.LayoutError(f"packed_custom_mask: must be uint8 (bits packed little-endian, as "
                            f"packbits(..., bitorder='little') gives), got {p.dtype}")
    seg = (ptr[1:] - ptr[:-1] + 7) // 8
    pptr = np.zeros(seg.shape[0] + 1, np.int64)
    np.cumsum(seg, out=pptr[1:])
    if p.ndim != 1 or p.shape[0] != int(pptr[-1]):
        rule = ("ceil(qo_len * kv_len / 8)" if single else "sum(ceil(qo_len[i] * kv_len[i] / 8))")
        why = ("" if single else " (each request's block packed on its own, as segment_packbits "
               "gives for qk_indptr)")
        raise L.LayoutError(f"packed_custom_mask: must be 1-D of length {rule} = {int(pptr[-1])}{why}, "
                            f"got shape {tuple(p.shape)}")
    out = []
    for r in range(qo.shape[0]):
        n = int(ptr[r + 1] - ptr[r])
        bits = np.unpackbits(p[pptr[r]:pptr[r + 1]], count=n, bitorder="little").astype(np.bool_)
        out.append(bits.reshape(int(qo[r]), int(kv[r])))
    return out
