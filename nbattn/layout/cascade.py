"""Composable formats for the cascade: shared-prefix and unique-suffix levels of a page table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .checks import LayoutError
from .paged import PagedKV
from .ragged import RaggedQ

__all__ = ["CascadeLevel", "validate_cascade", "cascade_keys", "cascade_decompose"]


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
