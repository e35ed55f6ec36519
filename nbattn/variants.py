"""Attention variants: the customization points (docs/concepts/masks.md).

One frozen :class:`Variant` describes what a kernel (or the golden model)
computes besides plain softmax attention.  The golden model evaluates it with
NumPy (:mod:`nbattn.reference.masks`); the kernel factory in
:mod:`nbattn.cuda` compiles the same fields (and the user's Python functions)
into device code.  A Variant is hashable so it can key a kernel cache.

Positions.  Every mask and bias is written in *sequence positions*: key j of a
request sits at ``kv_idx = j``; query i of a request with Q queries and K keys
sits at ``q_idx = K - Q + i`` (bottom-right alignment).  The
user functions see exactly these, with FlexAttention's argument order:

    score_mod(score, b, h, q_idx, kv_idx) -> new score
    mask_mod(b, h, q_idx, kv_idx)         -> True to keep the key

where ``b`` is the request index and ``h`` the query head.  Write them with
plain arithmetic and comparisons (they are called with NumPy arrays by the
golden model and with scalars inside compiled kernels); functions that use
``if`` statements or ``math`` still work in the golden model through a slower
element-wise fallback.

Order: scale, ALiBi bias, soft-cap, ``score_mod``, then the
mask (causal, window with sinks, ``mask_mod``), then softmax -- or, with
``use_sigmoid``, ``sigmoid(score + sigmoid_bias)`` and no normalization.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np

POS_ENCODING_MODES = ("NONE", "ALIBI", "ROPE_LLAMA")


@dataclass(frozen=True)
class Variant:
    causal: bool = False
    sm_scale: Optional[float] = None          # None -> 1/sqrt(head_dim)
    logits_soft_cap: Optional[float] = None   # None or 0 -> off; c*tanh(s/c)
    pos_encoding_mode: str = "NONE"           # "ALIBI": bias -slope_h*(q_idx - kv_idx); "ROPE_LLAMA": q, k rotated
    rope_scale: float = 1.0                   # ROPE_LLAMA: positions divided by this
    rope_theta: float = 1e4                   # ROPE_LLAMA: pair p turns at rope_theta ** (-2p / head_dim)
    window_left: int = -1                     # inclusive; -1 = no window
    sink_size: int = 0                        # first keys always visible (beside the window)
    use_sigmoid: bool = False                 # sigmoid attention: no softmax, no LSE
    sigmoid_bias: float = 0.0
    score_mod: Optional[Callable] = None
    mask_mod: Optional[Callable] = None

    def __post_init__(self):
        if self.pos_encoding_mode not in POS_ENCODING_MODES:
            raise ValueError(f"pos_encoding_mode: must be one of {POS_ENCODING_MODES}, "
                             f"got {self.pos_encoding_mode!r}")
        for name in ("rope_scale", "rope_theta"):
            x = getattr(self, name)
            if not (isinstance(x, (int, float, np.floating, np.integer)) and np.isfinite(x) and x > 0):
                raise ValueError(f"{name}: must be finite and > 0, got {x!r}")
        if int(self.window_left) < -1:
            raise ValueError(f"window_left: must be -1 (no window) or >= 0, got {self.window_left}")
        if int(self.sink_size) < 0:
            raise ValueError(f"sink_size: must be >= 0, got {self.sink_size}")
        if self.logits_soft_cap is not None and not (self.logits_soft_cap == 0 or (
                np.isfinite(self.logits_soft_cap) and self.logits_soft_cap > 0)):
            raise ValueError(f"logits_soft_cap: must be finite and > 0 (or None/0 for off), "
                             f"got {self.logits_soft_cap}")
        if self.sm_scale is not None and not np.isfinite(self.sm_scale):
            raise ValueError(f"sm_scale: must be finite, got {self.sm_scale}")
        if not np.isfinite(self.sigmoid_bias):
            raise ValueError(f"sigmoid_bias: must be finite, got {self.sigmoid_bias}")
        for name in ("score_mod", "mask_mod"):
            f = getattr(self, name)
            if f is not None and not callable(f):
                raise ValueError(f"{name}: must be a Python function, got {type(f).__name__}")

    @property
    def has_soft_cap(self) -> bool:
        return bool(self.logits_soft_cap)

    @property
    def has_alibi(self) -> bool:
        return self.pos_encoding_mode == "ALIBI"

    @property
    def has_rope(self) -> bool:
        return self.pos_encoding_mode == "ROPE_LLAMA"

    @property
    def needs_positions(self) -> bool:
        """Whether the result depends on absolute positions (not only on the key set)."""
        return (self.causal or self.has_alibi or self.has_rope or self.window_left >= 0 or self.sink_size > 0
                or self.score_mod is not None or self.mask_mod is not None)

    def scale(self, head_dim: int) -> float:
        return float(self.sm_scale) if self.sm_scale is not None else 1.0 / math.sqrt(head_dim)

    def with_(self, **kw) -> "Variant":
        return replace(self, **kw)


VARIANT_FIELDS = tuple(Variant.__dataclass_fields__)


def code_names(code) -> set:
    """Global (and attribute) names a code object and the code nested in it load: the
    globals a user ``score_mod`` / ``mask_mod`` may read."""
    names = set(code.co_names)
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            names |= code_names(c)
    return names


def make_variant(**kwargs) -> Variant:
    """Build a Variant from the keyword arguments of a public attention function."""
    return Variant(**{k: v for k, v in kwargs.items() if k in VARIANT_FIELDS})


def variant_from_kwargs(kwargs: dict) -> Variant:
    """The Variant a public function's ``**variant`` keywords ask for.

    ``variant=Variant(...)`` may be given whole, with other keywords overriding
    its fields; an unknown keyword is a TypeError (a typo must not be ignored).
    Consumes ``kwargs``.
    """
    v = kwargs.pop("variant", None)
    unknown = set(kwargs) - set(VARIANT_FIELDS)
    if unknown:
        raise TypeError(unknown_keywords_message(unknown))
    if v is not None:
        return v.with_(**kwargs) if kwargs else v
    return make_variant(**kwargs)


# Names people bring from other attention libraries, and ours for them.
_ALIASES = {
    "softcap": "logits_soft_cap",
    "soft_cap": "logits_soft_cap",
    "logit_cap": "logits_soft_cap",
    "scale": "sm_scale",
    "softmax_scale": "sm_scale",
    "is_causal": "causal",
    "window_size": "window_left",
    "sliding_window": "window_left",
    "alibi": "pos_encoding_mode",
    "num_sinks": "sink_size",
}

# Names that are real arguments elsewhere: what to say where they are not taken.
_ELSEWHERE = {
    "sinks": ("learnable sink logits, one per query head: the attention forms other than split_kv "
              "take them (golden and kernels; the wrappers not yet); for StreamingLLM's always-visible "
              "first keys use 'sink_size'"),
    "k_scale": ("the scale of fp8 K: only the golden model's single_prefill, single_decode, "
                "batch_prefill_ragged, batch_prefill_paged and batch_decode_paged take it so far"),
    "v_scale": ("the scale of fp8 V: only the golden model's single_prefill, single_decode, "
                "batch_prefill_ragged, batch_prefill_paged and batch_decode_paged take it so far"),
}


def suggest_keyword(name: str, choices=VARIANT_FIELDS + ("variant",)) -> str | None:
    """The known keyword a mistyped ``name`` most likely meant, or None."""
    alias = _ALIASES.get(name.lower())
    if alias is not None and alias in choices:
        return alias
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    if close:
        return close[0]
    # a fragment of a longer name ("cap" -> logits_soft_cap)
    frag = [c for c in choices if len(name) >= 3 and name.lower() in c]
    return frag[0] if len(frag) == 1 else None


def unknown_keywords_message(unknown) -> str:
    """``unknown keyword argument(s)`` with a "did you mean" for each that has one."""
    parts = []
    for name in sorted(unknown):
        hint = suggest_keyword(name)
        if name in _ELSEWHERE:
            parts.append(f"{name!r} ({_ELSEWHERE[name]})")
        else:
            parts.append(f"{name!r} (did you mean {hint!r}?)" if hint else repr(name))
    return (f"unknown keyword argument(s): {', '.join(parts)}; the attention keywords are "
            f"{', '.join(VARIANT_FIELDS)} and variant")


def check_return_lse(variant: Variant, return_lse: bool) -> None:
    """Raise when an LSE is asked of sigmoid attention: it has no softmax normalizer."""
    if return_lse and variant.use_sigmoid:
        raise ValueError("return_lse: sigmoid attention has no log-sum-exp (its partial outputs add)")


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The usual geometric ALiBi slopes (float32, one per query head).

    For a power of two n: ``2**(-8*(h+1)/n)``.  Otherwise the slopes of the
    nearest lower power of two m, followed by every other slope of 2m.
    """
    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    m = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(m)
    if m < num_heads:
        slopes += geometric(2 * m)[0::2][: num_heads - m]
    return np.asarray(slopes, dtype=np.float32)
