"""Which prefill tile a call gets, its tile sizes, and the compiled-kernel cache.

:func:`make_spec` sizes a :class:`~nbattn.cuda.kernels.prefill_common.KernelSpec`
(:func:`kernel_tiles`) and :func:`get_tile` builds its tile:

- tensor cores (GPU, fp16/bf16, head_dim a multiple of 16 up to 256):
  :func:`~nbattn.cuda.kernels.prefill_pipelined.pipelined_tile` for head_dim 64
  and 128, :func:`~nbattn.cuda.kernels.prefill_mma.mma_tile` for the others;
- CUDA cores: the register-tiled
  :func:`~nbattn.cuda.kernels.prefill_cc.cuda_core_tile` where its shapes cover the
  head_dim and ``PrefillTuning.cuda_core`` is on, else the teaching tile
  :func:`~nbattn.cuda.kernels.prefill_core.core_tile`.

Every cache here is keyed by the spec, so by its tuning too (a frozen
:class:`~nbattn.cuda.tuning.PrefillTuning`): two calls with different tunings
never share a kernel.  :func:`generated_source` shows the straight-line source a
fast tile compiles (docs/concepts/generated_kernels.md).
"""
from __future__ import annotations

import re

from ... import layout as L
from ...variants import Variant
from ..blocks import mma as _mma
from ..blocks.primitives import SIMULATOR
from ..tuning import PREFILL, PrefillTuning
from . import prefill_cc as CC
from . import prefill_mma as MMA
from . import prefill_pipelined as PIPE
from .prefill_common import KernelSpec, masked_entry, masked_persistent_entry, persistent_entry, prefill_entry
from .prefill_core import core_tile

__all__ = ["make_spec", "kernel_tiles", "tensor_core_tiles", "tensor_cores_usable", "tensor_core_tile",
           "get_tile", "get_kernel", "get_persistent_kernel", "generated_source", "KERNELS"]

KERNELS: dict = {}      # tiles and compiled kernels, keyed by (what, spec)


def tensor_core_tiles(head_dim: int) -> tuple[int, int, int]:
    """(T_q, T_k, threads): 16 fused rows per warp, static shared memory under
    48 KB.  head_dim 64/128: the pipelined tile (one K and one V tile of 64
    keys, rows padded by 16 bytes: 34.8 KB at d128).  Others: the mma tile
    (Q, K and V^T tiles as packed uint32 pairs, rows padded by 4 words so the
    fragment reads hit 32 distinct banks)."""
    if PIPE.fast_path(head_dim):
        return 64, 64, 128
    if head_dim <= 64:
        return 64, 64, 128
    if head_dim <= 128:
        return 64, 32, 128
    return 32, 16, 64


def tensor_cores_usable(kind: str, head_dim: int, variant: Variant) -> bool:
    return (_mma.AVAILABLE and kind in ("f16", "bf16") and head_dim % 16 == 0
            and head_dim <= 256)


def kernel_tiles(head_dim: int, kind: str, tensor_cores: bool,
                 tuning: PrefillTuning = PREFILL, teaching: bool = False) -> tuple[int, int, int]:
    """(T_q, T_k, threads) of a prefill kernel build.  A build offers one query
    tile, ``T_q``; the planners pick a step's tile with the package's one rule,
    :func:`nbattn.sched.tiles.choose_tile_q`, over that menu.  The simulator gets
    small tiles (each thread is a Python thread); the teaching tile fits its
    shared memory in 48 KB.  ``teaching`` asks for the teaching tile whatever
    else covers the shape (RoPE at attention time off the tensor cores, a custom mask)."""
    if tensor_cores:
        return tensor_core_tiles(head_dim)
    cc = None if teaching else CC.cuda_core_tiles(head_dim, kind, tuning)
    if cc is not None:
        return cc
    if SIMULATOR:
        return 16, 16, 32
    budget = 48 * 1024 - 512
    for tq, tk in ((64, 32), (32, 32), (32, 16), (16, 16), (16, 8), (8, 8)):
        need = 4 * (2 * tq * head_dim + 2 * tk * head_dim + tq * tk)
        if need <= budget:
            return tq, tk, 128
    raise L.LayoutError(f"q: head_dim {head_dim} too large for the CUDA-core path")


