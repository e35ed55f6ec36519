"""Compare GPU result files record by record: did a change make anything slower?

    python3 benchmarks/compare_results.py OLD_DIR NEW_DIR decode cascade ... [--out FILE] [--commit SHA]

Records of a suite are matched by ``case`` and ``metric``.  For each match the
file says the old and new value, their ratio (new / old, oriented so that
> 1 means better: a latency's ratio is old / new), and the same ratio after
dividing each by its same-run peer where the record is a bandwidth fraction or
TFLOP/s with one (the peer moves
with the machine, so the normalised ratio separates a code change from a
slower or faster device visit).  A suite-level summary gives the median and
the worst ratio.  Nothing here runs a GPU; it reads two directories of files
written by the ``gpu_*.py`` scripts.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics

LOWER_IS_BETTER = ("latency_us", "us", "ms", "s")


def _key(rec: dict) -> str:
    return json.dumps([rec["case"], rec["metric"]], sort_keys=True)


def _better_ratio(metric: str, unit: str, old: float, new: float) -> float:
    lower = unit in LOWER_IS_BETTER or metric.startswith("latency")
    return old / new if lower else new / old


def _peer(rec: dict) -> float | None:
    for name in ("sdpa_cudnn", "cudnn", "sdpa_flash", "flash", "flat_decode", "contiguous"):
        v = (rec.get("peers") or {}).get(name)
        if isinstance(v, (int, float)) and v > 0:
            return float(v)
    return None


def compare_suite(old: dict, new: dict) -> dict:
    """Matched records of one suite, each with its ratio (and peer-normalised ratio)."""
    olds = {_key(r): r for r in old["records"]}
    rows, missing = [], []
    for r in new["records"]:
        o = olds.get(_key(r))
        if o is None or not isinstance(o.get("value"), (int, float)) or not isinstance(r.get("value"), (int, float)):
            missing.append(r["case"])
            continue
        if o["value"] <= 0 or r["value"] <= 0 or r["metric"].startswith(("max_abs_err", "bitwise", "sanitizer")):
            continue
        ratio = _better_ratio(r["metric"], r.get("unit", ""), o["value"], r["value"])
        po, pn = _peer(o), _peer(r)
        norm = None
        if po and pn and not r["metric"].startswith("latency"):
            # peers of a bandwidth fraction or TFLOP/s record are in the record's own unit
            norm = ratio / (pn / po)
        rows.append({"case": r["case"], "metric": r["metric"], "old": o["value"], "new": r["value"],
                     "ratio": ratio, "peer_normalised_ratio": norm})
    ratios = [x["ratio"] for x in rows]
    return {"matched": len(rows), "unmatched_new_records": len(missing),
            "median_ratio": statistics.median(ratios) if ratios else None,
            "worst_ratio": min(ratios) if ratios else None,
            "old_commit_command": old.get("command"), "old_date": old.get("date"),
            "new_date": new.get("date"), "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old_dir")
    ap.add_argument("new_dir")
    ap.add_argument("suites", nargs="+", help="suite names, e.g. decode decode_b1 prefill cascade")
    ap.add_argument("--out", default=None, help="write the comparison here (JSON)")
    ap.add_argument("--commit", default=None, help="the commit the new files measured")
    a = ap.parse_args(argv)
    result = {"suite": "compare", "date": datetime.date.today().isoformat(), "commit": a.commit,
              "command": "python3 benchmarks/compare_results.py " + " ".join(argv or []), "suites": {}}
    for s in a.suites:
        old = json.loads((pathlib.Path(a.old_dir) / f"{s}.json").read_text())
        newp = pathlib.Path(a.new_dir) / f"{s}.json"
        if not newp.exists():
            result["suites"][s] = {"missing": str(newp)}
            continue
        result["suites"][s] = compare_suite(old, json.loads(newp.read_text()))
        c = result["suites"][s]
        print(f"{s}: {c['matched']} matched, median ratio {c['median_ratio']}, worst {c['worst_ratio']}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
