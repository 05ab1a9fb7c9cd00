"""Style is part of the build: ruff and Snakemake's linter must stay clean."""

from __future__ import annotations

import shutil
import subprocess

from fixtures_demo import REPO, make_workdir, snakemake_cmd

PATHS = ["src", "tests", "scripts", "bench"]


def test_ruff_check_and_format():
    ruff = shutil.which("ruff") or str(REPO / ".venv" / "bin" / "ruff")
    check = subprocess.run([ruff, "check", *PATHS], cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout[-3000:]
    fmt = subprocess.run(
        [ruff, "format", "--check", *PATHS], cwd=REPO, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout[-3000:]


def test_snakemake_lint_is_clean(tmp_path):
    workdir = make_workdir(tmp_path / "w")
    proc = subprocess.run(snakemake_cmd(workdir, "--lint"), capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Lints for" not in out, out[-3000:]


def _imports(path, module: str, package: bool) -> set[str]:
    """Every hsextract module ``path`` imports, at the top or inside a function: a lazy
    import hides a circle from the interpreter, not from the design."""
    import ast

    parts = module.split(".") if package else module.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("hsextract")}


def import_cycles(root) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module."""
    mods: dict[str, tuple] = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root.parent).with_suffix("").parts
        name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        mods[name] = (p, rel[-1] == "__init__")
    graph = {m: sorted(d for d in _imports(p, m, pkg) if d in mods and d != m)
             for m, (p, pkg) in mods.items()}  # fmt: skip
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is ~70 modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in graph:
        if m not in index:
            visit(m)
    return cycles


def test_no_import_circles():
    assert import_cycles(REPO / "src" / "hsextract") == []


def test_an_import_circle_is_found(tmp_path):
    pkg = tmp_path / "hsextract"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from hsextract.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from hsextract import a\n")
    (pkg / "c.py").write_text("from hsextract.a import f\n")
    assert import_cycles(pkg) == [["hsextract.a", "hsextract.b"]]


def rules_missing_log_or_benchmark(rules_dir) -> list[str]:
    """Each rule that writes an output without a ``log:`` or a ``benchmark:`` (the
    snakemake-workflows convention); target rules (inputs only) write nothing to time."""
    import re

    missing = []
    for smk in sorted(rules_dir.glob("*.smk")):
        text = smk.read_text()
        for m in re.finditer(r"^rule (\w+):\n(.*?)(?=^\S|\Z)", text, re.S | re.M):
            body = m.group(2)
            if "    output:" in body:
                missing += [f"{smk.name}:{m.group(1)} ({k})" for k in ("log:", "benchmark:")
                            if f"    {k}" not in body]  # fmt: skip
    return missing


def test_every_rule_has_a_log_and_a_benchmark(tmp_path):
    assert rules_missing_log_or_benchmark(REPO / "rules") == []
    (tmp_path / "x.smk").write_text("rule a:\n    output:\n        'o'\n    log:\n        'l'\n")
    assert rules_missing_log_or_benchmark(tmp_path) == ["x.smk:a (benchmark:)"]
