"""Where queries and KV live: ragged Q, paged KV, BSR views (docs/concepts/layouts.md).

One module that the golden model (:mod:`nbattn.reference`), the kernels
(:mod:`nbattn.cuda`) and the scheduler (:mod:`nbattn.sched`) all use, so a
layout rule is written once and checked once.

Everything here works on *index arrays only*: building a view never touches or
copies KV data.  Validation raises :class:`LayoutError` (a ``ValueError``) whose
message starts with the argument's name and states the rule it broke; it runs
before anything is computed or modified.

Names follow FlashInfer: ``qo_indptr``, ``paged_kv_indptr``,
``paged_kv_indices``, ``paged_kv_last_page_len``, ``kv_layout`` ("NHD" or "HND").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

KV_LAYOUTS = ("NHD", "HND")


class LayoutError(ValueError):
    """Invalid layout metadata or tensor shapes; the message names the argument."""


# ---------------------------------------------------------------------------
# Host conversion and primitive checks
# ---------------------------------------------------------------------------

def to_numpy(x: Any) -> np.ndarray:
    """A host NumPy view/copy of a NumPy array, torch tensor, numba device
    array or anything with ``__array__``; lists become arrays."""
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__
    if mod.startswith("torch"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":    # NumPy has no bf16: widen exactly to float32
            x = x.float()
        return x.numpy()
    if hasattr(x, "copy_to_host"):  # numba device array
        return x.copy_to_host()
    return np.asarray(x)


def dtype_of(x: Any) -> str:
    """The element type's name, without converting (``'int32'``, ``'float16'``...)."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        return "python-list"
    return str(dt).replace("torch.", "")


_I32 = np.iinfo(np.int32)


def _on_device(x: Any) -> bool:
    """Whether ``x`` lives in GPU memory (a CUDA torch tensor, a numba device
    array, or anything exposing ``__cuda_array_interface__``)."""
    if type(x).__module__.startswith("torch"):
        return getattr(getattr(x, "device", None), "type", "cpu") != "cpu"
    return hasattr(x, "copy_to_host") or hasattr(x, "__cuda_array_interface__")


def _fit_int32(name: str, arr: np.ndarray) -> np.ndarray:
    if arr.size and (int(arr.min()) < _I32.min or int(arr.max()) > _I32.max):
        raise LayoutError(f"{name}: values do not fit in int32 "
                          f"(range {int(arr.min())}..{int(arr.max())})")
    return arr.astype(np.int32)


