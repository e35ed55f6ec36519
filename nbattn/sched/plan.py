"""LPT load-balancing planner (docs/concepts/scheduler.md, "Plan").

The plan is computed on the CPU once per generation step and then reused by
every layer, because every layer sees the same lengths.  It answers two
questions for a fixed grid of ``num_ctas`` CTAs:

1. *Who computes what*: a work queue per CTA.  A work item is one KV chunk of
   one query tile of one request.
2. *How partial results are combined*: a reduction map listing, for every query
   tile whose KV range was split, the partial slots to merge, in KV order.

Fused query rows (GQA)
----------------------
With ``group = num_qo_heads // num_kv_heads`` query heads sharing one KV head,
the kernel processes the ``group`` heads of one KV head together, so request
``r`` has ``l_qo[r] * group`` *fused rows*.  Fused row ``f`` is query position
``f // group`` and head-in-group ``f % group``.  Query tiles are
cut over fused rows: query tile ``t`` of request ``r`` covers fused rows
``[t*tile_q, min((t+1)*tile_q, l_qo[r]*group))`` of that request (see
:meth:`Plan.tile_rows`).  The plan is the same for every KV head: the kernel
grid is ``(num_ctas, num_kv_heads)`` and ``blockIdx.y`` picks the KV head.  So
``num_ctas`` here counts CTAs *per KV head*; a caller with ``S`` resident CTA
slots on the device passes ``S // num_kv_heads``.

Algorithm
---------
* Total work ``W = sum_r ceil(l_qo[r]*group / tile_q) * l_kv[r]`` (KV tokens
  summed over query tiles).
* Chunk limit ``L = max(1, ceil(W / num_ctas))`` (the base rule; see
  "Choosing the chunk limit" below for ``chunk_limit="auto"``).
* Every query tile's KV range ``[0, l_kv)`` is cut into chunks
  ``[k*L, min((k+1)*L, l_kv))``; all chunks but the last have length ``L``.
* Chunk cost ``chunk_overhead + alpha*l_q + beta*l_kv`` with ``l_q`` the tile's
  fused row count and ``l_kv`` the chunk length (``chunk_overhead`` defaults to
  0, the plain ``alpha*l_q + beta*l_kv`` cost).
* Chunks are sorted by cost, largest first; ties keep the order
  (request, query tile, chunk index).  The sort is stable, so this is exact.
* A min-heap keyed by (accumulated cost, CTA id) hands each chunk to the least
  loaded CTA, the lowest id among equals.  Everything is integer/float
  arithmetic in a fixed order, so equal inputs give identical plans.

Cost defaults ``alpha = beta = 1``: a memory-traffic model.  A chunk moves each
of its KV tokens once (K and V, ``2*head_dim`` elements) and each fused query
row about twice (read Q, write O: ``2*head_dim`` elements), so one fused row and
one KV token cost about the same.  The ``alpha*l_q`` term is also what makes an
extra chunk of a tile cost something: splitting is not free.

Per-item overhead
-----------------
On the GPU every work item also pays a fixed price that does not grow with
its length: reading the queue entry and the first page ids, the first loads
of the pipeline, the combine and the write of its state.  On the H200 the
decode kernel's item costs about as much as streaming 64 KV tokens (see
``nbattn.cuda.tuning.DecodeTuning.plan_chunk_overhead``).  ``chunk_overhead``
puts that price into the cost, in the same units as ``beta*l_kv``; without it
LPT sees a 100-token tail chunk as nearly free and stacks dozens of them onto
one CTA.
:class:`nbattn.sched.simulate.CostModel` uses the same name for the same term.

Choosing the chunk limit
------------------------
``chunk_limit=None`` (default) is the base rule ``L = ceil(W / C)``;
``chunk_limit="auto"`` keeps the candidate limit with the smallest LPT
makespan (:mod:`nbattn.sched.lpt`, whose docstring says which candidates and
why); ``chunk_limit=<int>`` forces a limit.

Edge cases
----------
* ``l_qo[r] == 0``: the request has no rows, hence no tiles and no work.
* ``l_qo[r] > 0`` and ``l_kv[r] == 0``: each of its query tiles gets exactly one
  work item with ``kv_start == kv_end == 0`` and ``out_slot == DIRECT``.  The
  kernel must still visit it and write the empty attention state
  (output 0, LSE -inf); it costs ``alpha*l_q``.
* ``causal=True`` (an extension; the default is the base formula exactly):
  with bottom-right alignment the last row of a tile sees keys
  ``< l_kv - l_qo + last_position + 1``, so that tile's KV range is trimmed to
  it before ``W`` is summed and chunks are cut.  Keys past the trimmed end are
  masked for every row of the tile, so no work is lost.

Partial slots
-------------
Chunks of a split tile (more than one chunk) each write a partial state into
slot ``out_slot >= 0``; an unsplit tile's single item has ``out_slot == DIRECT``
(-1) and writes the final output.  Slots are numbered in (request, query tile,
chunk) order, so a split tile's slots are consecutive and in ``kv_start``
order.  A slot holds, per KV head, ``tile_q`` fused rows of ``head_dim`` output
values plus one LSE: ``tile_q * num_kv_heads * (head_dim + 1)`` elements.

Because a split tile has ``l_kv > L`` and therefore ``ceil(l_kv/L) < 2*l_kv/L``
chunks, ``num_partials <= 2*W/L <= 2*num_ctas``.  Times the slot size this is
the paper's bound (App. D.3) of ``2*C*T_q*H_qo*(head_dim+1)`` elements, which
lets the run step preallocate the partial buffer once (CUDA-graph friendly).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .._jit import njit_cached

from .._checks import count_arg, int_arg
from ..layout.checks import INT32_MAX
from .cost import CostModel
from .lpt import LPT_ORDER, auto_limit, choose_plan, lpt_assign, plan_span, query_tiles
from .tiles import choose_tile_q

__all__ = [
    "DIRECT",
    "DEFAULT_ALPHA",
    "DEFAULT_BETA",
    "Plan",
    "plan",
    "plan_lengths",
    "partial_buffer_bound",
    "check_partial_capacity",
    "plan_from_indptr",
]

DIRECT = -1
"""``out_slot`` marker: the item is the tile's only chunk and writes the final output."""

