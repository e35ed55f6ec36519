"""Tensor-core and wide-load intrinsics written as inline PTX (GPU only).

The prefill tensor-core tiles (:mod:`nbattn.cuda.kernels.prefill_mma`, ``prefill_pipelined``) are built on these
pieces, each one PTX instruction (or two) wrapped with ``numba.cuda.extending.intrinsic``
and an ``llvmlite.ir.InlineAsm`` call:

- ``mma_f16`` / ``mma_bf16``: ``mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}``,
  D = A @ B + C with A 16x16, B 16x8, C/D 16x8 fp32.  Operands are the PTX
  fragments: A four packed uint32 registers, B two, C four floats; the result
  is a 4-float tuple.  With ``g = lane // 4`` and ``t = lane % 4``:

      A regs: a0 = A[g, 2t:2t+2]   a1 = A[g+8, 2t:2t+2]
              a2 = A[g, 2t+8:2t+10] a3 = A[g+8, 2t+8:2t+10]
      B regs: b0 = B[2t:2t+2, g]   b1 = B[2t+8:2t+10, g]       ("col": k pairs of one column)
      C/D   : c0, c1 = C[g, 2t], C[g, 2t+1];  c2, c3 = C[g+8, 2t], C[g+8, 2t+1]

  The lower 16 bits of a packed register hold the lower k index.  The C
  layout of two neighbouring n-tiles is exactly the A layout of the next
  product, which is how softmax probabilities feed P @ V without a trip
  through shared memory.
- ``pack_f16x2`` / ``pack_bf16x2``: two floats rounded and packed into one
  uint32 (``cvt.rn.{f16,bf16}x2.f32``; the first argument lands in the low half).
- ``load_u32x4``: a 16-byte ``ld.global.nc.v4.u32`` of eight 2-byte elements
  starting at an element of an array of any rank, by multi-dimensional index
  (the address must be 16-byte aligned).  :func:`nbattn.cuda.blocks.primitives.load_v4`
  is the same load over a flat uint32 word view; this form lets the kernel
  index q and the paged cache with their own strides.

- ``global_addr``: the 64-bit address of ``array[index]`` (any rank), what the
  asynchronous copy reads from.
- ``shared_addr``: the shared-space (32-bit) address of a shared array's
  first element, the base of ``ldmatrix`` and ``cp.async`` destinations.
- ``cp_async16(dst, src, nbytes)``: ``cp.async.cg.shared.global`` of 16 bytes
  (``nbytes`` 16, or 0 to zero-fill the destination without reading);
  ``cp_async_commit()`` closes a group, ``cp_async_wait_all()`` waits for
  this thread's groups (``cp.async.wait_group 0``).  Other threads' copies are
  visible after the barrier that follows their waits.
- ``ldsm_x4(addr)`` / ``ldsm_x4_t(addr)``: ``ldmatrix.sync.aligned.m8n8.x4``
  (``.trans``) from shared memory: lanes 8i..8i+7 give the 16-byte row
  addresses of matrix i, register i of every lane receives its part of
  matrix i in the mma fragment layout (transposed: the k-pairs of a column).

The copy and ldmatrix instructions are volatile asm with a memory clobber:
LLVM keeps them in program order with the barriers around them.

Per-thread conversions (fp16/bf16 <-> float32, bit casts) live in
:mod:`nbattn.cuda.blocks.primitives`.

Warp-collective instructions have no meaning in numba's CUDA simulator; this
module only defines the intrinsics there (importing it is harmless) and the
kernel factory never picks the tensor-core path under the simulator.
"""
from __future__ import annotations

from ... import _compat  # noqa: F401  (numpy shim, simulator choice)

__all__ = ["AVAILABLE", "mma_f16", "mma_bf16", "pack_f16x2", "pack_bf16x2", "load_u32x4", "global_addr",
           "shared_addr", "cp_async16", "cp_async_commit", "cp_async_wait_all", "ldsm_x4", "ldsm_x4_t"]

AVAILABLE = not _compat.simulator_enabled()

