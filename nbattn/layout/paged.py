"""Paged KV: the page table, and appending tokens to it (docs/concepts/layouts.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .checks import INT32_MAX, CacheDims, LayoutError, as_int32, cache_dims, check_indptr, check_same_dtype, to_numpy
from .ragged import IndptrRows

__all__ = ["PagedKV", "kv_lengths", "gather_kv", "check_causal_lengths", "get_batch_indices_positions",
           "append_slots", "check_append"]


@dataclass(frozen=True)
class PagedKV(IndptrRows):
    """A page table (docs/concepts/layouts.md, "Paged KV cache").

    Request r owns pages ``paged_kv_indices[paged_kv_indptr[r]:paged_kv_indptr[r+1]]``
    in logical order; ``paged_kv_last_page_len[r]`` slots of its last page are
    valid.  A request with no pages has KV length 0 and last_page_len 0.
    """
    paged_kv_indptr: np.ndarray
    paged_kv_indices: np.ndarray
    paged_kv_last_page_len: np.ndarray
    page_size: int
    num_pages: int
    indptr_field = "paged_kv_indptr"

    # -- construction ------------------------------------------------------
    @classmethod
    def validate(cls, paged_kv_indptr: Any, paged_kv_indices: Any, paged_kv_last_page_len: Any,
                 page_size: int, num_pages: int) -> "PagedKV":
        """Check every page-table rule; raise LayoutError naming the argument."""
        indices = as_int32("paged_kv_indices", paged_kv_indices)
        indptr = check_indptr("paged_kv_indptr", paged_kv_indptr, total=len(indices),
                              total_name="len(paged_kv_indices)")
        last = as_int32("paged_kv_last_page_len", paged_kv_last_page_len)
        batch = len(indptr) - 1
        if len(last) != batch:
            raise LayoutError(f"paged_kv_last_page_len: must have one entry per request "
                              f"(len(paged_kv_indptr)-1 = {batch}), got {len(last)}")
        if indices.size:
            lo, hi = int(indices.min()), int(indices.max())
            if lo < 0:
                raise LayoutError(f"paged_kv_indices: page ids must be >= 0, got {lo}")
            if hi >= num_pages:
                raise LayoutError(f"paged_kv_indices: page ids must be < num_pages ({num_pages}), got {hi}")
        n_pages = np.diff(indptr)
        empty = n_pages == 0
        bad = empty & (last != 0)
        if bad.any():
            r = int(np.argmax(bad))
            raise LayoutError(f"paged_kv_last_page_len: request {r} has no pages, so its length must be 0, "
                              f"got {int(last[r])} (empty page list with non-zero length)")
        bad = ~empty & ((last < 1) | (last > page_size))
        if bad.any():
            r = int(np.argmax(bad))
            raise LayoutError(f"paged_kv_last_page_len: must be in 1..page_size ({page_size}) for a request "
                              f"with pages, got {int(last[r])} at request {r}")
        if indices.size * int(page_size) > INT32_MAX:      # only then may a KV length pass int32
            lens = np.where(empty, 0, (n_pages.astype(np.int64) - 1) * int(page_size) + last)
            if lens.max() > INT32_MAX:
                r = int(np.argmax(lens))
                raise LayoutError(f"paged_kv_indptr: request {r} holds {int(lens[r])} keys; a KV length must "
                                  f"fit in int32 (at most {INT32_MAX})")
        return cls(indptr, indices, last, int(page_size), int(num_pages))

    @classmethod
    def from_cache(cls, paged_kv_cache: Any, paged_kv_indptr: Any, paged_kv_indices: Any,
                   paged_kv_last_page_len: Any, kv_layout: str = "NHD") -> tuple["PagedKV", CacheDims]:
        dims = cache_dims(paged_kv_cache, kv_layout)
        return cls.validate(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                            dims.page_size, dims.num_pages), dims

    @classmethod
    def allocate(cls, kv_lens: Sequence[int], page_size: int, *, num_pages: int | None = None,
                 rng: np.random.Generator | None = None) -> "PagedKV":
        """A page table for the given KV lengths: fresh pages, shuffled when
        ``rng`` is given (pages need not be sorted), in a pool of ``num_pages``."""
        lens = np.asarray(kv_lens, dtype=np.int64)
        n = -(-lens // page_size)
        total = int(n.sum())
        pool = total if num_pages is None else int(num_pages)
        if pool < total:
            raise LayoutError(f"num_pages: pool of {pool} pages is too small for {total}")
        ids = np.arange(pool) if rng is None else rng.permutation(pool)
        indices = ids[:total].astype(np.int32)
        indptr = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
        last = np.where(n > 0, lens - (n - 1) * page_size, 0).astype(np.int32)
        return cls(indptr, indices, last, int(page_size), pool)

    # -- queries -------------------------------------------------------------
    @property
    def num_pages_per_request(self) -> np.ndarray:
        return self.counts()

    @property
    def kv_lens(self) -> np.ndarray:
        """``page_size*(n_pages-1) + last_page_len`` per request (0 when no pages)."""
        return kv_lengths(self.paged_kv_indptr, self.paged_kv_last_page_len, self.page_size)

    def pages(self, r: int) -> np.ndarray:
        return self.paged_kv_indices[self.paged_kv_indptr[r]:self.paged_kv_indptr[r + 1]]

    def locate(self, r: int, t: Any) -> tuple[np.ndarray, np.ndarray]:
        """Page id and slot of logical token(s) ``t`` of request ``r``."""
        t = np.asarray(t)
        if t.size and (t.min() < 0 or t.max() >= self.kv_lens[r]):
            raise LayoutError(f"t: token index out of range for request {r} (kv length {self.kv_lens[r]})")
        return self.pages(r)[t // self.page_size], t % self.page_size

    def token_slots(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(page ids, slots) of every logical token of request r, in order."""
        return self.locate(r, np.arange(self.kv_lens[r]))


