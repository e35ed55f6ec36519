"""BSR views: block compressed sparse rows, and the page table seen as one (docs/concepts/layouts.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .checks import LayoutError, as_int32, check_indptr
from .paged import PagedKV
from .ragged import RaggedQ

__all__ = ["BSR", "page_table_to_bsr", "bsr_to_page_table"]


@dataclass(frozen=True)
class BSR:
    """Block compressed sparse rows (docs/concepts/layouts.md).

    ``shape = (M, N)`` in elements (query rows x key columns); blocks are
    ``block_shape = (B_r, B_c)``; a partial last block row/column is allowed
    (M, N need not be multiples).  Block row i reads column blocks
    ``col_indices[row_ptr[i]:row_ptr[i+1]]``; their order is kept (for a page
    table it is the logical token order).
    """
    row_ptr: np.ndarray
    col_indices: np.ndarray
    block_shape: tuple[int, int]
    shape: tuple[int, int]

    @classmethod
    def validate(cls, row_ptr: Any, col_indices: Any, block_shape: tuple[int, int],
                 shape: tuple[int, int]) -> "BSR":
        br, bc = (int(x) for x in block_shape)
        if br < 1 or bc < 1:
            raise LayoutError(f"block_shape: both sides must be positive integers, got {block_shape}")
        m, n = (int(x) for x in shape)
        if m < 0 or n < 0:
            raise LayoutError(f"shape: must be non-negative, got {shape}")
        cols = as_int32("col_indices", col_indices)
        rp = check_indptr("row_ptr", row_ptr, total=len(cols), total_name="len(col_indices)")
        nbr, nbc = -(-m // br), -(-n // bc)
        if len(rp) - 1 != nbr:
            raise LayoutError(f"row_ptr: must have ceil(M/B_r)+1 = {nbr + 1} entries, got {len(rp)}")
        if cols.size and (cols.min() < 0 or cols.max() >= nbc):
            raise LayoutError(f"col_indices: block ids must be in 0..{nbc - 1} (ceil(N/B_c)), "
                              f"got {int(cols.min())}..{int(cols.max())}")
        for i in range(nbr):  # duplicates would attend a key twice
            row = cols[rp[i]:rp[i + 1]]
            if len(np.unique(row)) != len(row):
                raise LayoutError(f"col_indices: block row {i} lists a column block twice")
        return cls(rp, cols, (br, bc), (m, n))

    @classmethod
    def check(cls, bsr: Any, name: str = "bsr") -> "BSR":
        """``bsr`` validated again whatever built it (a ``BSR(...)`` made directly
        skips :meth:`validate`: column -1 or past the last block would read
        other keys, or out of bounds on a GPU)."""
        if not isinstance(bsr, cls):
            raise LayoutError(f"{name}: must be an nbattn.layout.BSR, got {type(bsr).__name__}")
        try:
            return cls.validate(bsr.row_ptr, bsr.col_indices, bsr.block_shape, bsr.shape)
        except LayoutError as e:
            raise LayoutError(f"{name}: {e}") from None

    @property
    def n_block_rows(self) -> int:
        return -(-self.shape[0] // self.block_shape[0])

    @property
    def n_block_cols(self) -> int:
        return -(-self.shape[1] // self.block_shape[1])

    @property
    def nnz_blocks(self) -> int:
        return len(self.col_indices)

    def to_block_mask(self) -> np.ndarray:
        """Dense boolean ``[n_block_rows, n_block_cols]`` (order is lost)."""
        mask = np.zeros((self.n_block_rows, self.n_block_cols), dtype=bool)
        rows = np.repeat(np.arange(self.n_block_rows), np.diff(self.row_ptr))
        mask[rows, self.col_indices] = True
        return mask

    @classmethod
    def from_block_mask(cls, mask: np.ndarray, block_shape: tuple[int, int],
                        shape: tuple[int, int] | None = None) -> "BSR":
        """From a dense boolean block mask; columns come out sorted."""
        mask = np.asarray(mask, dtype=bool)
        br, bc = block_shape
        if shape is None:
            shape = (mask.shape[0] * br, mask.shape[1] * bc)
        rows, cols = np.nonzero(mask)
        row_ptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=mask.shape[0]))])
        return cls.validate(row_ptr.astype(np.int32), cols.astype(np.int32), block_shape, shape)

    def to_element_mask(self) -> np.ndarray:
        """Dense boolean ``[M, N]``: which query row may read which key."""
        br, bc = self.block_shape
        m, n = self.shape
        block = self.to_block_mask()
        return np.repeat(np.repeat(block, br, axis=0), bc, axis=1)[:m, :n]


def page_table_to_bsr(qo_indptr: Any, pkv: PagedKV, tile_q: int = 1) -> BSR:
    """The page table as a BSR matrix over (query rows) x (page-pool slots).

    ``B_c = page_size`` and column block ``p`` is page ``p`` of the pool.
    ``B_r = tile_q``; each request's query rows must start on a tile boundary
    (``qo_indptr`` values multiples of ``tile_q``) so that a block row belongs to
    one request.  Decode is ``tile_q = 1`` with one row per request.  The last
    page's partial validity is not a BSR notion: keep ``paged_kv_last_page_len``
    to convert back (:func:`bsr_to_page_table`).
    """
    q = RaggedQ.validate(qo_indptr)
    if q.batch_size != pkv.batch_size:
        raise LayoutError(f"qo_indptr: has {q.batch_size} requests, the page table has {pkv.batch_size}")
    if (q.qo_indptr % tile_q).any():
        raise LayoutError(f"qo_indptr: every request must start on a multiple of tile_q ({tile_q}) "
                          f"to form block rows, got {q.qo_indptr.tolist()}")
    tiles = q.lengths // tile_q + (q.lengths % tile_q > 0)
    row_ptr = [0]
    cols = []
    for r in range(q.batch_size):
        for _ in range(int(tiles[r])):
            cols.append(pkv.pages(r))
            row_ptr.append(row_ptr[-1] + len(pkv.pages(r)))
    col = np.concatenate(cols).astype(np.int32) if cols else np.zeros(0, np.int32)
    return BSR.validate(np.asarray(row_ptr, np.int32), col, (tile_q, pkv.page_size),
                        (q.total, pkv.num_pages * pkv.page_size))


def bsr_to_page_table(bsr: BSR, qo_indptr: Any, kv_lens: Sequence[int]) -> PagedKV:
    """Inverse of :func:`page_table_to_bsr`: each request's first block row
    gives its page list; ``kv_lens`` restores the last page's valid length."""
    q = RaggedQ.validate(qo_indptr, total_rows=bsr.shape[0])
    br, page_size = bsr.block_shape
    lens = np.asarray(kv_lens, dtype=np.int64)
    indptr, indices = [0], []
    for r in range(q.batch_size):
        row = int(q.qo_indptr[r]) // br
        pages = bsr.col_indices[bsr.row_ptr[row]:bsr.row_ptr[row + 1]] if q.lengths[r] else np.zeros(0, np.int32)
        indices.append(pages)
        indptr.append(indptr[-1] + len(pages))
    n = np.diff(indptr)
    last = np.where(n > 0, lens - (n - 1) * page_size, 0).astype(np.int32)
    return PagedKV.validate(np.asarray(indptr, np.int32), np.concatenate(indices).astype(np.int32),
                            last, page_size, bsr.n_block_cols)
