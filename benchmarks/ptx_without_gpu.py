"""Compile decode and prefill kernels to sm_90 PTX on a machine without a GPU (a diagnosis tool).

    CUDA_HOME=/usr/local/cuda-13.0 PYTHONPATH=$PWD python3 benchmarks/ptx_without_gpu.py --out /tmp/ptx
    ... --only tc_g4 warp_g4_f16      # some configurations only
    ... --list                         # the configurations

The simulator never compiles a kernel, so a change that types there can still
fail to compile for a GPU (``cuda.syncthreads_or`` takes an integer on the GPU
and a bool in the simulator, for example).  This script builds the package's
kernels in GPU mode with libnvvm (which a CUDA toolkit installs without a
driver), writes ``<out>/<config>.ptx`` (or ``<config>.err`` with the traceback)
and, when ``ptxas`` is on ``$CUDA_HOME/bin``, prints registers and spills per
configuration.  It fakes what only a device can say: the compute capability
(9, 0), the SM count (132) and nvrtc's list of architectures.  The argument
types are those the launches pass (``decode_problem.launch_for`` for decode,
``host.prefill_launch.launch_work`` for prefill).  The PTX is compute_90 (the
package builds compute_90a on a Hopper device; configurations named ``*_sm90a``
use Hopper-only instructions and are built and assembled for sm_90a); its
instruction counts show what a change adds, not how fast it runs.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import traceback

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

import numba  # noqa: E402
from numba import cuda  # noqa: E402
from numba import types as T  # noqa: E402


def _fake_device() -> None:
    """What numba asks a device for, answered for an H100/H200 (private numba-cuda names)."""
    import numba.cuda.cuda_paths as paths
    import numba.cuda.cudadrv.nvrtc as nvrtc
    import numba.cuda.dispatcher as disp

    class _Device:
        compute_capability = (9, 0)

    disp.get_current_device = lambda: _Device()
    paths._get_nvrtc_path = lambda: paths._env_path_tuple("absent", None)
    nvrtc.get_supported_ccs = lambda: [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]


def _arr(dt, ndim=1):
    return T.Array(dt, ndim, "C")


def decode_signature(cfg, out_dtype):
    """The warp / tensor-core decode kernel's argument types (``launch_for``)."""
    i32, i64, f32 = _arr(T.int32), T.int64, T.float32
    return (_arr(T.uint32), _arr(T.uint32), i32, i32, i32, i64, i64, i64, i64, i64, i64,
            i32, i32, i32, i32, i32, _arr(out_dtype), _arr(f32), _arr(f32), _arr(f32), _arr(f32), f32, f32, f32)


def smem_signature(out_dtype):
    """The teaching decode kernel's argument types (``launch_for``, grid of two dimensions)."""
    i32, i64, f32 = _arr(T.int32), T.int64, T.float32
    return (_arr(T.uint32), _arr(T.uint32), i32, i32, i32, i64, i64, i64, i32, i32, i32, i32, i32,
            _arr(out_dtype), _arr(f32), _arr(f32), _arr(f32), _arr(f32), f32, f32, f32)


def prefill_signature(masked: bool):
    """The paged fp32 prefill entry's argument types (``launch_work``; cache [pages, 2, page, Hkv, D])."""
    f32, i32 = T.float32, T.int32
    sig = (_arr(f32, 3), _arr(f32, 5), _arr(f32, 5), _arr(i32), _arr(T.int64, 2), _arr(i32), _arr(i32), _arr(i32),
           _arr(f32), T.int32, T.int32, _arr(f32, 3), _arr(f32, 2))
    return sig + ((_arr(T.uint8), _arr(T.int64, 2)) if masked else ())


def tc_prefill_signature():
    """The paged fp16 prefill entry's argument types (raw uint16 q, cache and out)."""
    f32, i32, u16 = T.float32, T.int32, T.uint16
    return (_arr(u16, 3), _arr(u16, 5), _arr(u16, 5), _arr(i32), _arr(T.int64, 2), _arr(i32), _arr(i32), _arr(i32),
            _arr(f32), T.int32, T.int32, _arr(u16, 3), _arr(f32, 2))


def persistent_signature(masked: bool):
    """The prefill wrapper's persistent entry: ``cta_indptr`` after ``work``."""
    sig = prefill_signature(masked)
    return sig[:5] + (_arr(T.int32),) + sig[5:]


