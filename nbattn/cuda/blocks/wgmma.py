"""Hopper warpgroup matrix products (``wgmma``) as inline PTX: the first pieces of
a Hopper prefill tile (docs/gpu.md, "Hopper").  GPU only, sm_90a.

A warpgroup is four consecutive warps (128 threads) that issue one product
together.  ``wgmma.mma_async`` reads both operands from shared memory through
64-bit *matrix descriptors* and accumulates into registers spread over the 128
threads; it runs asynchronously, so a kernel fences, issues, commits and waits:

    fence_proxy_async()    # shared-memory writes of ordinary stores become visible to wgmma
    wgmma_fence()          # the accumulator registers are ready to be read by wgmma
    wgmma_m64n64k16_f16(acc, desc_a, desc_b, scale_d)
    wgmma_commit()         # close the group of products issued so far
    wgmma_wait0()          # wait until every committed group is done

The product is ``D[64 x N] (+)= A[64 x 16] @ B[16 x N]`` in fp16 with float32
accumulation (``scale_d`` 0: D = A @ B; 1: D += A @ B): ``wgmma_m64n64k16_f16``
reads A from shared memory too (a tile of scores, ``Q K^T``), and
``wgmma_m64n128k16_f16_rs`` takes A from registers, in ``mma.sync``'s A fragment
layout per warp (rows ``16w ..``), which is the layout the score accumulators
already have (``P V``, with ``P`` never leaving registers).  Both operands are
"K-major": row ``m`` of A holds its 16 k values contiguously, and so does row
``n`` of B^T.  Without swizzling, shared memory holds each operand as 8 x 8
*core matrices* of 128 contiguous bytes (8 rows of 16 bytes);
:func:`core_offset` gives an element's byte offset in that layout and
:func:`smem_desc` the descriptor::

    bits  0-13  start address >> 4          (shared space)
    bits 16-29  leading byte offset >> 4    (from one core matrix to the next along K)
    bits 32-45  stride byte offset >> 4     (from one 8-row group to the next along M or N)
    bits 62-63  swizzle mode                (0: none)

``acc`` is a local array of ``N / 2`` floats per thread.  Thread ``t`` of the
warpgroup (warp ``w = t // 32``, lane ``l``) holds, for ``i`` in 0..N/8-1::

    acc[4i + 0], acc[4i + 1] = D[16w + l // 4,     8i + 2 (l % 4) + {0, 1}]
    acc[4i + 2], acc[4i + 3] = D[16w + l // 4 + 8, 8i + 2 (l % 4) + {0, 1}]

-- per 8 columns, the layout of ``mma.sync``'s C fragment
(:mod:`nbattn.cuda.blocks.mma`).  ``tests/test_wgmma.py`` checks the product,
the layout and the descriptors against NumPy on a Hopper GPU; without one,
``benchmarks/ptx_without_gpu.py`` compiles it to sm_90a PTX and assembles it.
"""
from __future__ import annotations

from numba import uint64

from .mma import AVAILABLE
from .primitives import device_fn

__all__ = ["AVAILABLE", "core_offset", "smem_desc", "wgmma_fence", "wgmma_commit", "wgmma_wait0",
           "fence_proxy_async", "wgmma_m64n64k16_f16", "wgmma_m64n128k16_f16_rs"]

N_ACC = 32          # float32 accumulator registers a thread holds for m64n64