def kv_lengths(paged_kv_indptr: Any, paged_kv_last_page_len: Any, page_size: int) -> np.ndarray:
    """KV length per request from a page table."""
    indptr = np.asarray(paged_kv_indptr, dtype=np.int64)
    last = np.asarray(paged_kv_last_page_len, dtype=np.int64)
    n = np.diff(indptr)
    return np.where(n > 0, (n - 1) * page_size + last, 0).astype(np.int32)


def gather_kv(paged_kv_cache: np.ndarray, pkv: PagedKV, r: int,
              kv_layout: str = "NHD") -> tuple[np.ndarray, np.ndarray]:
    """Contiguous K and V ``[kv_len, num_kv_heads, head_dim]`` of request r
    (a NumPy gather: the golden model's way of reading pages)."""
    pages, slots = pkv.token_slots(r)
    if kv_layout == "NHD":
        k = paged_kv_cache[pages, 0, slots]
        v = paged_kv_cache[pages, 1, slots]
    else:
        k = paged_kv_cache[pages, 0, :, slots]
        v = paged_kv_cache[pages, 1, :, slots]
    return k, v


def check_causal_lengths(qo_lens: np.ndarray, kv_lens: np.ndarray, *, name: str = "qo_indptr") -> None:
    """A causal request cannot have more queries than keys
    (its new tokens are part of the KV)."""
    bad = qo_lens > kv_lens
    if bad.any():
        r = int(np.argmax(bad))
        raise LayoutError(f"{name}: causal request {r} has qo length {int(qo_lens[r])} > "
                          f"kv length {int(kv_lens[r])} (queries must be the last kv tokens)")


# ---------------------------------------------------------------------------
# Appending new tokens (FlashInfer's append_paged_kv_cache index math)
# ---------------------------------------------------------------------------

