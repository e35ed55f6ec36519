"""Per-thread GPU primitives with two faces: inline PTX on the GPU, plain Python
under numba's CUDA simulator.

Why this module exists (docs/gpu.md): plain 4-byte numba loads reach only
0.73-0.86 of the H200's copy bandwidth, a 16-byte ``ld.global.nc.v4.u32``
reaches ~1.0; and fp16/bf16 data is easiest to move as raw 32-bit words (two
16-bit values each) and unpack in registers.  The simulator runs no PTX, so
each primitive here also has a Python face with the same name and meaning.
Kernels import the names from here and never branch on the backend.

Interface (stable; the prefill/sparse/cascade kernels use it too):

    load_v4(words, i)        -> (w0, w1, w2, w3)  uint32 words i..i+3 of a 1-D uint32
                                array; i*4 bytes must be 16-byte aligned on the GPU.
                                Read-only (non-coherent) cache path: only for data the
                                kernel never writes.
    load_i32_cg(arr, i)      -> int32 arr[i] of a 1-D int32 array read through L2 only
                                (ld.global.cg): a value read before a programmatic
                                dependency wait as a hint, so that no stale L1 line
                                outlives the wait.
    prefetch_l2(words, i)    -> hint: bring the line holding uint32 word i of a 1-D
                                uint32 array into L2 (prefetch.global.L2); no result.
    ld_v4(arr, i)            -> 4 elements i..i+3 of a 1-D 4-byte array (uint32 or
                                float32), one 16-byte access (shared memory tiles:
                                allocate them with alignment=SHARED_ALIGN)
    st_v4(arr, i, a, b, c, d)   store 4 elements the same way
    u32_as_f32(w)            -> float32 with the bits of uint32 w
    f32_as_u32(x)            -> uint32 with the bits of float32 x
    f16x2_to_f32(w)          -> (lo, hi) float32 of the two fp16 halves of word w
    bf16x2_to_f32(w)         -> (lo, hi) float32 of the two bf16 halves of word w
    f32_to_f16_bits(x)       -> uint16 bits of x rounded to fp16 (nearest even)
    f32_to_bf16_bits(x)      -> uint16 bits of x rounded to bf16 (nearest even, NaN kept)
    exp2f(x)                 -> 2**x in float32 (ex2.approx on the GPU; exp2f(-inf) = 0)
    mul_mid_u32(a, hi, lo)   -> uint32 bits 32..63 of a * (hi * 2**32 + lo), all uint32
                                (mul.hi + mad.lo on the GPU)
    cos_sin_approx(a)        -> (cos a, sin a) in float32 for |a| <= pi (cos.approx /
                                sin.approx on the GPU, about 5e-7 off; exact under the simulator)
    device_fn                   decorator: a force-inlined device function (plain
                                cuda.jit(device=True) under the simulator)
    shfl_xor_f32(x, lane_mask)  -> float32 x of lane (lane ^ lane_mask) of this warp
                                (all 32 lanes take part).  Under the simulator it
                                is a *block-wide* exchange through shared memory
                                with two barriers: every thread of the block must
                                call it at the same point.  It exists so that the
                                warp-level decode path can be checked on the CPU.
    shfl_idx_f32(x, src_lane)   -> float32 x of lane src_lane (0..31) of this warp;
                                same two faces and the same caveat.

Little-endian: the element with the lower index is the low half of a word.
Warp-collective primitives (shuffles, mma.sync, ldmatrix) are GPU-only and do
not belong here; kernels that want them pick a shared-memory path under the
simulator.
"""
from __future__ import annotations

import struct

import numpy as np

from ..._compat import simulator_enabled

__all__ = ["load_v4", "load_i32_cg", "prefetch_l2", "ld_v4", "st_v4", "SHARED_ALIGN", "u32_as_f32", "f32_as_u32",
           "f16x2_to_f32", "bf16x2_to_f32", "f32_to_f16_bits", "f32_to_bf16_bits", "exp2f", "cos_sin_approx",
           "mul_mid_u32", "device_fn",
           "SIMULATOR", "shfl_xor_f32", "shfl_idx_f32", "warp_sync"]

SIMULATOR = simulator_enabled()
# cuda.shared.array(..., alignment=SHARED_ALIGN): 16-byte alignment for ld_v4/st_v4
# on the GPU; the simulator refuses any alignment argument but None.
SHARED_ALIGN = None if SIMULATOR else 16


def _bf16_bits_rne(bits: int) -> int:
    """Round float32 bits to bf16 bits, nearest even; NaN stays a (quiet) NaN."""
    bits &= 0xFFFFFFFF
    if (bits & 0x7F800000) == 0x7F800000 and (bits & 0x007FFFFF):
        return ((bits >> 16) | 0x0040) & 0xFFFF
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16) & 0xFFFF


