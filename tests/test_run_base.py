"""A run made with a relative ``model.path`` is checked as it was made, from anywhere:
``verify`` and ``status`` resolve the config against the directory the run recorded, so
neither calls a whole run "another fingerprint" (and advises deleting its manifest) nor
reports an empty run, and the run dir keeps its name (nothing is re-extracted)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from fixtures_demo import own_config, run_snakemake


def _hsextract(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_verify_and_status_of_a_relative_model_path_from_another_directory(demo_run, tmp_path):
    wd = tmp_path / "project"
    shutil.copytree(demo_run["workdir"] / "results" / "demo" / "model", wd / "models" / "m")
    cfg = own_config(demo_run, tmp_path, n_chunks=2)
    cfg["model"]["path"] = "models/m"
    mine = wd / "my.yaml"
    mine.write_text(yaml.safe_dump(cfg))
    made = run_snakemake(wd, "-j1", "extract_all", "--configfile", str(mine))
    runs = [p for p in (tmp_path / "out").iterdir() if (p / "manifest.json").is_file()]
    assert len(runs) == 1, runs
    rd = runs[0]
    # The run ends with what it made, where, and what to run next (the summary), each
    # command working as printed.
    said = made.stdout + made.stderr
    manifest = json.loads((rd / "manifest.json").read_text())
    records = manifest["totals"]["records"]
    assert f"hsextract: run finished: {records:,} records, " in said, said[-3000:]
    check = next(x for x in said.splitlines() if x.startswith("  check "))
    cmd = check.removeprefix("  check").strip()
    assert cmd.startswith("hsextract verify "), check
    ok = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *shlex.split(cmd)[1:]],
        cwd=wd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "hsextract export specforge --manifest" in said
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for cwd in (wd, elsewhere, tmp_path / "out", rd):
        proc = _hsextract("verify", str(rd / "manifest.json"), cwd=cwd)
        assert proc.returncode == 0, (cwd, proc.stdout, proc.stderr)
        assert "ok: every chunk matches the manifest" in proc.stdout, proc.stdout
        st = _hsextract("status", "--json", "--configfile", str(mine), cwd=cwd)
        assert st.returncode == 0, st.stderr
        got = json.loads(st.stdout)
        assert Path(got["run_dir"]).resolve() == rd.resolve(), (cwd, got["run_dir"])
        assert got["finished"] and got["chunks_done"] == 2, got
    # The run still plans nothing from its own directory: its name did not change.
    dry = run_snakemake(wd, "-n", "extract_all", "--configfile", str(mine))
    assert "Nothing to be done" in dry.stdout + dry.stderr, dry.stdout[-2000:]