def get_batch_indices_positions(append_indptr: Any, seq_lens: Any, nnz: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``nnz`` appended tokens: its request and its logical position.

    ``seq_lens`` are the KV lengths *after* the append, so the tokens of
    request r land at positions ``seq_lens[r]-n_r .. seq_lens[r]-1``.
    """
    indptr = check_indptr("append_indptr", append_indptr, total=nnz, total_name="nnz")
    seq = np.asarray(to_numpy(seq_lens), dtype=np.int64)
    n = np.diff(indptr).astype(np.int64)
    if len(seq) != len(n):
        raise LayoutError(f"seq_lens: must have one entry per request ({len(n)}), got {len(seq)}")
    if (seq < n).any():
        r = int(np.argmax(seq < n))
        raise LayoutError(f"seq_lens: request {r} appends {int(n[r])} tokens but its length is {int(seq[r])}")
    batch = np.repeat(np.arange(len(n)), n).astype(np.int32)
    local = np.arange(nnz) - np.repeat(indptr[:-1].astype(np.int64), n)
    positions = (np.repeat(seq - n, n) + local).astype(np.int32)
    return batch, positions


def append_slots(batch_indices: Any, positions: Any, pkv: PagedKV) -> tuple[np.ndarray, np.ndarray]:
    """Page id and slot for each appended token (batch index, logical position)."""
    b = as_int32("batch_indices", batch_indices)
    p = as_int32("positions", positions)
    if len(b) != len(p):
        raise LayoutError(f"positions: must have one entry per appended token ({len(b)}), got {len(p)}")
    if b.size:
        if b.min() < 0 or b.max() >= pkv.batch_size:
            raise LayoutError(f"batch_indices: must be in 0..{pkv.batch_size - 1}")
        lens = pkv.kv_lens[b]
        bad = (p < 0) | (p >= lens)
        if bad.any():
            i = int(np.argmax(bad))
            raise LayoutError(f"positions: token {i} of request {int(b[i])} has position {int(p[i])} outside "
                              f"its kv length {int(lens[i])} (the page table must already include it)")
    page = pkv.paged_kv_indices[pkv.paged_kv_indptr[b] + p // pkv.page_size]
    return page.astype(np.int32), (p % pkv.page_size).astype(np.int32)


def check_append(append_key: Any, append_value: Any, batch_indices: Any, positions: Any,
                 paged_kv_cache: Any, paged_kv_indptr: Any, paged_kv_indices: Any,
                 paged_kv_last_page_len: Any, kv_layout: str = "NHD", *,
                 check_dtypes: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Validate an append (shapes, dtypes, page table, positions) and return
    the destination page and slot of every appended token.  Reads shapes and
    index metadata only, so it serves host and device caches alike.
    ``check_dtypes=False`` leaves the dtype rule to the caller (the golden
    model's fp8 cache, which quantizes what it writes)."""
    pkv, dims = PagedKV.from_cache(paged_kv_cache, paged_kv_indptr, paged_kv_indices,
                                   paged_kv_last_page_len, kv_layout)
    want = (dims.num_kv_heads, dims.head_dim)
    kshape = tuple(int(x) for x in append_key.shape)
    if len(kshape) != 3 or kshape[1:] != want:
        raise LayoutError(f"append_key: must be [nnz, {want[0]}, {want[1]}], got {kshape}")
    if tuple(int(x) for x in append_value.shape) != kshape:
        raise LayoutError(f"append_value: must match append_key's shape {kshape}, "
                          f"got {tuple(append_value.shape)}")
    if check_dtypes:
        check_same_dtype(append_key=append_key, append_value=append_value, paged_kv_cache=paged_kv_cache)
    if len(as_int32("batch_indices", batch_indices)) != kshape[0]:
        raise LayoutError(f"batch_indices: must have one entry per appended token ({kshape[0]})")
    return append_slots(batch_indices, positions, pkv)
