"""The kernel factory's view of a :class:`~nbattn.variants.Variant`: device
functions that every attention kernel (decode, prefill, sparse, cascade) calls
per score, so a variant is written once for all of them.

docs/concepts/masks.md order: scale, then the logits transform (ALiBi bias, soft-cap,
user ``score_mod``), then the mask (causal, window with sinks, user
``mask_mod``), then softmax -- or sigmoid.  Positions are sequence positions
(``q_idx = K - Q + i``, ``kv_idx = j``), exactly as the golden model uses them.

Interface (stable):

    variant_device_fns(variant) -> (transform, keep)
        transform(score, b, h, q_idx, kv_idx, slope) -> float32
            ``score`` is already multiplied by sm_scale; ``slope`` is the ALiBi
            slope of query head ``h`` (a per-launch parameter the kernel reads
            from an array; ignored unless ALiBi is on).
        keep(b, h, q_idx, kv_idx) -> bool      True: the key takes part.
    kernel_variant_key(variant) -> hashable    fields that change compiled code
                                               (sm_scale is a launch argument).
    compile_user_fn(fn) -> device function     cached per Python function.
    sigmoid_weight(s, bias) -> float32         sigmoid attention's weight of a
                                               transformed score: 1 / (1 + e^-(s + bias)).

Both returned functions are ``@cuda.jit(device=True)`` closures over the
variant's constants, so a kernel factory that captures them compiles the
variant into the kernel (numba's JIT plays FlashInfer's template filling).
Branches on the constants are resolved at compile time.  A user function
must be written with scalar arithmetic, comparisons and ``math`` calls.
"""
from __future__ import annotations

import math
import types
from functools import lru_cache

from numba import cuda, float32

from ...layout import LayoutError
from ...variants import Variant, variant_from_kwargs

__all__ = ["kernel_variant", "frozen_user_fn", "user_state", "check_user_state", "cached_variant", "variant_device_fns", "kernel_variant_key", "compile_user_fn", "LOG2E", "sigmoid_weight"]

LOG2E = 1.4426950408889634  # natural-exp scores -> base-2 exponent


def kernel_variant(kwargs: dict) -> Variant:
    """The Variant a kernel call's ``**variant`` keywords ask for
    (:func:`nbattn.variants.variant_from_kwargs`, which consumes ``kwargs``), with its
    checks (bad values raise a ValueError naming the argument).  Every public
    operation of nbattn.cuda gets its variant here, before anything is built.  User
    functions come back as :func:`frozen_user_fn` gives them."""
    var = variant_from_kwargs(kwargs)
    if var.score_mod is None and var.mask_mod is None:
        return var
    return var.with_(score_mod=frozen_user_fn(var.score_mod), mask_mod=frozen_user_fn(var.mask_mod))


_frozen: dict = {}


def frozen_user_fn(fn):
    """``fn`` as the kernels may compile it now.

    numba freezes the values a function reads (its closure cells and the globals
    it names, NumPy arrays included) into the code it compiles, and the kernels
    are cached by function.  So when one of those values has changed since ``fn``
    was first handed out, this returns a new copy of ``fn`` (same code, same live
    globals and cells), which compiles anew with today's values: a kernel never
    runs with the values of an earlier call, as the golden model never does.
    While nothing changes, the same function object comes back (no recompile).
    numba device functions, and functions whose values have no stable digest
    (:func:`nbattn.cuda.host.driver.frozen_state`), pass through as they are."""
    if fn is None or hasattr(fn, "py_func"):
        return fn
    from ..host.driver import frozen_state
    state = frozen_state(fn)
    if state is None:
        return fn
    seen = _frozen.get(fn)
    if seen is not None and seen[0] == state:
        return seen[1]
    if len(_frozen) > 4096:
        _frozen.clear()
    copy = fn if seen is None else types.FunctionType(fn.__code__, fn.__globals__, fn.__name__,
                                                      fn.__defaults__, fn.__closure__)
    _frozen[fn] = (state, copy)
    return copy


_VARIANTS: dict = {}


