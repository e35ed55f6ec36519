"""The README's commands and tour stay true."""
import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_starts_with_the_two_commands():
    first_block = README.read_text().split("```")[1]
    lines = [l.split("#")[0].strip() for l in first_block.splitlines()[1:] if l.strip()]
    assert lines == ["make figures", "make test"]


def test_readme_tour_runs():
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["pkv"].kv_lens.tolist() == [6, 2, 9]
    assert ns["o"].shape == (8, 8, 64) and np.isfinite(ns["o"]).all()
