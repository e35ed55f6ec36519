"""Tile-size heuristic (docs/concepts/scheduler.md).

Two choices are made once per generation step, before planning:

* **Query tile** ``tile_q`` from ``{1, 16, 32, 64, 128}``: the smallest size that
  is at least the batch's average *effective* query length ``l_qo * group``.
  GQA fuses the ``group`` query heads that share one KV head into rows of one
  tile, so a decode step (``l_qo = 1``) with ``group = 4`` already has 4 rows
  per request.  Tile 1 is the CUDA-core decode path; larger tiles are the
  tensor-core prefill path.  When the average exceeds 128 we use 128.

* **KV tile** ``tile_kv`` from ``{32, 64, 128}``: the largest size whose
  shared-memory footprint still lets ``min_ctas_per_sm`` CTAs be resident on
  one SM.  Larger KV tiles mean fewer loop iterations and better load
  efficiency, but a CTA that needs too much shared memory lowers occupancy and
  with it the latency hiding that attention kernels depend on.

Shared-memory model (bytes per CTA), with ``b = elem_bytes`` (2 for fp16/bf16)::

    smem = (tile_q*head_dim + 2*tile_kv*head_dim) * b      # Q tile, K tile, V tile
         + (tile_q*tile_kv + 2*tile_q) * 4                  # fp32 scratch

The fp32 scratch is the score/probability tile ``S = Q K^T`` (``tile_q x tile_kv``)
plus the two per-row online-softmax statistics (running max ``m`` and running
denominator ``d``).  A tensor-core kernel may keep these in registers; numba's
kernels stage them in shared memory, and counting them keeps the model
conservative.  The hardware reserves ``reserved_per_block`` bytes per resident
CTA (1 KiB on Hopper; this is why a block may use 227 KiB of an SM's 228 KiB), so

    resident CTAs per SM = floor(smem_per_sm / (smem + reserved_per_block))

and a single CTA may use at most ``smem_per_block`` bytes.  Defaults describe an
H200 (Hopper): 228 KiB per SM, 227 KiB per block, target 2 CTAs per SM.
Registers and thread counts are not modelled.
"""
from __future__ import annotations

import numpy as np

__all__ = [
    "QUERY_TILES",
    "KV_TILES",
    "H200_SMEM_PER_SM",
    "H200_SMEM_PER_BLOCK",
    "H200_RESERVED_PER_BLOCK",
    "choose_tile_q",
    "decode_tiles",
    "choose_tile_kv",
    "choose_tiles",
    "smem_bytes",
    "resident_ctas",
]

QUERY_TILES = (1, 16, 32, 64, 128)
KV_TILES = (32, 64, 128)

H200_SMEM_PER_SM = 228 * 1024
H200_SMEM_PER_BLOCK = 227 * 1024
H200_RESERVED_PER_BLOCK = 1024


def choose_tile_q(qo_lens, group: int = 1, tiles=QUERY_TILES) -> int:
    """Query tile size for a batch: smallest of ``tiles`` >= mean(l_qo * group).

    This is the one tile rule of the package.  ``tiles`` is the menu of query
    tiles the kernels that will run the step offer, in fused rows:

    * the simulator and :func:`nbattn.sched.plan` default to the paper's menu
      :data:`QUERY_TILES` (a kernel family with every size);
    * :class:`~nbattn.cuda.BatchDecodeWithPagedKVCacheWrapper` offers
      :func:`decode_tiles` (one request's ``group`` fused rows per work item);
    * :class:`~nbattn.cuda.BatchPrefillWithPagedKVCacheWrapper` offers the
      ``T_q`` of the prefill kernel it built (:func:`nbattn.cuda.prefill.make_spec`),
      so the planner cuts query tiles exactly as the kernel runs them.

    ``qo_lens`` are query lengths in positions (tokens); ``group`` is
    ``num_qo_heads // num_kv_heads``.  The average is taken over all requests of
    the batch, empty ones included (they are part of the step).  An empty batch
    gets the smallest tile; averages above the largest tile get the largest.
    """
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    menu = sorted(int(t) for t in tiles)
    if not menu or menu[0] < 1:
        raise ValueError(f"tiles must be a non-empty list of positive sizes, got {tuple(tiles)!r}")
    lens = np.asarray(qo_lens, dtype=np.int64).reshape(-1)
    if lens.size == 0:
        return menu[0]
    if np.any(lens < 0):
        raise ValueError("qo_lens must be non-negative")
    average = float(lens.mean()) * group
    for tile in menu:
        if tile >= average:
            return tile
    return menu[-1]