DEFAULT_ALPHA = 1.0
DEFAULT_BETA = 1.0



@dataclass(frozen=True, eq=False)
class Plan:
    """Result of :func:`plan`.  All index arrays are int32 and read-only.

    Work queues (CSR over CTAs): CTA ``c`` runs items
    ``cta_indptr[c] : cta_indptr[c+1]`` in that order.  Item ``i`` computes
    attention for fused rows :meth:`tile_rows` ``(request[i], qo_tile[i])``
    against keys ``kv_start[i] : kv_end[i]`` of request ``request[i]`` and writes
    partial slot ``out_slot[i]``, or the final output when it is ``DIRECT``.

    Reduction map (CSR over split tiles): split tile ``m`` is
    ``(merge_request[m], merge_qo_tile[m])`` and its final output is the merge
    of slots ``merge_slots[merge_indptr[m] : merge_indptr[m+1]]``, in that order
    (increasing ``kv_start``).  Merging in this fixed order, never with
    atomics, is what makes the output bitwise reproducible.
    """

    num_ctas: int
    tile_q: int
    group: int
    chunk_limit: int
    alpha: float
    beta: float
    chunk_overhead: float
    causal: bool
    qo_lens: np.ndarray
    kv_lens: np.ndarray
    cta_indptr: np.ndarray
    request: np.ndarray
    qo_tile: np.ndarray
    kv_start: np.ndarray
    kv_end: np.ndarray
    out_slot: np.ndarray
    merge_indptr: np.ndarray
    merge_request: np.ndarray
    merge_qo_tile: np.ndarray
    merge_slots: np.ndarray
    num_partials: int
    cta_cost: np.ndarray
    makespan: float
    lower_bound: float
    #: How items were placed: ``"lpt"`` (largest first) or ``"request"`` (request order).
    placement: str = "lpt"
    #: The cost model the plan was made with (``plan(cost=...)``), else None.
    cost_model: CostModel | None = None
    #: Its predicted makespan under ``cost_model`` (merge pass included), else NaN.
    predicted_makespan: float = float("nan")

    @classmethod
    def of(cls, **values) -> "Plan":
        """``Plan(**values)`` for a caller that passes every field, built without the
        frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field): the
        wrappers' ``plan()`` makes one per generation step."""
        if values.keys() != cls._FIELDS:
            missing = cls._FIELDS.difference(values)
            raise TypeError(f"Plan.of: needs exactly the fields {sorted(cls._FIELDS)}; missing "
                            f"{sorted(missing)}, extra {sorted(set(values) - cls._FIELDS)}")
        p = object.__new__(cls)
        p.__dict__.update(values)
        return p

    @property
    def num_items(self) -> int:
        return int(self.request.shape[0])

    @property
    def num_merges(self) -> int:
        """Number of split query tiles (entries of the reduction map)."""
        return int(self.merge_request.shape[0])

    def tile_rows(self, request: int, qo_tile: int) -> tuple[int, int]:
        """Fused rows ``[start, end)`` of query tile ``qo_tile`` of ``request``."""
        rows = int(self.qo_lens[request]) * self.group
        start = qo_tile * self.tile_q
        return start, min(start + self.tile_q, rows)

    def item_rows(self) -> np.ndarray:
        """Fused row count ``l_q`` of every work item."""
        rows = self.qo_lens[self.request].astype(np.int64) * self.group
        start = self.qo_tile.astype(np.int64) * self.tile_q
        return np.minimum(rows - start, self.tile_q)

    def item_cost(self) -> np.ndarray:
        """Cost ``chunk_overhead + alpha*l_q + beta*l_kv`` of every work item (float64)."""
        kv = (self.kv_end - self.kv_start).astype(np.float64)
        return self.chunk_overhead + self.alpha * self.item_rows() + self.beta * kv

    def item_cta(self) -> np.ndarray:
        """CTA id of every work item."""
        counts = np.diff(self.cta_indptr)
        return np.repeat(np.arange(self.num_ctas, dtype=np.int32), counts)

    def partial_elements(self, num_qo_heads: int, head_dim: int) -> int:
        """Elements of partial buffer this plan writes (outputs plus LSEs)."""
        num_kv_heads = _num_kv_heads(num_qo_heads, self.group)
        return self.num_partials * self.tile_q * num_kv_heads * (head_dim + 1)