if AVAILABLE:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.api_util import normalize_indices
    from numba.cuda.extending import intrinsic

    _f32, _u32 = ir.FloatType(), ir.IntType(32)

    def _mma(ptx_types: str):
        asm = ("mma.sync.aligned.m16n8k16.row.col.f32." + ptx_types + ".f32 "
               "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")
        fnty = ir.FunctionType(ir.LiteralStructType([_f32] * 4), [_u32] * 6 + [_f32] * 4)
        call = ir.InlineAsm(fnty, asm, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            ret = types.UniTuple(types.float32, 4)
            sig = ret(*([types.uint32] * 6 + [types.float32] * 4))

            def codegen(context, builder, sig, args):
                ins = [context.cast(builder, v, t, s) for v, t, s in zip(args, sig.args, sig.args)]
                out = builder.call(call, ins)
                parts = [builder.extract_value(out, i) for i in range(4)]
                return context.make_tuple(builder, sig.return_type, parts)

            return sig, codegen

        return mma

    mma_f16 = _mma("f16.f16")
    mma_bf16 = _mma("bf16.bf16")

    def _pack(kind: str):
        # cvt.rn.f16x2.f32 d, hi, lo puts `hi` in the upper half.
        fnty = ir.FunctionType(_u32, [_f32, _f32])
        call = ir.InlineAsm(fnty, f"cvt.rn.{kind}x2.f32 $0, $1, $2;", "=r,f,f")

        @intrinsic
        def pack(typingctx, lo, hi):
            sig = types.uint32(types.float32, types.float32)

            def codegen(context, builder, sig_, args):
                lo_v = context.cast(builder, args[0], lo, types.float32)
                hi_v = context.cast(builder, args[1], hi, types.float32)
                return builder.call(call, [hi_v, lo_v])

            return sig, codegen

        return pack

    pack_f16x2 = _pack("f16")
    pack_bf16x2 = _pack("bf16")

    def _element_pointer(context, builder, array_type, array, index_type, index):
        index_type, indices = normalize_indices(context, builder, index_type, index,
                                                array_type, array_type.dtype)
        arr = context.make_array(array_type)(context, builder, value=array)
        return cgutils.get_item_pointer(context, builder, array_type, arr, indices,
                                        wraparound=False)

    @intrinsic
    def load_u32x4(typingctx, array, index):
        """Eight 2-byte elements from ``array[index]`` on, as 4 uint32 (16 bytes)."""
        ret = types.UniTuple(types.uint32, 4)
        sig = ret(array, index)

        def codegen(context, builder, sig_, args):
            ptr = _element_pointer(context, builder, sig_.args[0], args[0], sig_.args[1], args[1])
            fnty = ir.FunctionType(ir.LiteralStructType([_u32] * 4), [ir.IntType(64)])
            call = ir.InlineAsm(fnty, "ld.global.nc.v4.u32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,l")
            out = builder.call(call, [builder.ptrtoint(ptr, ir.IntType(64))])
            return context.make_tuple(builder, ret, [builder.extract_value(out, i) for i in range(4)])

        return sig, codegen

    _u64 = ir.IntType(64)

    @intrinsic
    def global_addr(typingctx, array, index):
        """Address of ``array[index]`` as uint64."""
        sig = types.uint64(array, index)

        def codegen(context, builder, sig_, args):
            ptr = _element_pointer(context, builder, sig_.args[0], args[0], sig_.args[1], args[1])
            return builder.ptrtoint(ptr, _u64)

        return sig, codegen

    @intrinsic
    def shared_addr(typingctx, array):
        """Shared-space address of a shared array's data (uint32)."""
        sig = types.uint32(array)

        def codegen(context, builder, sig_, args):
            arr = context.make_array(sig_.args[0])(context, builder, value=args[0])
            generic = builder.ptrtoint(arr.data, _u64)
            fnty = ir.FunctionType(_u32, [_u64])
            call = ir.InlineAsm(fnty, "{ .reg .u64 t; cvta.to.shared.u64 t, $1; cvt.u32.u64 $0, t; }",
                                "=r,l")
            return builder.call(call, [generic])

        return sig, codegen

    @intrinsic
    def cp_async16(typingctx, dst, src, nbytes):
        sig = types.none(types.uint32, types.uint64, types.int32)

        def codegen(context, builder, sig_, args):
            ins = [context.cast(builder, v, t, s) for v, t, s in zip(args, (dst, src, nbytes), sig_.args)]
            fnty = ir.FunctionType(ir.VoidType(), [_u32, _u64, _u32])
            call = ir.InlineAsm(fnty, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                                side_effect=True)
            builder.call(call, ins)
            return context.get_dummy_value()

        return sig, codegen

    def _bare(ptx: str):
        fnty = ir.FunctionType(ir.VoidType(), [])
        call = ir.InlineAsm(fnty, ptx, "~{memory}", side_effect=True)

        @intrinsic
        def bare(typingctx):
            sig = types.none()

            def codegen(context, builder, sig_, args):
                builder.call(call, [])
                return context.get_dummy_value()

            return sig, codegen

        return bare

    cp_async_commit = _bare("cp.async.commit_group;")
    cp_async_wait_all = _bare("cp.async.wait_group 0;")

    def _ldsm(trans: bool):
        t = ".trans" if trans else ""
        fnty = ir.FunctionType(ir.LiteralStructType([_u32] * 4), [_u32])
        call = ir.InlineAsm(fnty, f"ldmatrix.sync.aligned.m8n8.x4{t}.shared.b16 {{$0,$1,$2,$3}}, [$4];",
                            "=r,=r,=r,=r,r,~{memory}", side_effect=True)

        @intrinsic
        def ldsm(typingctx, addr):
            ret = types.UniTuple(types.uint32, 4)
            sig = ret(types.uint32)

            def codegen(context, builder, sig_, args):
                a = context.cast(builder, args[0], addr, types.uint32)
                out = builder.call(call, [a])
                return context.make_tuple(builder, ret, [builder.extract_value(out, i) for i in range(4)])

            return sig, codegen

        return ldsm

    ldsm_x4 = _ldsm(False)
    ldsm_x4_t = _ldsm(True)

else:  # simulator: names exist, calling them is an error the factory never makes
    def _gpu_only(*args, **kwargs):
        raise RuntimeError("tensor-core intrinsics need a real GPU (the CUDA simulator is active)")

    mma_f16 = mma_bf16 = pack_f16x2 = pack_bf16x2 = load_u32x4 = _gpu_only
    global_addr = shared_addr = cp_async16 = cp_async_commit = cp_async_wait_all = _gpu_only
    ldsm_x4 = ldsm_x4_t = _gpu_only



# movmatrix (the decode tensor-core path, nbattn.cuda.kernels.decode_tc): the transpose of
# an 8x8 b16 matrix held in the mma fragment layout (lane 4g + t has row g, columns
# 2t, 2t+1 in one uint32), returned in the same layout.  Warp-collective.
__all__ += ["movmatrix_t"]

if AVAILABLE:
    @intrinsic
    def movmatrix_t(typingctx, a):
        sig = types.uint32(types.uint32)

        def codegen(context, builder, sig_, args):
            fnty = ir.FunctionType(_u32, [_u32])
            call = ir.InlineAsm(fnty, "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r")
            return builder.call(call, [context.cast(builder, args[0], sig_.args[0], types.uint32)])

        return sig, codegen
else:
    movmatrix_t = _gpu_only


# Programmatic dependent launch (sm_90, PTX griddepcontrol).  A kernel launched with
# programmatic stream serialization (:func:`nbattn.cuda.host.driver.launch_programmatic`)
# may start while the kernel before it on the stream still runs; ``grid_dependency_wait``
# blocks until that kernel has finished and its writes are visible, so what comes before
# the wait may only read data no earlier kernel writes.  ``grid_dependents_launch`` lets
# such a follower start before this kernel ends.  Without a programmatic launch both do
# nothing; in the simulator they are empty device functions.
#
# The wait returns an int32 zero that the compiler cannot see through.  The memory
# clobber orders plain loads after the wait, but the ``ld.global.nc`` intrinsics
# (``primitives.load_v4``) are side-effect-free asm that LLVM may hoist above it;
# adding the zero into an index that every later load derives from (a request id)
# makes those loads depend on the wait.
__all__ += ["grid_dependency_wait", "grid_dependents_launch"]

if AVAILABLE:
    @intrinsic
    def grid_dependency_wait(typingctx):
        sig = types.int32()

        def codegen(context, builder, sig_, args):
            fnty = ir.FunctionType(_u32, [])
            call = ir.InlineAsm(fnty, "griddepcontrol.wait;\n\tmov.u32 $0, 0;", "=r,~{memory}",
                                side_effect=True)
            return builder.call(call, [])

        return sig, codegen

    grid_dependents_launch = _bare("griddepcontrol.launch_dependents;")
else:
    from numba import cuda as _cuda

    @_cuda.jit(device=True)
    def grid_dependency_wait():
        return 0

    @_cuda.jit(device=True)
    def grid_dependents_launch():
        return None


# fp8 -> fp16 / bf16 (the decode tensor-core path's fp8 caches): the four fp8 values of a word
# as two 16-bit pair words, ``lo`` holding elements 0, 1 and ``hi`` elements 2, 3 (the lower
# element in the lower half, as everywhere).  ``cvt.rn.f16x2.{e4m3x2,e5m2x2}`` (sm_89 and
# later) turns each 16-bit half of the word into an fp16 pair; for bf16 each fp16 value goes
# on through float32 (``cvt.f32.f16``, ``cvt.rn.bf16x2.f32``).  Every step is exact: every
# e4m3fn and e5m2 value is an fp16 and a bf16 value (e4m3fn's largest, 448, and smallest
# subnormal, 2^-9; e5m2's 57344 and 2^-16), NaN codes stay NaN and e5m2's infinities
# infinities.
__all__ += ["fp8x4_to_16x2"]

if AVAILABLE:
    def _fp8_to_16x2(kind: str, to: str):
        if to == "f16":
            ptx = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                   f"cvt.rn.f16x2.{kind}x2 $0, lo; cvt.rn.f16x2.{kind}x2 $1, hi; }}")
        else:
            ptx = ("{ .reg .b16 lo, hi, x0, x1, x2, x3; .reg .b32 a, b; .reg .f32 f0, f1, f2, f3; "
                   f"mov.b32 {{lo, hi}}, $2; cvt.rn.f16x2.{kind}x2 a, lo; cvt.rn.f16x2.{kind}x2 b, hi; "
                   "mov.b32 {x0, x1}, a; mov.b32 {x2, x3}, b; "
                   "cvt.f32.f16 f0, x0; cvt.f32.f16 f1, x1; cvt.f32.f16 f2, x2; cvt.f32.f16 f3, x3; "
                   "cvt.rn.bf16x2.f32 $0, f1, f0; cvt.rn.bf16x2.f32 $1, f3, f2; }")
        call = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_u32, _u32]), [_u32]), ptx, "=r,=r,r")

        @intrinsic
        def conv(typingctx, w):
            if not isinstance(w, types.Integer):
                return None
            ret = types.UniTuple(types.uint32, 2)

            def codegen(context, builder, sig_, args):
                out = builder.call(call, [context.cast(builder, args[0], sig_.args[0], types.uint32)])
                return context.make_tuple(builder, ret, [builder.extract_value(out, 0),
                                                         builder.extract_value(out, 1)])

            return ret(w), codegen

        return conv

    _FP8_TO_16X2 = {(k, t): _fp8_to_16x2(k, t) for k in ("e4m3", "e5m2") for t in ("f16", "bf16")}

    def fp8x4_to_16x2(code: str, to: str):
        """The intrinsic ``w -> (lo, hi)`` from fp8 kernel code ``code`` (``"e4m3"`` /
        ``"e5m2"``) to 16-bit pairs of ``to`` (``"f16"`` / ``"bf16"``)."""
        return _FP8_TO_16X2[(code, to)]
else:
    def fp8x4_to_16x2(code: str, to: str):
        return _gpu_only
