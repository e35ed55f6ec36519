"""Benchmark result files: the one door through which measured data enters figures.

Format (docs/gpu.md, "Reading a result file"): one JSON file per
suite, ``benchmarks/results/<suite>.json``::

    {"suite": str, "gpu": str, "date": "YYYY-MM-DD", "command": str,
     "versions": {...}, "copy_bandwidth_GBps": float,
     "records": [{"case": {params...}, "metric": str, "value": float,
                  "unit": str, "peers": {"sdpa": float, "flex": float, ...}}]}

``peers`` hold the same metric measured in the same run by other
implementations; a peer that could not run may be ``null``.
``copy_bandwidth_GBps`` is the copy ceiling re-measured in the same run (the
performance model reports decode against it); a suite without a bandwidth figure may
leave it out or set it to ``null``.

Nothing here fabricates data: :func:`load_suite` returns None for a missing
file and raises :class:`ResultFormatError` for a malformed one.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = [
    "ResultFormatError",
    "Record",
    "Suite",
    "checkout_results_root",
    "packaged_results_root",
    "default_results_root",
    "suite_path",
    "validate_suite",
    "parse_suite",
    "load_suite",
    "write_suite",
    "filter_records",
    "case_get",
    "case_matches",
    "peer_names",
    "attention_shape",
]

_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_SUITE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class ResultFormatError(ValueError):
    """A result file does not follow the format; ``field`` names the offending entry."""

    def __init__(self, field: str, problem: str, source: str | None = None):
        self.field = field
        self.problem = problem
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}field {field!r} {problem}")


@dataclass(frozen=True)
class Record:
    """One measurement: ``value`` of ``metric`` for parameters ``case``."""

    case: Mapping[str, Any]
    metric: str
    value: float
    unit: str
    peers: Mapping[str, float | None] = field(default_factory=dict)

    def get(self, *keys: str, default: Any = None) -> Any:
        """First of ``keys`` present in ``case`` (see :func:`case_get`)."""
        return case_get(self.case, *keys, default=default)

    def to_dict(self) -> dict:
        return {"case": dict(self.case), "metric": self.metric, "value": self.value,
                "unit": self.unit, "peers": dict(self.peers)}


@dataclass(frozen=True)
class Suite:
    """A parsed, validated result file."""

    suite: str
    gpu: str
    date: str
    command: str
    versions: Mapping[str, Any]
    copy_bandwidth_GBps: float | None
    records: tuple[Record, ...]
    path: Path | None = None

    def select(self, metric: str | None = None, case: Mapping[str, Any] | None = None,
               where: Callable[[Record], bool] | None = None, **case_kw: Any) -> list[Record]:
        """Records of ``metric`` whose case matches (see :func:`filter_records`)."""
        return filter_records(self.records, metric, case, where=where, **case_kw)

    def metrics(self) -> list[str]:
        return sorted({r.metric for r in self.records})

    def to_dict(self) -> dict:
        return {"suite": self.suite, "gpu": self.gpu, "date": self.date,
                "command": self.command, "versions": dict(self.versions),
                "copy_bandwidth_GBps": self.copy_bandwidth_GBps,
                "records": [r.to_dict() for r in self.records]}


# --------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------

def checkout_results_root() -> Path:
    """``benchmarks/results`` of the source checkout this package was imported from.

    It exists only when nbattn runs from a clone (``pip install -e .`` or
    ``PYTHONPATH``); a wheel install has no checkout around it.
    """
    return Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def packaged_results_root() -> Path:
    """The copy of ``benchmarks/results`` that ``pip install .`` puts inside the
    package (``nbattn/_results``)."""
    return Path(__file__).resolve().parents[1] / "_results"


def default_results_root() -> Path:
    """Where measured results are read from when no folder is given.

    The checkout's ``benchmarks/results`` when nbattn runs from a clone, else the
    copy installed with the package (``<site-packages>/nbattn/_results``).  When
    neither exists the checkout path is returned; :func:`load_suite` then finds
    no file and figures say "no measured data yet".
    """
    for root in (checkout_results_root(), packaged_results_root()):
        if root.is_dir() and any(root.glob("*.json")):
            return root
    return checkout_results_root()


def suite_path(name: str, root: str | os.PathLike | None = None) -> Path:
    if not isinstance(name, str) or not _SUITE_NAME.match(name):
        raise ValueError(f"bad suite name {name!r}: use letters, digits, '_', '-', '.'")
    base = default_results_root() if root is None else Path(root)
    return base / f"{name}.json"


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------

def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_finite(x: Any, fld: str, src: str | None, *, positive: bool = False) -> None:
    if not _is_number(x):
        raise ResultFormatError(fld, f"must be a number, got {type(x).__name__} {x!r}", src)
    if not math.isfinite(x):
        raise ResultFormatError(fld, f"must be finite, got {x!r}", src)
    if positive and x <= 0:
        raise ResultFormatError(fld, f"must be > 0, got {x!r}", src)


def _check_str(obj: Mapping, key: str, src: str | None, *, nonempty: bool = True,
               prefix: str = "") -> str:
    fld = prefix + key
    if key not in obj:
        raise ResultFormatError(fld, "is missing", src)
    val = obj[key]
    if not isinstance(val, str):
        raise ResultFormatError(fld, f"must be a string, got {type(val).__name__}", src)
    if nonempty and not val.strip():
        raise ResultFormatError(fld, "must not be empty", src)
    return val


def _check_json_scalarish(val: Any, fld: str, src: str | None) -> None:
    if val is None or isinstance(val, (str, bool)):
        return
    if _is_number(val):
        if isinstance(val, float) and not math.isfinite(val):
            raise ResultFormatError(fld, f"must be finite, got {val!r}", src)
        return
    if isinstance(val, (list, tuple)):
        for i, item in enumerate(val):
            _check_json_scalarish(item, f"{fld}[{i}]", src)
        return
    raise ResultFormatError(fld, f"must be a JSON scalar or list, got {type(val).__name__}", src)


def validate_suite(obj: Any, source: str | None = None) -> None:
    """Raise :class:`ResultFormatError` naming the first field that breaks the format."""
    src = source
    if not isinstance(obj, Mapping):
        raise ResultFormatError("<top level>", f"must be a JSON object, got {type(obj).__name__}", src)
    _check_str(obj, "suite", src)
    if not _SUITE_NAME.match(obj["suite"]):
        raise ResultFormatError("suite", f"has characters outside [A-Za-z0-9_.-]: {obj['suite']!r}", src)
    _check_str(obj, "gpu", src)
    date = _check_str(obj, "date", src)
    if not _DATE.match(date):
        raise ResultFormatError("date", f"must look like YYYY-MM-DD, got {date!r}", src)
    try:
        _dt.date.fromisoformat(date)
    except ValueError:
        raise ResultFormatError("date", f"is not a calendar date: {date!r}", src) from None
    _check_str(obj, "command", src)
    if "versions" not in obj:
        raise ResultFormatError("versions", "is missing", src)
    if not isinstance(obj["versions"], Mapping):
        raise ResultFormatError("versions", "must be an object of name -> version", src)
    bw = obj.get("copy_bandwidth_GBps")
    if bw is not None:
        _check_finite(bw, "copy_bandwidth_GBps", src, positive=True)
    if "records" not in obj:
        raise ResultFormatError("records", "is missing", src)
    recs = obj["records"]
    if not isinstance(recs, list):
        raise ResultFormatError("records", f"must be a list, got {type(recs).__name__}", src)
    for i, rec in enumerate(recs):
        p = f"records[{i}]"
        if not isinstance(rec, Mapping):
            raise ResultFormatError(p, "must be an object", src)
        if "case" not in rec:
            raise ResultFormatError(f"{p}.case", "is missing", src)
        case = rec["case"]
        if not isinstance(case, Mapping):
            raise ResultFormatError(f"{p}.case", "must be an object of parameters", src)
        for key, val in case.items():
            if not isinstance(key, str):
                raise ResultFormatError(f"{p}.case", f"has a non-string key {key!r}", src)
            _check_json_scalarish(val, f"{p}.case.{key}", src)
        _check_str(rec, "metric", src, prefix=f"{p}.")
        if "value" not in rec:
            raise ResultFormatError(f"{p}.value", "is missing", src)
        _check_finite(rec["value"], f"{p}.value", src)
        _check_str(rec, "unit", src, nonempty=False, prefix=f"{p}.")
        peers = rec.get("peers", {})
        if peers is None:
            peers = {}
        if not isinstance(peers, Mapping):
            raise ResultFormatError(f"{p}.peers", "must be an object of peer -> value", src)
        for name, val in peers.items():
            if not isinstance(name, str) or not name:
                raise ResultFormatError(f"{p}.peers", f"has a bad peer name {name!r}", src)
            if val is not None:
                _check_finite(val, f"{p}.peers.{name}", src)


def parse_suite(obj: Any, source: str | None = None, path: Path | None = None) -> Suite:
    """Validate ``obj`` (a decoded result file) and wrap it in a :class:`Suite`."""
    validate_suite(obj, source)
    records = tuple(
        Record(case=dict(r["case"]), metric=r["metric"], value=float(r["value"]),
               unit=r["unit"],
               peers={k: (None if v is None else float(v))
                      for k, v in (r.get("peers") or {}).items()})
        for r in obj["records"])
    bw = obj.get("copy_bandwidth_GBps")
    return Suite(suite=obj["suite"], gpu=obj["gpu"], date=obj["date"],
                 command=obj["command"], versions=dict(obj["versions"]),
                 copy_bandwidth_GBps=None if bw is None else float(bw),
                 records=records, path=path)


def load_suite(name: str, root: str | os.PathLike | None = None) -> Suite | None:
    """Load ``<root>/<name>.json``; None when the file does not exist.

    A file that exists but breaks the format raises :class:`ResultFormatError`
    (a silently skipped file would make a figure claim "no measured data").
    The ``suite`` field must equal the file's stem.
    """
    path = suite_path(name, root)
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ResultFormatError("<json>", f"is not valid JSON ({exc})", str(path)) from None
    suite = parse_suite(obj, str(path), path)
    if suite.suite != name:
        raise ResultFormatError("suite", f"is {suite.suite!r} but the file is {name}.json",
                                str(path))
    return suite


def write_suite(name: str, records: Iterable[Record | Mapping[str, Any]], *, gpu: str,
                command: str, versions: Mapping[str, Any] | None = None,
                copy_bandwidth_GBps: float | None = None, date: str | None = None,
                root: str | os.PathLike | None = None) -> Path:
    """Validate and write ``<root>/<name>.json``; returns its path.

    ``date`` defaults to today.  The write goes through a temporary file and a
    rename so a reader never sees half a file.
    """
    recs = [r.to_dict() if isinstance(r, Record) else dict(r) for r in records]
    for r in recs:
        r.setdefault("peers", {})
    obj = {"suite": name, "gpu": gpu,
           "date": date or _dt.date.today().isoformat(),
           "command": command, "versions": dict(versions or {}),
           "copy_bandwidth_GBps": copy_bandwidth_GBps, "records": recs}
    path = suite_path(name, root)
    validate_suite(obj, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


# --------------------------------------------------------------------------
# Selecting records
# --------------------------------------------------------------------------

def case_get(case: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """Value of the first of ``keys`` present in ``case`` (benchmarks spell keys differently)."""
    for k in keys:
        if k in case and case[k] is not None:
            return case[k]
    return default


def case_matches(case: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    """True when every ``key: value`` of ``want`` is in ``case``.

    A value in ``want`` may be a callable predicate, or a tuple/set of accepted
    values.
    """
    for key, expected in want.items():
        if key not in case:
            return False
        got = case[key]
        if callable(expected):
            if not expected(got):
                return False
        elif isinstance(expected, (tuple, set, frozenset)):
            if got not in expected:
                return False
        elif got != expected:
            return False
    return True


def filter_records(records: Iterable[Record], metric: str | Sequence[str] | None = None,
                   case: Mapping[str, Any] | None = None, *,
                   where: Callable[[Record], bool] | None = None,
                   **case_kw: Any) -> list[Record]:
    """Records with the given metric (or one of several) whose case matches.

    Case constraints come from ``case`` (for keys that are not identifiers) and
    keyword arguments, with :func:`case_matches` semantics; ``where`` is a
    final predicate on the whole record.
    """
    want = dict(case or {})
    want.update(case_kw)
    metrics = None if metric is None else ({metric} if isinstance(metric, str) else set(metric))
    out = []
    for r in records:
        if metrics is not None and r.metric not in metrics:
            continue
        if want and not case_matches(r.case, want):
            continue
        if where is not None and not where(r):
            continue
        out.append(r)
    return out


def peer_names(records: Iterable[Record]) -> list[str]:
    """Every peer that appears in ``records``, sorted."""
    return sorted({name for r in records for name in r.peers})


_DTYPE_BYTES = {"float16": 2, "fp16": 2, "half": 2, "f16": 2,
                "bfloat16": 2, "bf16": 2,
                "float32": 4, "fp32": 4, "f32": 4, "float": 4,
                "float8": 1, "fp8": 1, "e4m3": 1, "e5m2": 1,
                "float8_e4m3fn": 1, "float8_e5m2": 1}


def attention_shape(case: Mapping[str, Any], *, default_l_q: int | None = None) -> dict | None:
    """Attention shape of a benchmark case, for the performance model.

    Reads common spellings (``kv_len``/``l_kv``/``seq_len``, ``qo_len``/``l_q``,
    ``num_qo_heads``, ``num_kv_heads`` or ``group``, ``head_dim``, ``batch``,
    ``dtype``, ``causal``).  Missing head counts, head size and dtype default
    to the configuration measured on the H200 (32 query heads, MHA, head_dim 128,
    fp16).  Returns None when no KV length can be found: such a record cannot
    be placed on a roofline.
    """
    l_kv = case_get(case, "kv_len", "l_kv", "kv_length", "context_len", "seq_len")
    if l_kv is None:
        return None
    l_q = case_get(case, "qo_len", "q_len", "l_q", "l_qo", "query_len",
                   default=default_l_q)
    if l_q is None:
        l_q = case_get(case, "seq_len", default=l_kv)
    h_qo = int(case_get(case, "num_qo_heads", "num_heads", "h_qo", "heads", default=32))
    h_kv = case_get(case, "num_kv_heads", "h_kv")
    if h_kv is None:
        group = case_get(case, "group", "gqa_group", default=1)
        h_kv = max(1, h_qo // int(group))
    dtype = str(case_get(case, "dtype", default="float16")).lower().replace("torch.", "")
    return {
        "batch": int(case_get(case, "batch", "batch_size", "bs", default=1)),
        "l_q": int(l_q),
        "l_kv": int(l_kv),
        "num_qo_heads": h_qo,
        "num_kv_heads": int(h_kv),
        "head_dim": int(case_get(case, "head_dim", "d", default=128)),
        "bytes_per_elem": _DTYPE_BYTES.get(dtype, 2),
        "causal": bool(case_get(case, "causal", default=False)),
    }
