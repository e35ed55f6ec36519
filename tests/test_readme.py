"""The README's commands and tour stay true."""
import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_starts_with_the_two_commands():
    first_block = README.read_text().split("```")[1]
    lines = [l.split("#")[0].strip() for l in first_block.splitlines()[1:] if l.strip()]
    assert lines == ["make figures", "make test"]


def test_ci_runs_the_readmes_test_command():
    first_block = README.read_text().split("```")[1]
    test_cmd = [l.split("#")[0].strip() for l in first_block.splitlines()[1:] if l.strip()][1]
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert test_cmd in [l.strip() for l in ci if not l.lstrip().startswith("#")]


def test_readme_sections_in_order_and_no_missing_files():
    text = README.read_text()
    heads = [l for l in text.splitlines() if l.startswith("## ")]
    assert heads[:3] == ["## Install", "## Documentation", "## A short tour"]
    assert "SPEC.md" not in text and "GPU.md" not in text     # files a clone does not have
    assert "make docs" in text and "docs/_build/html/index.html" in text


def test_readme_tour_runs():
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["pkv"].kv_lens.tolist() == [6, 2, 9]
    assert ns["o"].shape == (8, 8, 64) and np.isfinite(ns["o"]).all()


def test_no_file_cites_the_contract_outside_the_repository():
    """Code, tests, notebooks and docs cite docs/ (the project's own words), never the
    contract files a clone does not have."""
    import re
    import subprocess
    root = README.parent
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True).stdout.split()
    pattern = re.compile(r"SPEC section|SPEC [0-9]|SPEC\.md|GPU\.md|\.\./shared/")
    me = Path(__file__).resolve()
    hits = []
    for name in files:
        path = root / name
        if path.suffix not in (".py", ".md", ".ipynb", ".rst", ".txt") or path.resolve() == me or not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{name}:{i}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits[:20])
