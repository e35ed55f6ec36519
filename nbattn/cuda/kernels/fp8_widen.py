"""fp8 K/V widened to q's dtype, the scale applied: how the prefill forms read fp8.

Golden model: :func:`nbattn.reference.fp8.dequantize` (``x.float() * scale``),
rounded once to q's dtype.  The decode kernels dequantize fp8 in registers,
because a decode reads each key once and is bound by memory.  A prefill tile
reads each key for a whole tile of query rows and is bound by arithmetic, so
the prefill forms widen the pages a call reads into a scratch cache of q's
dtype with this kernel and run the 16-bit tiles on it unchanged
(docs/concepts/layouts.md, "fp8 in the kernels").

The source is raw uint32 words, four fp8 values a word.  Page ``j`` of the
output is page ``pages[j]`` of the source: ``page_words`` words, whose
first ``k_values`` values are K (times ``k_scale``) and the rest V (times
``v_scale``); the boundary may fall inside a word.  A contiguous K or V is one page of all its words.  NaN and
infinities stay what they are.
"""
from __future__ import annotations

from numba import cuda, float32, int64

from ..blocks.fp8 import fp8x4_to_f32
from ..blocks.primitives import element_io
from ..host.driver import jit_kernel

__all__ = ["KERNELS", "widen_kernel"]

#: Every compiled widening kernel, by ``(fp8 code, output code)``.
KERNELS: dict = {}


def widen_kernel(fp8_code: str, out_code: str):
    """Kernel ``(src, pages, page_words, k_values, k_scale, v_scale, dst)``, any 1-D grid:
    ``dst`` (raw, ``out_code``) gets ``len(pages) * page_words * 4`` values."""
    key = (fp8_code, out_code)
    if key in KERNELS:
        return KERNELS[key]
    to_f32 = fp8x4_to_f32(fp8_code)
    _, store_elem, _ = element_io(out_code)

    def kernel(src, pages, page_words, k_values, k_scale, v_scale, dst):
        n = int64(pages.shape[0]) * page_words
        i = int64(cuda.grid(1))
        while i < n:
            # word w of output page j comes from word w of source page pages[j]
            j = i // page_words
            w = i - j * page_words
            a, b, c, d = to_f32(src[int64(pages[j]) * page_words + w])
            # values before k_values of a page are K (times k_scale), the rest V (times
            # v_scale): a word may hold both; one rounding to q's dtype
            e = 4 * w
            store_elem(dst, 4 * i, a * (float32(k_scale) if e < k_values else float32(v_scale)))
            store_elem(dst, 4 * i + 1, b * (float32(k_scale) if e + 1 < k_values else float32(v_scale)))
            store_elem(dst, 4 * i + 2, c * (float32(k_scale) if e + 2 < k_values else float32(v_scale)))
            store_elem(dst, 4 * i + 3, d * (float32(k_scale) if e + 3 < k_values else float32(v_scale)))
            i += cuda.gridsize(1)

    KERNELS[key] = jit_kernel(kernel)
    return KERNELS[key]
