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