Plan._FIELDS = frozenset(f.name for f in fields(Plan))


def _num_kv_heads(num_qo_heads: int, group: int) -> int:
    if num_qo_heads < 1 or num_qo_heads % group != 0:
        raise ValueError(
            f"num_qo_heads={num_qo_heads} must be a positive multiple of group={group}"
        )
    return num_qo_heads // group


def partial_buffer_bound(num_ctas: int, tile_q: int, num_qo_heads: int, head_dim: int) -> int:
    """The scheduler's bound on partial-output elements: ``2*C*T_q*H_qo*(head_dim+1)``."""
    for name, x in (("num_ctas", num_ctas), ("tile_q", tile_q), ("num_qo_heads", num_qo_heads),
                    ("head_dim", head_dim)):
        int_arg(name, x, minimum=0)
    return 2 * num_ctas * tile_q * num_qo_heads * (head_dim + 1)


def check_partial_capacity(p: Plan, num_qo_heads: int, head_dim: int, capacity: int) -> int:
    """Raise ValueError if plan ``p`` needs more partial-buffer elements than ``capacity``.

    Returns the number of elements needed.  The message names the sizing
    rule, so a caller who preallocated too little knows what to size
    the buffer by.
    """
    need = p.partial_elements(num_qo_heads, head_dim)
    if need > capacity:
        bound = partial_buffer_bound(p.num_ctas, p.tile_q, num_qo_heads, head_dim)
        raise ValueError(
            f"partial-buffer capacity exceeded: the plan writes {p.num_partials} partial "
            f"slots = {need} elements but capacity is {capacity}. Rule (paper "
            f"App. D.3): preallocate 2*C*T_q*H_qo*(head_dim+1) = 2*{p.num_ctas}*"
            f"{p.tile_q}*{num_qo_heads}*({head_dim}+1) = {bound} elements, which every "
            f"plan fits"
        )
    return need