def make_spec(mode: str, kv_layout: str, kind: str, head_dim: int, num_qo_heads: int,
              num_kv_heads: int, variant: Variant, tensor_cores: bool | None = None,
              out_kind: str | None = None, *, tuning: PrefillTuning | None = None,
              custom_mask: bool = False) -> KernelSpec:
    """The spec of one build; ``tensor_cores`` None picks tensor cores where usable,
    ``tuning`` None is :data:`~nbattn.cuda.tuning.PREFILL`; ``custom_mask`` a build that
    reads a runtime mask (:func:`~nbattn.cuda.kernels.prefill_common.masked_entry`)."""
    tuning = PREFILL if tuning is None else tuning
    rope = variant.has_rope
    # RoPE turns q and K in the teaching tile, and in the pipelined tensor-core tile
    # (head_dim 64 / 128, keys with positions: not block-sparse)
    rope_tc = rope and mode != "bsr" and PIPE.fast_path(int(head_dim))
    if rope and tensor_cores and not rope_tc:
        raise ValueError("tensor_cores: pos_encoding_mode='ROPE_LLAMA' runs on the tensor cores only for head_dim "
                         "64 or 128 and not block-sparse, else on the CUDA-core teaching tile; pass "
                         "tensor_cores=None or False")
    if custom_mask and tensor_cores:
        raise ValueError("tensor_cores: a custom mask is read by the CUDA-core teaching tile; "
                         "pass tensor_cores=None or False")
    if rope and head_dim % 2:
        raise ValueError(f"pos_encoding_mode: 'ROPE_LLAMA' needs an even head_dim, got {head_dim}")
    use_tc = (not custom_mask and (rope_tc or not rope) and tensor_cores_usable(kind, head_dim, variant)) \
        if tensor_cores is None else bool(tensor_cores)
    if use_tc and not tensor_cores_usable(kind, head_dim, variant):
        raise ValueError("tensor_cores: needs a GPU, fp16/bf16 and head_dim a multiple of 16 up to 256")
    teaching = custom_mask or (rope and not use_tc)     # the kernels that only the teaching tile computes
    tq, tk, nt = kernel_tiles(head_dim, kind, use_tc, tuning, teaching=teaching)
    return KernelSpec(mode, kv_layout, kind, out_kind or kind, int(head_dim), num_qo_heads // num_kv_heads,
                      int(num_qo_heads), variant, use_tc, tq, tk, nt, tuning, bool(custom_mask))


def tensor_core_tile(spec: KernelSpec):
    """The per-row body of a tensor-core build: the pipelined tile for head_dim 64
    and 128, the mma tile for the other multiples of 16."""
    return PIPE.pipelined_tile(spec) if PIPE.fast_path(spec.head_dim) else MMA.mma_tile(spec)


def get_tile(spec: KernelSpec):
    """The per-row body of a kernel build (device function), cached by spec."""
    key = ("tile", spec)
    tile = KERNELS.get(key)
    if tile is None:
        if spec.tensor_cores:
            tile = tensor_core_tile(spec)
        elif CC.covers(spec):
            tile = CC.cuda_core_tile(spec)
        else:
            tile = core_tile(spec)
        KERNELS[key] = tile
    return tile


def _entry_kernel(key, entry, spec: KernelSpec):
    kern = KERNELS.get(key)
    if kern is None:
        kern = entry(get_tile(spec), CC.launch_bounds(spec))
        kern.dynamic_smem = CC.dynamic_smem(spec)
        KERNELS[key] = kern
    return kern


def get_kernel(spec: KernelSpec):
    """:func:`~nbattn.cuda.kernels.prefill_common.prefill_entry` of a spec, compiled once per spec."""
    return _entry_kernel(spec, masked_entry if spec.custom_mask else prefill_entry, spec)


def get_persistent_kernel(spec: KernelSpec):
    """:func:`~nbattn.cuda.kernels.prefill_common.persistent_entry` of a spec, cached."""
    return _entry_kernel(("persistent", spec), masked_persistent_entry if spec.custom_mask else persistent_entry,
                         spec)


def generated_source(spec: KernelSpec, name: str | None = None) -> str:
    """The straight-line source the spec's tile generates and compiles (its
    fragment or micro-kernel functions), or only the function ``name`` of it; ""
    for the teaching tile, which generates nothing.  Pure Python: a tensor-core
    spec's source is shown on a machine without a GPU too."""
    if spec.tensor_cores:
        text = PIPE.source(spec) if PIPE.fast_path(spec.head_dim) else MMA.source(spec)
    elif CC.covers(spec):
        text = CC.source(spec)
    else:
        text = ""
    if name is None:
        return text
    found = re.search(rf"^def {re.escape(name)}\(.*?(?=^def |\Z)", text, re.S | re.M)
    if found is None:
        raise KeyError(f"name: the generated source of this spec has no function {name!r}")
    return found.group(0)
