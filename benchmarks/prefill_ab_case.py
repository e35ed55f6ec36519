"""Time ``single_prefill`` (one request, 4k x 4k causal, plain and window 1023) from
the nbattn tree given, for same-visit A/B runs of two trees on one GPU.

    python3 benchmarks/prefill_ab_case.py --tree _ab/OLD     # then --tree .

Prints one JSON line: microseconds per call, eager back-to-back calls (20 per
timing, best of 5), fp16, 32 query / 8 KV heads, head_dim 128.
"""
import argparse
import json
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", required=True, help="folder holding the nbattn package to time")
    ap.add_argument("--len", type=int, default=4096, help="queries = keys")
    ap.add_argument("--window", type=int, default=1023, help="window_left of the window case")
    args = ap.parse_args(argv)
    tree = os.path.abspath(args.tree)
    sys.path.insert(0, tree)
    import torch
    import nbattn
    import nbattn.cuda as NC
    assert os.path.abspath(nbattn.__file__).startswith(tree), nbattn.__file__
    n, hq, hk, d = args.len, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(61)
    q, k, v = (torch.randn((n, h, d), dtype=torch.float16, device="cuda", generator=g) for h in (hq, hk, hk))
    res = {}
    for name, kw in (("plain", dict(causal=True)), ("window", dict(causal=True, window_left=args.window))):
        NC.single_prefill(q, k, v, **kw)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                NC.single_prefill(q, k, v, **kw)
            e.record()
            torch.cuda.synchronize()
            best = min(best, s.elapsed_time(e) / 20 * 1e3)
        res[name + "_us"] = round(best, 1)
    print(json.dumps({"tree": args.tree, **res}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