def user_state(var: Variant) -> tuple | None:
    """Digests of the values ``var``'s user functions read
    (:func:`nbattn.cuda.host.driver.frozen_state`), None when it has none."""
    if var.score_mod is None and var.mask_mod is None:
        return None
    from ..host.driver import frozen_state
    return tuple(None if f is None or hasattr(f, "py_func") else frozen_state(f)
                 for f in (var.score_mod, var.mask_mod))


def check_user_state(var: Variant, state: tuple | None) -> None:
    """A LayoutError naming ``score_mod`` / ``mask_mod`` when a value that function
    reads has changed since ``state`` (:func:`user_state`) was taken: a plan's kernels
    were compiled with the old value (device arrays are read in place, so rewriting
    one is no change)."""
    if state is None:
        return
    for name, then, now in zip(("score_mod", "mask_mod"), state, user_state(var)):
        if then != now:
            raise LayoutError(f"{name}: a value it reads (a global or a closure variable) changed after "
                              f"plan(), whose kernels were compiled with the old one; call plan() again")


def cached_variant(kwargs: dict) -> Variant:
    """:func:`kernel_variant` remembered per keyword set (a Variant is immutable), so a
    call that repeats its keywords does not rebuild it; unhashable values (a
    ``score_mod`` closure over a list, say) are not remembered."""
    try:
        key = tuple(sorted(kwargs.items()))
        hit = _VARIANTS.get(key)
    except TypeError:
        return kernel_variant(dict(kwargs))
    if hit is not None and (hit.score_mod is not None or hit.mask_mod is not None):
        hit = None                     # user functions: their values are checked on every call
    if hit is None:
        if len(_VARIANTS) > 4096:
            _VARIANTS.clear()
        hit = _VARIANTS[key] = kernel_variant(dict(kwargs))
    return hit


def kernel_variant_key(variant: Variant) -> Variant:
    """The part of a Variant that is compiled into kernels (sm_scale is not)."""
    return variant.with_(sm_scale=None)


_user_cache: dict = {}


def compile_user_fn(fn):
    """A device function for a user ``score_mod``/``mask_mod`` (cached by identity;
    functions that are already numba device functions pass through)."""
    if fn is None:
        return None
    hit = _user_cache.get(fn)
    if hit is None:
        hit = fn if hasattr(fn, "py_func") else cuda.jit(device=True)(fn)
        _user_cache[fn] = hit
    return hit


@cuda.jit(device=True)
def _identity_score(score, b, h, q_idx, kv_idx):
    return score


@cuda.jit(device=True)
def _keep_all(b, h, q_idx, kv_idx):
    return True


@lru_cache(maxsize=None)
def _device_fns(key: Variant):
    alibi = key.has_alibi
    has_cap = key.has_soft_cap
    cap = float32(key.logits_soft_cap or 1.0)
    causal = key.causal
    window = int(key.window_left)
    sinks = int(key.sink_size)
    score_fn = compile_user_fn(key.score_mod) or _identity_score
    mask_fn = compile_user_fn(key.mask_mod) or _keep_all

    @cuda.jit(device=True)
    def transform(score, b, h, q_idx, kv_idx, slope):
        s = float32(score)
        if alibi:
            s = s - float32(slope) * float32(q_idx - kv_idx)
        if has_cap:
            s = cap * math.tanh(s / cap)
        return float32(score_fn(s, b, h, q_idx, kv_idx))

    @cuda.jit(device=True)
    def keep(b, h, q_idx, kv_idx):
        ok = True
        if causal:
            ok = kv_idx <= q_idx
        if window >= 0:
            ok = ok and (q_idx - kv_idx <= window or kv_idx < sinks)
        return ok and bool(mask_fn(b, h, q_idx, kv_idx))

    return transform, keep


def variant_device_fns(variant: Variant):
    """``(transform, keep)`` device functions for ``variant`` (see module doc)."""
    return _device_fns(kernel_variant_key(variant))


@cuda.jit(device=True)
def sigmoid_weight(s, bias):
    """Sigmoid attention (docs/concepts/masks.md): the weight of a transformed score."""
    return float32(1.0) / (float32(1.0) + math.exp(-(s + bias)))