if SIMULATOR:
    from numba import cuda

    _F = struct.Struct("<f")
    _I = struct.Struct("<I")
    _E = struct.Struct("<e")
    _H = struct.Struct("<H")

    import math

    device_fn = cuda.jit(device=True)

    def exp2f(x):
        return np.float32(math.exp2(float(x))) if x != -math.inf else np.float32(0.0)

    def cos_sin_approx(a):
        return np.float32(math.cos(float(a))), np.float32(math.sin(float(a)))

    def mul_mid_u32(a, hi, lo):
        wide = (int(hi) & 0xFFFFFFFF) << 32 | (int(lo) & 0xFFFFFFFF)
        return np.uint32((((int(a) & 0xFFFFFFFF) * wide) >> 32) & 0xFFFFFFFF)

    def load_v4(words, i):
        return words[i], words[i + 1], words[i + 2], words[i + 3]

    def load_i32_cg(arr, i):
        return arr[i]

    def prefetch_l2(words, i):
        return None

    def ld_v4(arr, i):
        return arr[i], arr[i + 1], arr[i + 2], arr[i + 3]

    def st_v4(arr, i, a, b, c, d):
        arr[i] = a
        arr[i + 1] = b
        arr[i + 2] = c
        arr[i + 3] = d

    def u32_as_f32(w):
        return np.float32(_F.unpack(_I.pack(int(w) & 0xFFFFFFFF))[0])

    def f32_as_u32(x):
        return np.uint32(_I.unpack(_F.pack(float(x)))[0])

    def f16x2_to_f32(w):
        w = int(w)
        lo = _E.unpack(_H.pack(w & 0xFFFF))[0]
        hi = _E.unpack(_H.pack((w >> 16) & 0xFFFF))[0]
        return np.float32(lo), np.float32(hi)

    def bf16x2_to_f32(w):
        w = int(w)
        return u32_as_f32((w & 0xFFFF) << 16), u32_as_f32(w & 0xFFFF0000)

    def f32_to_f16_bits(x):
        return np.uint16(np.float16(np.float32(x)).view(np.uint16))

    def f32_to_bf16_bits(x):
        return np.uint16(_bf16_bits_rne(int(f32_as_u32(x))))

    @device_fn
    def shfl_xor_f32(x, lane_mask):
        # simulated threads are Python threads of one block: emulate the warp
        # exchange with a block-shared scratch (one allocation per block)
        buf = cuda.shared.array(1024, np.float32)
        tid = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        buf[tid] = x
        cuda.syncthreads()
        y = buf[tid ^ int(lane_mask)]
        cuda.syncthreads()
        return np.float32(y)

    @device_fn
    def warp_sync():
        # the simulator's "warps" are slices of one block of Python threads
        cuda.syncthreads()

    @device_fn
    def shfl_idx_f32(x, src_lane):
        buf = cuda.shared.array(1024, np.float32)
        tid = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        buf[tid] = x
        cuda.syncthreads()
        y = buf[tid - tid % 32 + int(src_lane)]
        cuda.syncthreads()
        return np.float32(y)

