"""Layout figures: the page table as a BSR matrix (paper Figure 2), composable
formats (Figure 3) and the bottom-right causal mask, all for the worked
three-request batch (docs/concepts/layouts.md)."""
from __future__ import annotations

import numpy as np

from .. import layout as L


def spec4_batch() -> tuple[np.ndarray, L.PagedKV]:
    """The example batch: page size 4; R0 3+3 tokens, R1 1+1, R2 4+5."""
    qo_indptr = np.array([0, 3, 4, 8], np.int32)
    pkv = L.PagedKV.validate(np.array([0, 2, 3, 6], np.int32), np.array([7, 2, 11, 3, 14, 6], np.int32),
                             np.array([2, 2, 1], np.int32), page_size=4, num_pages=16)
    return qo_indptr, pkv


def causal_visibility(qo_indptr: np.ndarray, kv_lens: np.ndarray) -> list[np.ndarray]:
    """Per request, the boolean [Q, K] bottom-right causal mask."""
    out = []
    for q, k in zip(np.diff(qo_indptr), kv_lens):
        i = np.arange(q)[:, None]
        j = np.arange(k)[None, :]
        out.append(j <= k - q + i)
    return out


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _write(plt, fig, path):
    """Lay ``fig`` out, write it to ``path`` (120 dpi) and close it; returns ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def page_table_bsr(path, results_root=None):
    """Figure 2: query rows x page-pool slots; each request reads its pages."""
    plt = _plt()
    qo_indptr, pkv = spec4_batch()
    bsr = L.page_table_to_bsr(np.arange(pkv.batch_size + 1, dtype=np.int32), pkv, tile_q=1)
    slots = np.zeros((pkv.batch_size, pkv.num_pages * pkv.page_size))
    for r in range(pkv.batch_size):
        pages, s = pkv.token_slots(r)
        slots[r, pages * pkv.page_size + s] = r + 1
    fig, ax = plt.subplots(figsize=(9, 2.6))
    ax.imshow(np.where(slots > 0, slots, np.nan), aspect="auto", cmap="tab10", vmin=0, vmax=10,
              interpolation="nearest")
    for p in range(pkv.num_pages + 1):
        ax.axvline(p * pkv.page_size - 0.5, color="0.8", lw=0.6)
    for r in range(pkv.batch_size):
        for order, p in enumerate(pkv.pages(r)):
            ax.text(p * pkv.page_size + 1.5, r, f"{order}", ha="center", va="center", fontsize=8)
    ax.set_yticks(range(pkv.batch_size), [f"R{r} (len {n})" for r, n in enumerate(pkv.kv_lens)])
    ax.set_xlabel(f"page-pool slot (block columns of B_c = page_size = {pkv.page_size}; "
                  "numbers = logical page order)")
    ax.set_title(f"Page table as BSR: {bsr.nnz_blocks} non-zero blocks of shape {bsr.block_shape}\n"
                 "coloured = valid slots (last pages partly filled)", fontsize=10)
    return _write(plt, fig, path)


def causal_mask(path, results_root=None):
    """Bottom-right causal masks of the three requests."""
    plt = _plt()
    qo_indptr, pkv = spec4_batch()
    masks = causal_visibility(qo_indptr, pkv.kv_lens)
    fig, axes = plt.subplots(1, len(masks), figsize=(9, 2.6))
    for r, (ax, m) in enumerate(zip(axes, masks)):
        ax.imshow(m, cmap="Greens", vmin=0, vmax=1.3, interpolation="nearest")
        ax.set_title(f"R{r}: Q={m.shape[0]}, K={m.shape[1]}")
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
        ax.set_xticks(range(m.shape[1]))          # whole keys and rows only
        ax.set_yticks(range(m.shape[0]))
        for i in range(m.shape[0]):
            ax.text(m.shape[1] - 0.5, i, f" {m[i].sum()}", va="center", fontsize=8)
    fig.suptitle("Causal, bottom-right aligned: query i sees key j iff j <= K - Q + i")
    return _write(plt, fig, path)


def composable_formats(path, results_root=None):
    """Figure 3: one page table seen as a shared-prefix level plus unique suffixes."""
    plt = _plt()
    ps = 4
    pages = [[0, 1, 2, 5], [0, 1, 2, 6, 9], [0, 1, 2, 7], [0, 1, 2, 8]]
    last = [3, 1, 4, 2]
    indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(np.int32)
    pkv = L.PagedKV.validate(indptr, np.concatenate(pages).astype(np.int32), np.array(last, np.int32), ps, 10)
    qo = np.arange(5, dtype=np.int32)
    levels = L.cascade_decompose(qo, pkv)
    fig, axes = plt.subplots(1, 3, figsize=(11, 2.8), sharey=True)
    views = [("flat page table", qo, pkv)]
    for i, lv in enumerate(levels):
        p = L.PagedKV.validate(lv.paged_kv_indptr, lv.paged_kv_indices, lv.paged_kv_last_page_len, ps, 10)
        views.append((["shared prefix (level 0)", "unique suffix (level 1)"][i], lv.qo_indptr, p))
    for ax, (title, q_ptr, p) in zip(axes, views):
        grid = np.full((4, p.num_pages), np.nan)
        for g in range(p.batch_size):
            rows = range(int(q_ptr[g]), int(q_ptr[g + 1]))
            for r in rows:
                grid[r, p.pages(g)] = g
        ax.imshow(grid, aspect="auto", cmap="tab10", vmin=0, vmax=10, interpolation="nearest")
        ax.set_title(f"{title}\n{p.batch_size} block rows, {len(p.paged_kv_indices)} page refs")
        ax.set_xlabel("page id")
    axes[0].set_ylabel("request (query row)")
    fig.suptitle("Composable formats: the same pages, two views; states merge level by level")
    return _write(plt, fig, path)


__all__ = ["page_table_bsr", "causal_mask", "composable_formats", "spec4_batch", "causal_visibility"]
