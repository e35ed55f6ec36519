"""The decode plan/run wrapper with fp8 caches: FlashInfer's ``plan(...,
q_data_type=, kv_data_type=)`` and ``run(..., k_scale=, v_scale=)``.

:class:`BatchDecodeWithPagedKVCacheWrapper` is the wrapper of
:mod:`nbattn.cuda.decode_wrapper` (what ``nbattn.cuda`` exports under that
name) plus an fp8 ``kv_data_type``:

* ``plan()`` with ``kv_data_type=torch.float8_e4m3fn`` (or ``float8_e5m2``, or
  their names) builds the fp8 kernel configuration
  (:func:`nbattn.cuda.kernels.decode_common.make_config` with ``kv_code``: the
  warp path on a GPU, the teaching kernel in the simulator) and plans the work
  for that kernel's shape (the same path and heads a CTA), so the planner's CTA
  count is the fp8 kernel's;
* ``run()`` takes the fp8 cache with ``k_scale`` / ``v_scale`` (None: 1.0),
  checked as the golden model checks them (:func:`nbattn.reference.fp8.check_scale`);
  the scales are set in the bound launch at every run, so a new scale needs
  no new plan (a CUDA graph replays the scales it captured).

Without an fp8 ``kv_data_type`` everything is the plain wrapper's, and a
scale or an fp8 cache given to run() is refused, naming it.
"""
from __future__ import annotations

import inspect
from typing import Any

from .. import layout as L
from ..variants import check_return_lse
from ..reference.fp8 import check_scale, fp8_kind, kv_scales, reject_fp8
from .blocks.fp8 import FP8_CODES
from .blocks.primitives import SIMULATOR
from .blocks.variants import kernel_variant
from .decode_problem import check_head_dim, check_out
from .decode_wrapper import BatchDecodeWithPagedKVCacheWrapper as _PlainDecodeWrapper
from .fp8 import fp8_data_type, is_fp8
from .host import arrays as A
from .host.driver import data_ptr, stream_handle, torch_stream
from .kernels.decode_common import make_config
from .plan_run import data_code
from .tuning import DECODE, DecodeTuning, check_tuning

__all__ = ["BatchDecodeWithPagedKVCacheWrapper"]

# the plain plan()'s own keyword-only arguments (alpha, beta, schedule, ...): not variant keywords
_PLAN_ONLY = frozenset(n for n, p in inspect.signature(_PlainDecodeWrapper.plan).parameters.items()
                       if p.kind is inspect.Parameter.KEYWORD_ONLY)
_NAME = {code: name for name, code in FP8_CODES.items()}


