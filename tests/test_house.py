"""The package's layout rules, checked on its source (no import of the package needed).

- no import cycle between nbattn's modules (a function-level import counts too);
- no module imports another module's private (``_x``) names;
- no file in nbattn/ over 600 lines;
- the kernel modules (nbattn/cuda) read no environment variable;
- kernels/, blocks/ and host/ never import a public operation module of nbattn.cuda.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "nbattn"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name[: -len(".__init__")] if name.endswith(".__init__") else name] = p
    return mods


MODS = _modules()


def _imports(name: str, path: Path):
    """(target module, imported name or None) for every import in ``path``."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                yield target, a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None


def _graph() -> dict[str, set[str]]:
    g = {m: set() for m in MODS}
    for m, p in MODS.items():
        for target, nm in _imports(m, p):
            full = f"{target}.{nm}" if nm else target
            if full in MODS and full != m:
                g[m].add(full)
            elif target in MODS and target != m:
                g[m].add(target)
    return g


def test_no_import_cycle():
    g = _graph()
    assert sum(map(len, g.values())) > 100, "the import graph was not read"
    assert "nbattn.cuda.blocks.primitives" in g["nbattn.cuda.kernels.decode_smem"]
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_no_module_imports_another_modules_private_names():
    bad = []
    for m, p in MODS.items():
        for target, nm in _imports(m, p):
            if (nm and nm.startswith("_") and not nm.startswith("__") and target.startswith("nbattn")
                    and f"{target}.{nm}" not in MODS):
                bad.append(f"{m} imports {target}.{nm}")
    assert not bad, bad


def test_no_file_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_the_kernel_modules_read_no_environment():
    readers = [str(p.relative_to(ROOT)) for p in (ROOT / "cuda").rglob("*.py") if "environ" in p.read_text()
               or "getenv" in p.read_text()]
    assert not readers, readers


def test_kernels_blocks_and_host_do_not_import_the_public_operations():
    ops = {m for m, p in MODS.items() if m.startswith("nbattn.cuda.") and p.parent == ROOT / "cuda"
           and m not in ("nbattn.cuda.tuning",)}
    bad = []
    for m in MODS:
        if m.startswith(("nbattn.cuda.kernels", "nbattn.cuda.blocks", "nbattn.cuda.host")):
            bad += [f"{m} -> {t}" for t in _graph()[m] if t in ops]
    assert not bad, bad