def rope_signature(raw):
    """The standalone RoPE kernel's argument types (``nbattn.cuda.rope``)."""
    return (_arr(raw), _arr(raw), _arr(T.int64), T.float64, _arr(T.float64), T.int64, T.int64, T.int64)


def merge_tiles_signature():
    """The wrappers' fixed-grid merge (``nbattn.cuda.merge.merge_tiles_launch``)."""
    i32 = _arr(T.int32)
    return (i32,) * 6 + (_arr(T.float32), _arr(T.float32), _arr(T.uint16), _arr(T.float32)) + (T.int64,) * 4


def merge_partials_signature(fixed_grid: bool):
    """The split-KV contraction (``nbattn.cuda.merge.merge_partials_launch``; with
    ``fixed_grid`` the merge count first)."""
    i32, f32 = _arr(T.int32), _arr(T.float32)
    return ((i32,) if fixed_grid else ()) + (f32, f32, i32, i32, i32, _arr(T.uint16), f32, T.int64)


def configurations():
    """``{name: (build, signature)}``, built lazily (imports need GPU mode first)."""
    from nbattn.cuda.kernels.decode_common import make_config
    from nbattn.cuda.kernels.decode_smem import build_smem_kernel
    from nbattn.cuda.kernels.decode_tc import build_tc_kernel
    from nbattn.cuda.kernels.decode_warp import build_warp_kernel
    from nbattn.cuda.kernels.prefill_dispatch import get_kernel, get_persistent_kernel, make_spec
    from nbattn.cuda.kernels.merge_split import partials_kernel, tile_merge_kernel
    from nbattn.cuda.kernels.rope import rope_kernel
    from nbattn.cuda.kernels.wgmma_gemm import wgmma_gemm_kernel
    from nbattn.cuda.kernels.prefill_wgmma import prefill_wgmma_kernel
    from nbattn.cuda.tuning import DECODE, PREFILL
    from nbattn.variants import Variant

    plain, rope = Variant(), Variant(pos_encoding_mode="ROPE_LLAMA")
    u16 = T.uint16

    def fast(**kw):
        cfg = make_config(**dict(dict(code="f16", head_dim=128, kv_layout="NHD", variant=plain), **kw))
        if cfg.path == "tc":
            return build_tc_kernel(cfg, cfg.nthreads // 32, cfg.min_blocks)
        return build_warp_kernel(cfg, cfg.nthreads // 32, cfg.unroll, cfg.min_blocks)

    def smem(var):
        return build_smem_kernel(make_config("f16", 128, 4, "NHD", var, tuning=DECODE.replace(path="smem")))

    def prefill(var, masked, tuning=PREFILL):
        return get_kernel(make_spec("paged", "NHD", "f32", 128, 4, 2, var, None, tuning=tuning, custom_mask=masked))

    def tc_prefill(var, head_dim):
        return get_kernel(make_spec("paged", "NHD", "f16", head_dim, 4, 2, var, True))

    window = Variant(causal=True, window_left=1023)
    dsig = decode_signature(None, u16)
    return {
        "tc_g4": (lambda: fast(group=4), dsig),
        "tc_g8": (lambda: fast(group=8), dsig),
        "tc_g4_split": (lambda: fast(group=4, batch_kv_heads=8), dsig),
        "warp_g4_f16": (lambda: fast(group=4, tuning=DECODE.replace(path="warp")), dsig),
        "warp_g4_e4m3": (lambda: fast(group=4, kv_code="e4m3", tuning=DECODE.replace(path="warp")), dsig),
        "warp_g4_rope": (lambda: fast(group=4, variant=rope, tuning=DECODE.replace(path="warp")), dsig),
        "tc_g4_e4m3": (lambda: fast(group=4, kv_code="e4m3"), dsig),
        "tc_g8_e5m2": (lambda: fast(group=8, kv_code="e5m2"), dsig),
        "tc_g4_e4m3_bf16": (lambda: fast(group=4, kv_code="e4m3", code="bf16"), dsig),
        "tc_g4_e4m3_split": (lambda: fast(group=4, kv_code="e4m3", batch_kv_heads=8), dsig),
        "smem_plain": (lambda: smem(plain), smem_signature(u16)),
        "smem_rope": (lambda: smem(rope), smem_signature(u16)),
        "prefill_teaching_plain": (lambda: prefill(plain, False, PREFILL.replace(cuda_core=False)),
                                   prefill_signature(False)),
        "prefill_teaching_rope": (lambda: prefill(rope, False), prefill_signature(False)),
        "prefill_teaching_mask": (lambda: prefill(plain, True), prefill_signature(True)),
        "prefill_persistent_mask": (lambda: get_persistent_kernel(make_spec("paged", "NHD", "f32", 128, 4, 2, plain,
                                                                            None, custom_mask=True)),
                                    persistent_signature(True)),
        "prefill_pipelined_causal": (lambda: tc_prefill(Variant(causal=True), 128), tc_prefill_signature()),
        "prefill_pipelined_rope": (lambda: tc_prefill(Variant(causal=True, pos_encoding_mode="ROPE_LLAMA"), 128),
                                   tc_prefill_signature()),
        "prefill_pipelined_window": (lambda: tc_prefill(window, 128), tc_prefill_signature()),
        "prefill_mma_window_d96": (lambda: tc_prefill(window, 96), tc_prefill_signature()),
        "merge_tiles_prefill": (lambda: tile_merge_kernel("f16", 128, False), merge_tiles_signature()),
        "merge_partials_32": (lambda: partials_kernel("f16", 128, False, 4, 32), merge_partials_signature(False)),
        "merge_partials_256": (lambda: partials_kernel("f16", 128, False, 4, 256), merge_partials_signature(False)),
        "merge_partials_fixed_32": (lambda: partials_kernel("f16", 128, False, 4, 32, fixed_grid=True),
                                    merge_partials_signature(True)),
        "rope_f16": (lambda: rope_kernel("f16", False), rope_signature(u16)),
        "rope_bf16_interleaved": (lambda: rope_kernel("bf16", True), rope_signature(u16)),
        "rope_f32": (lambda: rope_kernel("f32", False), rope_signature(T.float32)),
        "wgmma_gemm_sm90a": (lambda: wgmma_gemm_kernel(8), (_arr(u16, 2), _arr(u16, 2), _arr(T.float32, 2))),
        "prefill_wgmma_causal_sm90a": (lambda: prefill_wgmma_kernel(True),
                                       (_arr(u16, 3), _arr(u16, 3), _arr(u16, 3), _arr(T.float32, 3),
                                        _arr(T.float32, 2), T.float32, T.int64)),
    }


def ptxas_stats(path: str, arch: str = "sm_90") -> str:
    ptxas = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas")
    if not os.path.exists(ptxas):
        return "(no ptxas)"
    r = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", os.devnull], capture_output=True, text=True)
    txt = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", txt)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", txt)
    return (f"{regs.group(1) if regs else '?'} registers, spills {spill.group(1)}/{spill.group(2)} bytes"
            if r.returncode == 0 else "ptxas failed: " + txt.strip()[-300:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/nbattn_ptx")
    ap.add_argument("--only", nargs="*", default=None, help="configuration names (default: all)")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    _fake_device()
    import nbattn  # noqa: F401  (GPU mode: NUMBA_ENABLE_CUDASIM=0 is set above)
    from nbattn import _compat
    from nbattn.cuda.host import driver
    assert _compat.BACKEND == "gpu", "nbattn chose the simulator"
    driver._SM_COUNT[:] = [132]
    driver._CC[:] = [(9, 0)]
    confs = configurations()
    if args.list:
        print("\n".join(confs))
        return 0
    os.makedirs(args.out, exist_ok=True)
    failed = 0
    for name in args.only or list(confs):
        build, sig = confs[name]
        try:
            kernel = build()
            bounds = kernel.targetoptions.get("launch_bounds")
            hopper = name.endswith("_sm90a")          # Hopper-only instructions (wgmma): compute_90a
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0, "a") if hopper else (9, 0),
                                      **({"launch_bounds": bounds} if bounds else {}))
            path = os.path.join(args.out, name + ".ptx")
            with open(path, "w") as f:
                f.write(ptx)
            stats = ptxas_stats(path, "sm_90a" if hopper else "sm_90")
            print(f"{name:24s} OK  {len(ptx.splitlines()):6d} PTX lines  {stats}", flush=True)
        except Exception:  # noqa: BLE001
            failed += 1
            with open(os.path.join(args.out, name + ".err"), "w") as f:
                f.write(traceback.format_exc())
            print(f"{name:24s} FAILED ({os.path.join(args.out, name + '.err')})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