class BatchDecodeWithPagedKVCacheWrapper(_PlainDecodeWrapper):
    __doc__ = (_PlainDecodeWrapper.__doc__ or "") + """
    An fp8 cache: ``plan(..., q_data_type=torch.float16, kv_data_type=torch.float8_e4m3fn)``
    (or ``float8_e5m2``; head_dim a multiple of 16), then ``run(q, cache, k_scale=...,
    v_scale=...)`` (:mod:`nbattn.cuda.fp8_wrapper`).
    """

    _fp8: str | None = None

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type: Any = "float16",
             kv_data_type: Any = None, sm_scale: float | None = None, *, tuning: DecodeTuning | None = None,
             **kwargs) -> None:
        """Plan a decode step (see the plain wrapper's ``plan``); ``kv_data_type`` may
        name an fp8 dtype (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``), with
        ``q_data_type`` float16, bfloat16 or float32."""
        args = (indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                pos_encoding_mode, window_left, logits_soft_cap, q_data_type)
        fp8 = fp8_data_type(kv_data_type)
        self._fp8 = None
        if fp8 is None:
            return super().plan(*args, kv_data_type, sm_scale, tuning=tuning, **kwargs)
        if fp8_data_type(q_data_type) is not None:
            raise L.LayoutError(f"q_data_type: fp8 queries are not supported (q stays float16, bfloat16 or "
                                f"float32; fp8 is for K/V), got {q_data_type}")
        code = data_code(q_data_type, None)
        check_head_dim(int(head_dim), fp8)
        tuning = check_tuning(tuning, DecodeTuning, DECODE)
        var = kernel_variant({k: v for k, v in kwargs.items() if k not in _PLAN_ONLY} | dict(
            pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale))
        group = L.check_heads(int(num_qo_heads), int(num_kv_heads))
        cfg = make_config(code, int(head_dim), group, self._kv_layout, var, True, None, tuning, fp8)
        # plan for the fp8 kernel's shape: its path and heads a CTA (the work list is the same either way)
        shape = (tuning.replace(path="warp", warp_max_heads=cfg.heads_per_cta) if cfg.path == "warp"
                 else tuning.replace(path="smem"))
        super().plan(*args, None, sm_scale, tuning=shape, **kwargs)
        self._fp8, self._cfg = fp8, cfg
        self._bound_key = (cfg,) + tuple(self._bound_key[1:])

    def run(self, q, paged_kv_cache, out=None, lse=None, return_lse: bool = False, *, k_scale=None,
            v_scale=None):
        """Attention of ``q`` against the planned pages of ``paged_kv_cache`` (see the
        plain wrapper's ``run``).  After an fp8 plan the cache has plan()'s fp8 dtype
        and ``k_scale`` / ``v_scale`` (floats, None: 1.0) are its scales."""
        if self._fp8 is None:
            if k_scale is not None or v_scale is not None or is_fp8(paged_kv_cache):
                self._need_plan()
                if is_fp8(paged_kv_cache):
                    raise L.LayoutError(f"paged_kv_cache: dtype {L.dtype_of(paged_kv_cache)} differs from plan()'s "
                                        f"kv_data_type ({self._code}); plan with kv_data_type="
                                        f"torch.{L.dtype_of(paged_kv_cache)} to read an fp8 cache")
                kv_scales(k_scale, v_scale, None, "paged_kv_cache", L.dtype_of(paged_kv_cache))
            return super().run(q, paged_kv_cache, out, lse, return_lse)
        ks, vs = self._fp8_checks(q, paged_kv_cache, k_scale, v_scale)
        kind, code, stream, q_dev, kv_dev, kv_words, out_user, out_dev, lse_user, lse_dev = self._fp8_inputs(
            q, paged_kv_cache, out, lse, return_lse)
        bound = self._bound_now
        if bound is None:
            bound = self._bound_now = self._bound_launches(q_dev, kv_dev)
        dec, merge, ix = bound
        dec.set(ix["q"], q_dev)
        dec.set(ix["kv"], kv_dev, kv_words)
        dec.set(ix["out"], out_dev)
        dec.set(ix["lse"], lse_dev)
        dec.set_scalar(ix["sm_scale"], self._variant.scale(self._head_dim) * ks)   # k_scale joins the score scale
        dec.set_scalar(ix["v_scale"], vs)
        dec(stream)
        if merge is not None:
            merge.set(ix["merge_out"], out_dev)
            merge.set(ix["merge_lse"], lse_dev)
            merge(stream)
        return self._results(kind, code, out, out_user, out_dev, lse, lse_user, lse_dev, return_lse)

    forward = run

    # -- run()'s checks after an fp8 plan --------------------------------------
    def _fp8_checks(self, q, cache, k_scale, v_scale) -> tuple[float, float]:
        self._need_plan()
        if is_fp8(q):
            reject_fp8("q", q)
        want = _NAME[self._fp8]
        kind = fp8_kind("paged_kv_cache", cache)
        if kind != want:
            raise L.LayoutError(f"paged_kv_cache: dtype {L.dtype_of(cache)} differs from plan()'s kv_data_type "
                                f"({want}); give {want} data, or plan with kv_data_type=torch.{L.dtype_of(cache)}"
                                if kind else f"paged_kv_cache: must be a torch {want} tensor, as plan()'s "
                                f"kv_data_type says, got {L.dtype_of(cache)}")
        return check_scale("k_scale", k_scale), check_scale("v_scale", v_scale)

    def _fp8_inputs(self, q, cache, out, lse, return_lse: bool):
        """The plain wrapper's per-call checks and device views, for an fp8 cache: returns
        (kind, code, stream, q_dev, kv_dev, kv_words, out_user, out_dev, lse_user, lse_dev)."""
        if return_lse and self._variant.use_sigmoid:
            check_return_lse(self._variant, return_lse)
        kind, ckind = A.kind_of(q), A.kind_of(cache)
        dev = A.is_device_kind(kind)
        code = A.dtype_code(q, "q")
        if code != self._code:
            raise L.LayoutError(f"q: dtype {L.dtype_of(q)} differs from plan()'s q_data_type ({self._code})")
        shape = self._q_shape
        if tuple(int(x) for x in q.shape) != shape:
            raise L.LayoutError(f"q: must have shape {shape} for this plan, got {tuple(int(x) for x in q.shape)}")
        cshape = tuple(int(x) for x in cache.shape)
        if len(cshape) != 5 or cshape[1] != 2:
            L.cache_dims(cache, self._kv_layout)              # raises the layout's message
        ps, hk = (cshape[2], cshape[3]) if self._kv_layout == "NHD" else (cshape[3], cshape[2])
        if (ps, hk, cshape[4]) != (self._page_size, self._num_kv_heads, self._head_dim):
            raise L.LayoutError(f"paged_kv_cache: (page_size, num_kv_heads, head_dim) = {(ps, hk, cshape[4])} "
                                f"differs from plan()'s {(self._page_size, self._num_kv_heads, self._head_dim)}")
        if self._max_page >= cshape[0]:
            raise L.LayoutError(f"paged_kv_cache: plan() uses page {self._max_page} but the cache "
                                f"has {cshape[0]} pages")
        if dev != A.is_device_kind(ckind):
            raise L.LayoutError("paged_kv_cache: must live where q lives")
        if kind == "torch" and q.device != cache.device:
            raise L.LayoutError(f"paged_kv_cache: must be on q's device ({q.device}), got {cache.device}")
        if dev:
            A.check_contiguous(q, "q")
            A.check_contiguous(cache, "paged_kv_cache")
        for name, x, want, c in (("out", out, shape, code), ("lse", lse, shape[:2], None)):
            if x is not None:
                check_out(name, x, want, c, kind)
                if kind == "torch" and x.device != q.device:
                    raise L.LayoutError(f"{name}: must be on q's device ({q.device}), got {x.device}")
        n = 1
        for v in cshape:
            n *= v
        kv_words = n // 4
        q_dev = q if dev else A.to_device(q, "q", 0, code)
        # a host cache: its bytes on the device, as the 32-bit words the kernel reads
        kv_dev = cache if dev else A.words(A.to_device(cache, "paged_kv_cache", 0, self._fp8))
        if not SIMULATOR and (data_ptr(q_dev) | data_ptr(kv_dev)) % 16:
            raise L.LayoutError("q, paged_kv_cache: must start at 16-byte aligned addresses (the kernels "
                                "read 16 bytes at a time)")
        stream = 0 if SIMULATOR else (torch_stream(q.device.index) if kind == "torch" else stream_handle(q))
        if kind == "torch":
            out_dev = out if out is not None else q.new_empty(shape)
            lse_dev = lse if lse is not None else self._lse_scratch(q, return_lse)
            out_user, lse_user = out_dev, lse_dev
        else:
            out_user, out_dev = A.output_for("out", out, kind, shape, code, 0, like=q)
            lse_user, lse_dev = A.output_for("lse", lse, kind, shape[:2], "f32", 0, like=q)
        return kind, code, stream, q_dev, kv_dev, kv_words, out_user, out_dev, lse_user, lse_dev