def as_int32(name: str, x: Any) -> np.ndarray:
    """Host int32 1-D array of index metadata.

    Index metadata is int32.  A Python list or tuple of ints, and a host
    (NumPy or CPU torch) array of another integer type such as int64, is
    checked to fit in int32 and converted.  A device array must already be
    int32: kernels read it in place, so converting it would be a hidden copy.
    Floating-point and boolean arrays are refused.
    """
    if type(x) is np.ndarray and x.dtype == np.int32 and x.ndim == 1:
        return x                                   # the common case, with nothing to convert
    if isinstance(x, (list, tuple)):
        try:
            arr = np.asarray(x, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise LayoutError(f"{name}: must be a list of integers") from None
        arr = _fit_int32(name, arr)
    else:
        dt = dtype_of(x)
        if dt != "int32":
            integer = dt in ("int64", "int16", "int8", "uint8", "uint16", "uint32", "uint64")
            if not integer:
                raise LayoutError(f"{name}: must be int32 (host int64 arrays and lists are "
                                  f"converted), got {dt}")
            if _on_device(x):
                raise LayoutError(f"{name}: must be int32 on the device, got {dt}; convert it "
                                  f"once with .to(torch.int32) (or .astype(np.int32))")
            arr = _fit_int32(name, to_numpy(x))
        else:
            arr = to_numpy(x)
    if arr.ndim != 1:
        raise LayoutError(f"{name}: must be 1-D, got shape {tuple(arr.shape)}")
    return arr


def check_indptr(name: str, indptr: Any, *, total: int | None = None,
                 total_name: str = "") -> np.ndarray:
    """A CSR row pointer: int32, length >= 1, starts at 0, non-decreasing,
    and (when ``total`` is given) ends at ``total``."""
    arr = as_int32(name, indptr)
    if arr.size == 0:
        raise LayoutError(f"{name}: must have length batch_size+1 >= 1, got empty")
    if arr[0] != 0:
        raise LayoutError(f"{name}: must start at 0, got {int(arr[0])}")
    d = np.diff(arr.astype(np.int64))
    if d.size and d.min() < 0:
        i = int(np.argmax(d < 0))
        raise LayoutError(f"{name}: must be non-decreasing, but {name}[{i + 1}]={int(arr[i + 1])} "
                          f"< {name}[{i}]={int(arr[i])}")
    if total is not None and int(arr[-1]) != int(total):
        what = total_name or "the number of entries"
        raise LayoutError(f"{name}: must end at {what} ({int(total)}), got {int(arr[-1])}")
    return arr


def check_kv_layout(kv_layout: str) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise LayoutError(f"kv_layout: must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    return kv_layout


# ---------------------------------------------------------------------------
# Paged KV cache tensor
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class CacheDims:
    """Sizes read off a paged KV cache tensor."""
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    kv_layout: str


def cache_dims(paged_kv_cache: Any, kv_layout: str = "NHD") -> CacheDims:
    """Read (num_pages, page_size, num_kv_heads, head_dim) from the cache shape.

    NHD: ``[num_pages, 2, page_size, num_kv_heads, head_dim]``;
    HND: ``[num_pages, 2, num_kv_heads, page_size, head_dim]``.
    """
    check_kv_layout(kv_layout)
    shape = tuple(int(s) for s in paged_kv_cache.shape)
    if len(shape) != 5 or shape[1] != 2:
        raise LayoutError(f"paged_kv_cache: must have shape [num_pages, 2, ...] with 5 dims "
                          f"({kv_layout}), got {shape}")
    if kv_layout == "NHD":
        n, _, ps, h, d = shape
    else:
        n, _, h, ps, d = shape
    if ps < 1 or h < 1 or d < 1:
        raise LayoutError(f"paged_kv_cache: page_size, num_kv_heads and head_dim must be >= 1, got {shape}")
    return CacheDims(n, ps, h, d, kv_layout)


def check_heads(num_qo_heads: int, num_kv_heads: int) -> int:
    """GQA group size; num_kv_heads must divide num_qo_heads."""
    if num_kv_heads < 1 or num_qo_heads < 1 or num_qo_heads % num_kv_heads:
        raise LayoutError(f"num_qo_heads: must be a positive multiple of num_kv_heads "
                          f"({num_kv_heads}), got {num_qo_heads}")
    return num_qo_heads // num_kv_heads


def check_q(q: Any, head_dim: int, *, name: str = "q", rows: int | None = None,
            ndim: int = 3) -> tuple[int, ...]:
    """Shape checks of a query tensor against the KV's head_dim and row count."""
    shape = tuple(int(s) for s in q.shape)
    if len(shape) != ndim:
        want = "[rows, num_qo_heads, head_dim]" if ndim == 3 else "[num_qo_heads, head_dim]"
        raise LayoutError(f"{name}: must have shape {want}, got {shape}")
    if shape[-1] != head_dim:
        raise LayoutError(f"{name}: head_dim {shape[-1]} does not match the KV's head_dim {head_dim}")
    if rows is not None and shape[0] != rows:
        raise LayoutError(f"{name}: has {shape[0]} rows but qo_indptr[-1] is {rows}")
    return shape


def check_same_device(**tensors: Any) -> None:
    """All array arguments on one device (host NumPy counts as 'cpu')."""
    devs = {}
    for name, t in tensors.items():
        if t is None:
            continue
        dev = getattr(t, "device", None)
        if dev is None:
            dev = "cuda" if hasattr(t, "__cuda_array_interface__") else "cpu"
        devs[name] = str(getattr(dev, "type", dev)).split(":")[0]
    if len(set(devs.values())) > 1:
        listing = ", ".join(f"{k} on {v}" for k, v in devs.items())
        raise LayoutError(f"{next(iter(devs))}: all tensors must be on one device, got {listing}")


def check_same_dtype(**tensors: Any) -> None:
    dts = {k: dtype_of(v) for k, v in tensors.items() if v is not None}
    if len(set(dts.values())) > 1:
        listing = ", ".join(f"{k}={v}" for k, v in dts.items())
        name = list(dts)[-1]
        raise LayoutError(f"{name}: dtype must match the other inputs, got {listing}")


# ---------------------------------------------------------------------------
# Ragged queries
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RaggedQ:
    """Requests packed back to back: rows of request r are
    ``qo_indptr[r]:qo_indptr[r+1]``."""
    qo_indptr: np.ndarray

    @classmethod
    def from_lengths(cls, qo_lens: Sequence[int]) -> "RaggedQ":
        lens = np.asarray(qo_lens, dtype=np.int64)
        if lens.size and lens.min() < 0:
            raise LayoutError("qo_lens: must be >= 0")
        return cls(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))

    @classmethod
    def validate(cls, qo_indptr: Any, *, total_rows: int | None = None,
                 name: str = "qo_indptr") -> "RaggedQ":
        return cls(check_indptr(name, qo_indptr, total=total_rows, total_name="the number of query rows"))

    @property
    def batch_size(self) -> int:
        return len(self.qo_indptr) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.qo_indptr).astype(np.int32)

    @property
    def total(self) -> int:
        return int(self.qo_indptr[-1])