@device_fn
def core_offset(row, k, k_cores):
    """Byte offset of fp16 element (``row``, ``k``) of a K-major operand laid out as 8 x 8
    core matrices, ``k_cores`` of them along K in each 8-row group (no swizzle)."""
    return ((row // 8) * k_cores + k // 8) * 128 + (row % 8) * 16 + (k % 8) * 2


@device_fn
def smem_desc(addr, lead_bytes, stride_bytes):
    """The matrix descriptor of an operand at shared address ``addr`` (16-byte aligned),
    no swizzle: see the module doc for the fields."""
    return (uint64((addr & 0x3FFFF) >> 4) | (uint64((lead_bytes >> 4) & 0x3FFF) << uint64(16))
            | (uint64((stride_bytes >> 4) & 0x3FFF) << uint64(32)))


if AVAILABLE:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _f32, _u32, _u64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)

    def _bare(ptx: str):
        fnty = ir.FunctionType(ir.VoidType(), [])
        call = ir.InlineAsm(fnty, ptx, "~{memory}", side_effect=True)

        @intrinsic
        def bare(typingctx):
            def codegen(context, builder, sig, args):
                builder.call(call, [])
                return context.get_dummy_value()

            return types.none(), codegen

        return bare

    wgmma_fence = _bare("wgmma.fence.sync.aligned;")
    wgmma_commit = _bare("wgmma.commit_group.sync.aligned;")
    wgmma_wait0 = _bare("wgmma.wait_group.sync.aligned 0;")
    fence_proxy_async = _bare("fence.proxy.async.shared::cta;")

    def _wgmma_f16(n: int, a_in_registers: bool):
        """``wgmma(acc, a, desc_b, scale_d)``: m64 x n x k16, fp16 in, float32 ``acc`` (a
        local array of ``n // 2`` floats per thread).  ``a`` is A's descriptor, or with
        ``a_in_registers`` a 4-tuple of uint32: A's fragment, as ``mma.sync``'s."""
        regs = n // 2                          # accumulator floats a thread holds
        d = ",".join(f"${i}" for i in range(regs))
        n_a = 4 if a_in_registers else 1
        a = ("{" + ",".join(f"${regs + i}" for i in range(4)) + "}") if a_in_registers else f"${regs}"
        b, scale = f"${regs + n_a}", f"${regs + n_a + 1}"
        tail = "p, 1, 1, 0;" if a_in_registers else "p, 1, 1, 0, 0;"    # scales of A and B, transposes
        asm = ("{ .reg .pred p; setp.ne.b32 p, " + scale + ", 0; "
               f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 "
               "{" + d + "}, " + a + ", " + b + ", " + tail + " }")
        a_cons, a_ir = (["r"] * 4, [_u32] * 4) if a_in_registers else (["l"], [_u64])
        cons = ",".join(["=f"] * regs + a_cons + ["l", "r"] + [str(i) for i in range(regs)])
        fnty = ir.FunctionType(ir.LiteralStructType([_f32] * regs), a_ir + [_u64, _u32] + [_f32] * regs)
        call = ir.InlineAsm(fnty, asm, cons + ",~{memory}", side_effect=True)

        @intrinsic
        def wgmma(typingctx, acc, a, desc_b, scale_d):
            if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and acc.ndim == 1):
                return None
            if a_in_registers and not (isinstance(a, types.BaseTuple) and len(a) == 4):
                return None

            def codegen(context, builder, sig, args):
                arr = context.make_array(sig.args[0])(context, builder, value=args[0])
                ptrs = [cgutils.get_item_pointer(context, builder, sig.args[0], arr,
                                                 [ir.Constant(ir.IntType(64), i)], wraparound=False)
                        for i in range(regs)]
                if a_in_registers:
                    ins = [context.cast(builder, builder.extract_value(args[1], i), sig.args[1][i], types.uint32)
                           for i in range(4)]
                else:
                    ins = [context.cast(builder, args[1], sig.args[1], types.uint64)]
                ins += [context.cast(builder, args[2], sig.args[2], types.uint64),
                        context.cast(builder, args[3], sig.args[3], types.uint32)]
                out = builder.call(call, ins + [builder.load(p) for p in ptrs])
                for i, p in enumerate(ptrs):
                    builder.store(builder.extract_value(out, i), p)
                return context.get_dummy_value()

            return types.none(acc, a, desc_b, scale_d), codegen

        return wgmma

    wgmma_m64n64k16_f16 = _wgmma_f16(64, False)
    wgmma_m64n128k16_f16_rs = _wgmma_f16(128, True)

else:  # simulator: the names exist; no warpgroup runs there
    def _gpu_only(*args, **kwargs):
        raise RuntimeError("wgmma needs a Hopper GPU (the CUDA simulator is active)")

    wgmma_fence = wgmma_commit = wgmma_wait0 = fence_proxy_async = _gpu_only
    wgmma_m64n64k16_f16 = wgmma_m64n128k16_f16_rs = _gpu_only