else:  # pragma: no cover - needs a GPU
    from llvmlite import ir
    from numba import cuda, float32, types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    device_fn = cuda.jit(device=True, forceinline=True)

    _i32 = ir.IntType(32)
    _i16 = ir.IntType(16)
    _f32 = ir.FloatType()

    def _element_ptr(context, builder, arrty, arr, idx):
        ary = context.make_array(arrty)(context, builder, value=arr)
        return cgutils.get_item_pointer(context, builder, arrty, ary, [idx], wraparound=False)

    def _load_v4_intrinsic(ptx: str):
        @intrinsic
        def load(typingctx, words, i):
            if not (isinstance(words, types.Array) and words.ndim == 1 and words.dtype == types.uint32):
                return None
            ret = types.UniTuple(types.uint32, 4)

            def codegen(context, builder, sig, args):
                ptr = _element_ptr(context, builder, sig.args[0], args[0],
                                   context.cast(builder, args[1], sig.args[1], types.intp))
                fnty = ir.FunctionType(ir.LiteralStructType([_i32] * 4), [ptr.type])
                asm = ir.InlineAsm(fnty, ptx, "=r,=r,=r,=r,l", side_effect=False)
                st = builder.call(asm, [ptr])
                vals = [builder.extract_value(st, k) for k in range(4)]
                return context.make_tuple(builder, ret, vals)

            return ret(words, i), codegen
        return load

    load_v4 = _load_v4_intrinsic("ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];")

    def _pointer_asm(dtype, ret_ir, ret, ptx: str, constraints: str):
        """An intrinsic ``(arr, i)`` running ``ptx`` on the address of ``arr[i]`` (a 1-D
        array of ``dtype``); it returns ``ret`` (``types.none``: nothing)."""
        @intrinsic
        def op(typingctx, arr, i):
            if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == dtype):
                return None

            def codegen(context, builder, sig, args):
                ptr = _element_ptr(context, builder, sig.args[0], args[0],
                                   context.cast(builder, args[1], sig.args[1], types.intp))
                asm = ir.InlineAsm(ir.FunctionType(ret_ir, [ptr.type]), ptx, constraints, side_effect=True)
                value = builder.call(asm, [ptr])
                return context.get_dummy_value() if ret == types.none else value

            return ret(arr, i), codegen
        return op

    load_i32_cg = _pointer_asm(types.int32, _i32, types.int32, "ld.global.cg.s32 $0, [$1];", "=r,l")
    prefetch_l2 = _pointer_asm(types.uint32, ir.VoidType(), types.none, "prefetch.global.L2 [$0];", "l")

    def _vec_ptr(context, builder, arrty, arr, idx):
        ptr = _element_ptr(context, builder, arrty, arr, context.cast(builder, idx, types.intp, types.intp))
        elt = context.get_value_type(arrty.dtype)
        return builder.bitcast(ptr, ir.VectorType(elt, 4).as_pointer())

    def _four_byte_array(arr):
        return (isinstance(arr, types.Array) and arr.ndim == 1
                and arr.dtype in (types.uint32, types.float32, types.int32))

    @intrinsic
    def ld_v4(typingctx, arr, i):
        if not (_four_byte_array(arr) and isinstance(i, types.Integer)):
            return None
        ret = types.UniTuple(arr.dtype, 4)

        def codegen(context, builder, sig, args):
            idx = context.cast(builder, args[1], sig.args[1], types.intp)
            vec = builder.load(_vec_ptr(context, builder, sig.args[0], args[0], idx), align=16)
            vals = [builder.extract_element(vec, ir.Constant(_i32, k)) for k in range(4)]
            return context.make_tuple(builder, ret, vals)

        return ret(arr, i), codegen

    @intrinsic
    def st_v4(typingctx, arr, i, a, b, c, d):
        if not (_four_byte_array(arr) and isinstance(i, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            arrty = sig.args[0]
            idx = context.cast(builder, args[1], sig.args[1], types.intp)
            elt = context.get_value_type(arrty.dtype)
            vec = ir.Constant(ir.VectorType(elt, 4), ir.Undefined)
            for k in range(4):
                v = context.cast(builder, args[2 + k], sig.args[2 + k], arrty.dtype)
                vec = builder.insert_element(vec, v, ir.Constant(_i32, k))
            builder.store(vec, _vec_ptr(context, builder, arrty, args[0], idx), align=16)
            return context.get_dummy_value()

        return types.void(arr, i, a, b, c, d), codegen

    def _bitcast(src_kind, src, dst, dst_ir):
        """An intrinsic ``(x) -> dst``: ``x`` (any ``src_kind`` number) cast to ``src``,
        its 32 bits read as ``dst``."""
        @intrinsic
        def bitcast(typingctx, x):
            if not isinstance(x, src_kind):
                return None

            def codegen(context, builder, sig, args):
                return builder.bitcast(context.cast(builder, args[0], sig.args[0], src), dst_ir)

            return dst(x), codegen
        return bitcast

    u32_as_f32 = _bitcast(types.Integer, types.uint32, types.float32, _f32)
    f32_as_u32 = _bitcast(types.Float, types.float32, types.uint32, _i32)

    def _pair_asm(ptx: str, kind, arg, arg_ir, constraints: str):
        """An intrinsic ``(x) -> (float32, float32)``: ``ptx`` on ``x`` (any ``kind``
        number) cast to ``arg``, its two outputs ``$0`` and ``$1``."""
        ret = types.UniTuple(types.float32, 2)

        @intrinsic
        def op(typingctx, x):
            if not isinstance(x, kind):
                return None

            def codegen(context, builder, sig, args):
                v = context.cast(builder, args[0], sig.args[0], arg)
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_f32, _f32]), [arg_ir]), ptx, constraints,
                                   side_effect=False)
                st = builder.call(asm, [v])
                return context.make_tuple(builder, ret, [builder.extract_value(st, 0), builder.extract_value(st, 1)])

            return ret(x), codegen
        return op

    f16x2_to_f32 = _pair_asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
                             types.Integer, types.uint32, _i32, "=f,=f,r")

    def _f32_asm(ptx: str, ret, ret_ir, constraints: str):
        """An intrinsic ``(x) -> ret``: ``ptx`` on ``x`` (any float) cast to float32."""
        @intrinsic
        def op(typingctx, x):
            if not isinstance(x, types.Float):
                return None

            def codegen(context, builder, sig, args):
                v = context.cast(builder, args[0], sig.args[0], types.float32)
                asm = ir.InlineAsm(ir.FunctionType(ret_ir, [_f32]), ptx, constraints, side_effect=False)
                return builder.call(asm, [v])

            return ret(x), codegen
        return op

    exp2f = _f32_asm("ex2.approx.ftz.f32 $0, $1;", types.float32, _f32, "=f,f")

    @intrinsic
    def mul_mid_u32(typingctx, a, hi, lo):
        if not all(isinstance(x, types.Integer) for x in (a, hi, lo)):
            return None

        def codegen(context, builder, sig, args):
            x, h, l_ = (context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args))
            asm = ir.InlineAsm(ir.FunctionType(_i32, [_i32, _i32, _i32]),
                               "{ .reg .u32 t; mul.hi.u32 t, $1, $3; mad.lo.u32 $0, $1, $2, t; }", "=r,r,r,r",
                               side_effect=False)
            return builder.call(asm, [x, h, l_])

        return types.uint32(a, hi, lo), codegen

    cos_sin_approx = _pair_asm("cos.approx.ftz.f32 $0, $2; sin.approx.ftz.f32 $1, $2;", types.Float, types.float32,
                               _f32, "=f,=f,f")

    @device_fn
    def shfl_xor_f32(x, lane_mask):
        return cuda.shfl_xor_sync(0xFFFFFFFF, float32(x), lane_mask)

    @device_fn
    def shfl_idx_f32(x, src_lane):
        return cuda.shfl_sync(0xFFFFFFFF, float32(x), src_lane)

    @device_fn
    def warp_sync():
        cuda.syncwarp(0xFFFFFFFF)

    @device_fn
    def bf16x2_to_f32(w):
        lo = u32_as_f32((w & 0xFFFF) << 16)
        hi = u32_as_f32(w & 0xFFFF0000)
        return lo, hi

    f32_to_f16_bits = _f32_asm("cvt.rn.f16.f32 $0, $1;", types.uint16, _i16, "=h,f")

    @device_fn
    def f32_to_bf16_bits(x):
        bits = f32_as_u32(x)
        if (bits & 0x7F800000) == 0x7F800000 and (bits & 0x007FFFFF) != 0:
            return types.uint16(((bits >> 16) | 0x0040) & 0xFFFF)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        return types.uint16((rounded >> 16) & 0xFFFF)