def decode_tiles(group: int) -> tuple[int]:
    """The decode kernels' menu for :func:`choose_tile_q`: one tile of ``group``
    fused rows (a request's query heads of one KV head, at one position)."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    return (int(group),)


def smem_bytes(tile_q: int, tile_kv: int, head_dim: int, elem_bytes: int = 2) -> int:
    """Shared memory one CTA needs under the model in the module docstring."""
    from .._checks import int_arg
    for name, x in (("tile_q", tile_q), ("tile_kv", tile_kv), ("head_dim", head_dim),
                    ("elem_bytes", elem_bytes)):
        int_arg(name, x, minimum=0)
    operands = (tile_q * head_dim + 2 * tile_kv * head_dim) * elem_bytes
    scratch = (tile_q * tile_kv + 2 * tile_q) * 4
    return operands + scratch


def resident_ctas(
    smem: int,
    smem_per_sm: int = H200_SMEM_PER_SM,
    smem_per_block: int = H200_SMEM_PER_BLOCK,
    reserved_per_block: int = H200_RESERVED_PER_BLOCK,
) -> int:
    """How many CTAs needing ``smem`` bytes fit on one SM (0 if one does not fit)."""
    if smem > smem_per_block:
        return 0
    return smem_per_sm // (smem + reserved_per_block)


def choose_tile_kv(
    tile_q: int,
    head_dim: int,
    elem_bytes: int = 2,
    *,
    smem_per_sm: int = H200_SMEM_PER_SM,
    smem_per_block: int = H200_SMEM_PER_BLOCK,
    reserved_per_block: int = H200_RESERVED_PER_BLOCK,
    min_ctas_per_sm: int = 2,
) -> int:
    """Largest KV tile of ``KV_TILES`` that keeps ``min_ctas_per_sm`` CTAs resident.

    If no tile reaches the residency target, the smallest tile that fits in one
    block at all is returned (best effort: occupancy is then below target).  If
    not even that fits, a ValueError is raised.
    """
    if tile_q < 1 or head_dim < 1 or elem_bytes < 1:
        raise ValueError("tile_q, head_dim and elem_bytes must be positive")
    for tile_kv in sorted(KV_TILES, reverse=True):
        smem = smem_bytes(tile_q, tile_kv, head_dim, elem_bytes)
        if resident_ctas(smem, smem_per_sm, smem_per_block, reserved_per_block) >= min_ctas_per_sm:
            return tile_kv
    smallest = min(KV_TILES)
    smem = smem_bytes(tile_q, smallest, head_dim, elem_bytes)
    if resident_ctas(smem, smem_per_sm, smem_per_block, reserved_per_block) >= 1:
        return smallest
    raise ValueError(
        f"no KV tile fits: tile_q={tile_q}, head_dim={head_dim}, elem_bytes={elem_bytes} "
        f"needs {smem} bytes of shared memory with tile_kv={smallest}, "
        f"more than the per-block limit of {smem_per_block} bytes"
    )


def choose_tiles(qo_lens, group: int, head_dim: int, elem_bytes: int = 2, **smem_kwargs):
    """Both tile sizes for one batch: ``(tile_q, tile_kv)``."""
    tile_q = choose_tile_q(qo_lens, group)
    return tile_q, choose_tile_kv(tile_q, head_dim, elem_bytes, **smem_kwargs)