@njit_cached
def _plan_core(qo_lens, kv_lens, group, tile_q, num_ctas, alpha, beta, overhead, causal, limit, mode):
    """``limit``: 0 = base rule, -1 = auto, > 0 = forced chunk limit; ``mode``: the
    placement (``LPT_ORDER`` or ``REQUEST_ORDER``)."""
    tile_request, tile_index, tile_rows, tile_kv = query_tiles(qo_lens, kv_lens, group, tile_q, causal)
    num_tiles = tile_request.shape[0]
    total_work = 0
    for t in range(num_tiles):
        total_work += tile_kv[t]

    chunk_limit = max(1, (total_work + num_ctas - 1) // num_ctas)
    if limit > 0:
        chunk_limit = limit
    elif limit < 0:
        chunk_limit = auto_limit(tile_rows, tile_kv, num_ctas, alpha, beta, overhead, chunk_limit)

    # Chunk count per tile; a tile with no keys still gets one (empty) item.
    num_items = 0
    num_partials = 0
    num_merges = 0
    for t in range(num_tiles):
        n = max(1, (tile_kv[t] + chunk_limit - 1) // chunk_limit)
        num_items += n
        if n > 1:
            num_partials += n
            num_merges += 1

    # Every int32 array of the plan in one buffer (one array to hand back to Python, not
    # ten): cta_indptr, the five item arrays in queue order, then the reduction map.
    n, M, P = num_items, num_merges, num_partials
    words = np.empty(num_ctas + 1 + 5 * n + 3 * M + 1 + P, np.int32)
    cta_indptr = words[:num_ctas + 1]
    at = num_ctas + 1
    request = words[at:at + n]
    qo_tile = words[at + n:at + 2 * n]
    kv_start = words[at + 2 * n:at + 3 * n]
    kv_end = words[at + 3 * n:at + 4 * n]
    out_slot = words[at + 4 * n:at + 5 * n]
    at += 5 * n
    merge_indptr = words[at:at + M + 1]
    merge_request = words[at + M + 1:at + 2 * M + 1]
    merge_qo_tile = words[at + 2 * M + 1:at + 3 * M + 1]
    merge_slots = words[at + 3 * M + 1:]
    merge_indptr[0] = 0

    # Items in (request, tile, chunk) order: the tile and chunk of each, and its cost;
    # a split tile's partial slots are consecutive, from first_slot[t] (-1: unsplit).
    item_tile = np.empty(n, np.int32)
    item_chunk = np.empty(n, np.int32)
    cost = np.empty(n, np.float64)
    first_slot = np.full(num_tiles, -1, np.int32)
    i = 0
    slot = 0
    m = 0
    for t in range(num_tiles):
        k_tile = max(1, (tile_kv[t] + chunk_limit - 1) // chunk_limit)
        for k in range(k_tile):
            item_tile[i] = t
            item_chunk[i] = k
            cost[i] = overhead + alpha * tile_rows[t] + beta * (min((k + 1) * chunk_limit, tile_kv[t])
                                                                 - k * chunk_limit)
            i += 1
        if k_tile > 1:      # slots in (request, tile, chunk) order
            first_slot[t] = slot
            for k in range(k_tile):
                merge_slots[slot] = slot
                slot += 1
            merge_request[m] = tile_request[t]
            merge_qo_tile[m] = tile_index[t]
            merge_indptr[m + 1] = slot
            m += 1

    # LPT: largest cost first; the stable sort keeps (request, tile, chunk) order on ties.
    if mode == LPT_ORDER:
        order = np.argsort(-cost, kind="mergesort")
    else:
        order = np.arange(n)

    assigned, _ = lpt_assign(cost, order, num_ctas)

    # Per-CTA queues in assignment order (a counting sort by CTA id).
    cta_indptr[:] = 0
    for j in range(n):
        cta_indptr[assigned[j] + 1] += 1
    for c in range(num_ctas):
        cta_indptr[c + 1] += cta_indptr[c]
    fill = cta_indptr[:-1].copy()
    cta_cost = np.zeros(num_ctas, np.float64)
    for j in range(n):
        c = assigned[j]
        item = order[j]
        q = fill[c]
        fill[c] += 1
        t = item_tile[item]
        k = item_chunk[item]
        request[q] = tile_request[t]
        qo_tile[q] = tile_index[t]
        kv_start[q] = k * chunk_limit
        kv_end[q] = min((k + 1) * chunk_limit, tile_kv[t])
        out_slot[q] = first_slot[t] + k if first_slot[t] >= 0 else DIRECT
        cta_cost[c] += cost[item]

    total_cost = 0.0
    max_cost = 0.0
    for j in range(n):
        total_cost += cost[j]
        max_cost = max(max_cost, cost[j])
    lower_bound = max(total_cost / num_ctas, max_cost)
    makespan = 0.0
    for c in range(num_ctas):
        makespan = max(makespan, cta_cost[c])
    return words, cta_cost, chunk_limit, n, M, P, lower_bound, makespan


def _lengths(values, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name} must be non-negative")
    if arr.size and arr.max() > INT32_MAX:
        raise ValueError(f"{name} must fit in int32")
    return arr


def plan(qo_lens, kv_lens, num_ctas: int, tile_q: int | None = None, *, group: int = 1, causal: bool = False,
         **options) -> Plan:
    """Plan one generation step with the LPT algorithm (docs/concepts/scheduler.md).

    ``options`` are the keyword arguments of :func:`plan_lengths` (``alpha``,
    ``beta``, ``chunk_overhead``, ``chunk_limit``, ``num_qo_heads``, ``head_dim``,
    ``partial_capacity``, ``cost``; defaults there), described below.

    Parameters
    ----------
    qo_lens, kv_lens:
        Query and KV length of every request, in positions (tokens).  Lists or
        integer arrays.
    num_ctas:
        CTAs of the fixed grid, per KV head (see the module docstring).
    tile_q:
        Query tile size in fused rows; ``None`` picks it with
        :func:`nbattn.sched.tiles.choose_tile_q`.
    group:
        ``num_qo_heads // num_kv_heads``; each position contributes ``group``
        fused rows.
    alpha, beta, chunk_overhead:
        Chunk cost ``chunk_overhead + alpha*l_q + beta*l_kv``.
    chunk_limit:
        ``None``: the base rule ``ceil(W / num_ctas)``; ``"auto"``: the
        candidate with the smallest makespan (:mod:`nbattn.sched.lpt`,
        "Choosing the chunk limit"); a positive int: that limit.
    causal:
        Trim each query tile's KV range to what its last row can see
        (requires ``l_qo <= l_kv`` for non-empty requests).
    num_qo_heads, head_dim, partial_capacity:
        If ``partial_capacity`` is given, the plan is checked against it with
        :func:`check_partial_capacity` (both head parameters then required).
    cost:
        A :class:`nbattn.sched.cost.CostModel`.  When given, its ``alpha``,
        ``beta`` and ``chunk_overhead`` are the chunk cost (the three arguments
        above are then not used), the plan records the model and its predicted
        makespan, and with ``search="plans"`` ``chunk_limit="auto"`` picks the
        plan (limit and placement) with the smallest predicted makespan, merge
        included (:mod:`nbattn.sched.lpt`, "Choosing the plan").  A model with
        ``search="limits"`` plans exactly as the three numbers alone would.
    """
    qo = _lengths(qo_lens, "qo_lens")
    kv = _lengths(kv_lens, "kv_lens")
    if qo.shape != kv.shape:
        raise ValueError(f"qo_lens and kv_lens differ in length: {qo.size} vs {kv.size}")
    group = count_arg("group", group)
    if causal and np.any((kv > 0) & (qo > kv)):
        raise ValueError("causal plan needs qo_len <= kv_len for every request with keys")
    if qo.size and int(qo.max()) * group > INT32_MAX:
        raise ValueError("qo_lens * group must fit in int32")
    return plan_lengths(qo, kv, num_ctas, tile_q, group=group, causal=causal, **options)


def plan_lengths(
    qo: np.ndarray,
    kv: np.ndarray,
    num_ctas: int,
    tile_q: int | None = None,
    *,
    group: int = 1,
    alpha: float = DEFAULT_ALPHA,
    beta: float = DEFAULT_BETA,
    chunk_overhead: float = 0.0,
    chunk_limit: int | str | None = None,
    causal: bool = False,
    num_qo_heads: int | None = None,
    head_dim: int | None = None,
    partial_capacity: int | None = None,
    cost: CostModel | None = None,
) -> Plan:
    """:func:`plan` over lengths its caller has already checked.

    ``qo`` and ``kv`` are int64 arrays of one shape ``[batch]``, non-negative,
    with ``qo * group`` and ``kv`` within int32 and, for a ``causal`` plan,
    ``qo <= kv`` wherever ``kv > 0``: what :func:`plan` checks of
    ``qo_lens`` / ``kv_lens`` before it calls this.  The decode wrapper's
    ``plan()`` calls it with lengths it derived from a page table it validated,
    which saves the array checks on every step.  Every other argument is checked here,
    with :func:`plan`'s messages.
    """
    num_ctas = count_arg("num_ctas", num_ctas)
    group = count_arg("group", group)
    if tile_q is None:
        tile_q = choose_tile_q(qo, group)
    tile_q = count_arg("tile_q", tile_q)
    if cost is not None:
        if not isinstance(cost, CostModel):
            raise TypeError(f"cost: must be a nbattn.sched.cost.CostModel, got {type(cost).__name__}")
        alpha, beta, chunk_overhead = cost.alpha, cost.beta, cost.chunk_overhead
    alpha = float(alpha)
    beta = float(beta)
    overhead = float(chunk_overhead)
    if not (alpha >= 0.0 and beta >= 0.0 and overhead >= 0.0):
        raise ValueError("alpha, beta and chunk_overhead must be non-negative")
    if chunk_limit is None:
        limit = 0
    elif isinstance(chunk_limit, str):
        if chunk_limit != "auto":
            raise ValueError(f'chunk_limit must be None, "auto" or a positive int, got {chunk_limit!r}')
        limit = -1
    else:
        limit = int(chunk_limit)
        if limit < 1 or limit != chunk_limit:
            raise ValueError(f'chunk_limit must be None, "auto" or a positive int, got {chunk_limit!r}')

    mode, predicted = LPT_ORDER, float("nan")
    if cost is not None:
        _, _, t_rows, t_kv = query_tiles(qo, kv, group, tile_q, bool(causal))
        _, _, _, mc, mr, ml, mt, launch, solo, two = cost.params()
        if limit == -1 and cost.search == "plans":
            spec = max(1, -(-int(t_kv.sum()) // num_ctas))
            limit, mode, predicted = choose_plan(t_rows, t_kv, num_ctas, alpha, beta, overhead, mc, mr, ml, mt,
                                                 launch, solo, spec, two)
            limit = int(limit)
    words, cta_cost, chunk_limit, n, M, P, lower_bound, makespan = _plan_core(
        qo, kv, group, tile_q, num_ctas, alpha, beta, overhead, bool(causal), limit, mode)
    if cost is not None and not np.isfinite(predicted):
        predicted = float(plan_span(t_rows, t_kv, int(chunk_limit), mode, num_ctas, alpha, beta, overhead,
                                    mc, mr, ml, mt, launch, solo, two))
    # The int32 arrays are read-only views of the one buffer the core filled, in its order.
    words.setflags(write=False)
    cta_cost.setflags(write=False)
    a, b = num_ctas + 1, num_ctas + 1 + 5 * n
    cta_indptr, merge_slots = words[:a], words[b + 3 * M + 1:]
    request, qo_tile, kv_start, kv_end, out_slot = [words[a + j * n:a + (j + 1) * n] for j in range(5)]
    merge_indptr, merge_request, merge_qo_tile = words[b:b + M + 1], words[b + M + 1:b + 2 * M + 1], \
        words[b + 2 * M + 1:b + 3 * M + 1]
    qo_lens, kv_lens = qo.astype(np.int32), kv.astype(np.int32)
    qo_lens.setflags(write=False)
    kv_lens.setflags(write=False)
    result = Plan.of(
        num_ctas=num_ctas,
        tile_q=tile_q,
        group=group,
        chunk_limit=int(chunk_limit),
        alpha=alpha,
        beta=beta,
        chunk_overhead=overhead,
        causal=bool(causal),
        qo_lens=qo_lens, kv_lens=kv_lens, cta_indptr=cta_indptr, request=request, qo_tile=qo_tile,
        kv_start=kv_start, kv_end=kv_end, out_slot=out_slot, merge_indptr=merge_indptr,
        merge_request=merge_request, merge_qo_tile=merge_qo_tile, merge_slots=merge_slots,
        num_partials=int(P),
        cta_cost=cta_cost,
        makespan=makespan,
        lower_bound=float(lower_bound),
        placement="lpt" if mode == LPT_ORDER else "request",
        cost_model=cost,
        predicted_makespan=float(predicted),
    )
    if partial_capacity is not None:
        if num_qo_heads is None or head_dim is None:
            raise ValueError("partial_capacity needs num_qo_heads and head_dim")
        check_partial_capacity(result, int(num_qo_heads), int(head_dim), int(partial_capacity))
    return result


def plan_from_indptr(
    qo_indptr,
    paged_kv_indptr,
    paged_kv_last_page_len,
    page_size: int,
    num_ctas: int,
    tile_q: int | None = None,
    **kwargs,
) -> Plan:
    """:func:`plan` from FlashInfer-style metadata (docs/concepts/layouts.md).

    ``qo_lens = diff(qo_indptr)`` and KV lengths come from the page table via
    :func:`nbattn.layout.kv_lengths`.  Metadata must be int32 (or Python lists);
    bad metadata raises :class:`nbattn.layout.LayoutError` (a ValueError).
    Keyword arguments go to :func:`plan`.
    """
    from ..layout import LayoutError, as_int32, check_indptr, kv_lengths

    page_size = count_arg("page_size", page_size)
    qo_indptr = check_indptr("qo_indptr", qo_indptr)
    paged_kv_indptr = check_indptr("paged_kv_indptr", paged_kv_indptr)
    last = as_int32("paged_kv_last_page_len", paged_kv_last_page_len)
    batch = qo_indptr.size - 1
    if paged_kv_indptr.size - 1 != batch or last.size != batch:
        raise LayoutError(
            f"batch sizes differ: qo_indptr has {batch} requests, paged_kv_indptr "
            f"{paged_kv_indptr.size - 1}, paged_kv_last_page_len {last.size}"
        )
    pages = np.diff(paged_kv_indptr)
    bad = (pages > 0) & ((last < 1) | (last > page_size))
    if np.any(bad):
        r = int(np.argmax(bad))
        raise LayoutError(
            f"paged_kv_last_page_len: request {r} has {int(last[r])}, must be in 1..{page_size}"
        )
    empty = (pages == 0) & (last != 0)
    if np.any(empty):
        r = int(np.argmax(empty))
        raise LayoutError(f"paged_kv_last_page_len: request {r} has no pages, so its length must be 0, "
                          f"got {int(last[r])}")
    qo_lens = np.diff(qo_indptr)
    kv_lens = kv_lengths(paged_kv_indptr, last, page_size)
    return plan(qo_lens, kv_lens, num_ctas, tile_q, **kwargs)