# ---------------------------------------------------------------------------
# Element access by dtype code ("f16" | "bf16" | "f32"), shared by all kernels.
# Raw arrays: uint16 for 16-bit floats, float32 for fp32; words: uint32.
# ---------------------------------------------------------------------------

ELEMS_PER_WORD = {"f16": 2, "bf16": 2, "f32": 1, "e4m3": 4, "e5m2": 4}   # fp8 K/V: nbattn.cuda.blocks.fp8

_io_cache: dict = {}


def element_io(code: str):
    """``(load_elem, store_elem, unpack4)`` device functions for dtype ``code``.

    load_elem(raw, i) -> float32           element i of a raw array
    store_elem(raw, i, x)                  round x to the dtype and store it
    unpack4(w0, w1, w2, w3, dst, off)      the 4*ELEMS_PER_WORD values of 4 words
                                           into float32 dst[off:off+4*EPW]
    """
    if code in _io_cache:
        return _io_cache[code]
    from numba import float32

    if code == "f32":
        @device_fn
        def load_elem(raw, i):
            return float32(raw[i])

        @device_fn
        def store_elem(raw, i, x):
            raw[i] = float32(x)

        @device_fn
        def unpack4(w0, w1, w2, w3, dst, off):
            dst[off] = u32_as_f32(w0)
            dst[off + 1] = u32_as_f32(w1)
            dst[off + 2] = u32_as_f32(w2)
            dst[off + 3] = u32_as_f32(w3)
    else:
        pair = f16x2_to_f32 if code == "f16" else bf16x2_to_f32
        to_bits = f32_to_f16_bits if code == "f16" else f32_to_bf16_bits

        @device_fn
        def load_elem(raw, i):
            w = raw[i]
            lo, _ = pair(w)
            return lo

        @device_fn
        def store_elem(raw, i, x):
            raw[i] = to_bits(x)

        @device_fn
        def unpack4(w0, w1, w2, w3, dst, off):
            a, b = pair(w0)
            dst[off] = a
            dst[off + 1] = b
            a, b = pair(w1)
            dst[off + 2] = a
            dst[off + 3] = b
            a, b = pair(w2)
            dst[off + 4] = a
            dst[off + 5] = b
            a, b = pair(w3)
            dst[off + 6] = a
            dst[off + 7] = b

    _io_cache[code] = (load_elem, store_elem, unpack4)
    return _io_cache[code]