# ---------------------------------------------------------------------------
# Paged KV page table
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PagedKV:
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
    def batch_size(self) -> int:
        return len(self.paged_kv_indptr) - 1

    @property
    def num_pages_per_request(self) -> np.ndarray:
        return np.diff(self.paged_kv_indptr).astype(np.int32)

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


# ---------------------------------------------------------------------------
# BSR views
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# Composable formats (cascade): shared-prefix and unique-suffix views
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class CascadeLevel:
    """One level of a multi-level cascade: a page table whose
    block rows are groups of consecutive requests.  ``qo_indptr`` partitions the
    query rows into the groups that attend this level's pages together."""
    qo_indptr: np.ndarray
    paged_kv_indptr: np.ndarray
    paged_kv_indices: np.ndarray
    paged_kv_last_page_len: np.ndarray


def validate_cascade(levels: Sequence[Any], page_size: int, num_pages: int,
                     total_rows: int | None = None) -> list[tuple[RaggedQ, PagedKV]]:
    """Check each level's page table, that all levels cover the same rows, and
    that each level's groups are unions of the last level's requests."""
    if len(levels) == 0:
        raise LayoutError("levels: at least one level is required")
    out = []
    for i, lv in enumerate(levels):
        if not isinstance(lv, CascadeLevel) and (not isinstance(lv, (tuple, list)) or len(lv) != 4):
            got = f"a {len(lv)}-tuple" if isinstance(lv, (tuple, list)) else type(lv).__name__
            raise LayoutError(f"levels[{i}]: must be a CascadeLevel or a 4-tuple (qo_indptr, paged_kv_indptr, "
                              f"paged_kv_indices, paged_kv_last_page_len), got {got}")
        qo, ip, ix, lp = (lv.qo_indptr, lv.paged_kv_indptr, lv.paged_kv_indices,
                          lv.paged_kv_last_page_len) if isinstance(lv, CascadeLevel) else lv
        q = RaggedQ.validate(qo, total_rows=total_rows, name=f"levels[{i}].qo_indptr")
        try:
            p = PagedKV.validate(ip, ix, lp, page_size, num_pages)
        except LayoutError as e:
            raise LayoutError(f"levels[{i}].{e}") from None
        if p.batch_size != q.batch_size:
            raise LayoutError(f"levels[{i}].paged_kv_indptr: has {p.batch_size} groups, "
                              f"qo_indptr has {q.batch_size}")
        out.append((q, p))
    last = set(out[-1][0].qo_indptr.tolist())
    for i, (q, _) in enumerate(out[:-1]):
        if q.total != out[-1][0].total:
            raise LayoutError(f"levels[{i}].qo_indptr: covers {q.total} rows, the last level {out[-1][0].total}")
        if not set(q.qo_indptr.tolist()) <= last:
            raise LayoutError(f"levels[{i}].qo_indptr: each group must be a union of the last level's requests")
    return out


