"""Every committed benchmark result file follows the one format figures read."""
import json
from pathlib import Path

import pytest

from nbattn.perf import results

FILES = sorted((Path(__file__).resolve().parent.parent / "benchmarks" / "results").glob("*.json"))


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_result_file_validates(path):
    obj = json.loads(path.read_text())
    results.validate_suite(obj, str(path))
    assert obj["suite"] == path.stem
    assert obj["records"], "a result file without records is not a result"


def test_correctness_report_says_every_gpu_case_passed():
    suite = results.load_suite("decode_correctness")
    oks = [r.value for r in suite.select("ok")]
    assert oks and all(v == 1.0 for v in oks)


def _readers() -> str:
    """The text of everything that shows results to a user: the README, the figure
    code and the notebooks (one-off files live in results/experiments/)."""
    root = Path(__file__).resolve().parent.parent
    paths = [root / "README.md", *sorted((root / "nbattn").rglob("*.py")), *sorted((root / "notebooks").glob("*.py"))]
    return "\n".join(p.read_text() for p in paths)


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_canonical_result_file_is_read_by_the_readme_a_figure_or_a_notebook(path):
    assert path.name in _readers() or f'"{path.stem}"' in _readers(), (
        f"{path.name} is shown nowhere: cite it in the README, draw it, or move it to results/experiments/")