def cascade_keys(levels: list[tuple[RaggedQ, PagedKV]]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Where each request of validated cascade ``levels`` finds its keys:
    ``(group_of, total, offsets)`` with ``group_of[l][r]`` the group of level l
    that request r reads, ``total[r]`` its key count over all levels and
    ``offsets[l, r]`` where level l's keys start in its key sequence."""
    req_q = levels[-1][0]
    # a request with no query rows may sit on a group boundary: any group will do, it computes nothing
    group_of = [np.clip(np.searchsorted(qo.qo_indptr, req_q.qo_indptr[:-1], side="right") - 1,
                        0, qo.batch_size - 1) for qo, _ in levels]
    lens = np.stack([p.kv_lens[g] for (_, p), g in zip(levels, group_of)]).astype(np.int64)  # [levels, nreq]
    offsets = np.concatenate([np.zeros((1, req_q.batch_size), np.int64), np.cumsum(lens, axis=0)[:-1]])
    return group_of, lens.sum(axis=0), offsets


def cascade_decompose(qo_indptr: Any, pkv: PagedKV) -> list[CascadeLevel]:
    """Split a flat page table into a shared-prefix level and a unique-suffix level.

    Consecutive requests whose page lists start with the same full pages form
    a group; the group's longest common run of full pages becomes one block row
    of level 0 (attended once for all the group's queries); what remains of
    each request is level 1.  Only index arrays are built (no KV copy).
    """
    q = RaggedQ.validate(qo_indptr)
    b, ps = pkv.batch_size, pkv.page_size

    def full_pages(r: int) -> np.ndarray:  # pages that are full for request r
        pages = pkv.pages(r)
        n_full = len(pages) if (len(pages) and pkv.paged_kv_last_page_len[r] == ps) else max(len(pages) - 1, 0)
        return pages[:n_full]

    groups, prefix = [], []
    r = 0
    while r < b:
        common = full_pages(r)
        s = r + 1
        while s < b and len(common):
            fp = full_pages(s)
            n = 0
            while n < min(len(common), len(fp)) and common[n] == fp[n]:
                n += 1
            if n == 0:
                break
            common = common[:n]
            s += 1
        if s - r == 1:
            common = common[:0]  # a lone request shares nothing
        groups.append((r, s))
        prefix.append(common)
        r = s
    g_qo = np.asarray([q.qo_indptr[a] for a, _ in groups] + [q.total], dtype=np.int32)
    g_indptr = np.concatenate([[0], np.cumsum([len(p) for p in prefix])]).astype(np.int32)
    g_indices = (np.concatenate(prefix) if prefix else np.zeros(0)).astype(np.int32)
    g_last = np.asarray([ps if len(p) else 0 for p in prefix], dtype=np.int32)
    s_indptr, s_indices, s_last = [0], [], []
    for gi, (a, z) in enumerate(groups):
        for rr in range(a, z):
            rest = pkv.pages(rr)[len(prefix[gi]):]
            s_indices.append(rest)
            s_indptr.append(s_indptr[-1] + len(rest))
            s_last.append(int(pkv.paged_kv_last_page_len[rr]) if len(rest) else 0)
    return [CascadeLevel(g_qo, g_indptr, g_indices, g_last),
            CascadeLevel(q.qo_indptr.copy(), np.asarray(s_indptr, np.int32),
                         (np.concatenate(s_indices) if s_indices else np.zeros(0)).astype(np.int32),
                         np.asarray(s_last, np.int32))]
