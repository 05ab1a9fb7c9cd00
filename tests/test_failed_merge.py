"""A finished run survives a failed merge (issue 38, item 3).

Snakemake deletes a job's outputs before it runs and a failed job's after: a merge failing
on a bad record added after a finished run took that run's merged/train.jsonl and
stats.json with it, so until the input was fixed `hsextract verify` failed and a trainer
reading the run broke.  The merge now writes to a staging dir and ``publish_merge`` links
its files to the names every reader uses, only after it succeeded.  Real Snakemake.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import yaml
from fixtures_demo import own_config, run_snakemake

pytestmark = pytest.mark.workflow

MERGED = ("train.jsonl", "stats.json", "rejects.jsonl")


def _hsextract(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *args], cwd=cwd, capture_output=True, text=True
    )


def _run_dir(config: Path, cwd: Path) -> Path:
    out = _hsextract("run-dir", "--configfile", str(config), cwd=cwd)
    assert out.returncode == 0, out.stderr
    run = Path(out.stdout.strip())
    return run if run.is_absolute() else cwd / run


def _merged(run: Path) -> dict[str, bytes]:
    return {name: (run / "merged" / name).read_bytes() for name in MERGED}


def _manifest_shas(run: Path) -> dict[str, str]:
    data = json.loads((run / "manifest.json").read_text())
    return {c["path"]: c["sha256"] for c in data["chunks"]}


def test_a_failed_merge_keeps_the_finished_run_readable(demo_run, tmp_path):
    """A bad record added to a finished run's input: the merge fails (rejects over
    merge.max_reject_fraction), again on a rerun (never "Nothing to be done"), and the run's
    train.jsonl, stats.json and rejects.jsonl keep their bytes; `verify` finds the chunks,
    train.jsonl and manifest whole and names only the changed input.  Once the record is
    fixed, the rerun gives what a fresh run of the same data gives.  On 51ef369 the failed
    merge removed train.jsonl and stats.json."""
    data = tmp_path / "data"
    shutil.copytree(demo_run["workdir"] / "results" / "demo" / "data", data)
    cfg = own_config(demo_run, tmp_path, n_chunks=3, inputs=[str(data / "shard_*.jsonl")])
    cfg["merge"] = {"max_reject_fraction": 0.0}
    mine = tmp_path / "my.yaml"
    mine.write_text(yaml.safe_dump(cfg))
    wd = tmp_path
    run_snakemake(wd, "-j1", "extract_all", "--configfile", str(mine))
    run = _run_dir(mine, wd)
    finished = _merged(run)

    shard = data / "shard_00.jsonl"
    original = shard.read_bytes()
    shard.write_bytes(original + b'{"id": "late", "input_ids": "not a list", "loss_mask": []}\n')
    for attempt in range(2):
        failed = run_snakemake(wd, "-j1", "extract_all", "--configfile", str(mine), check=False)
        out = failed.stdout + failed.stderr
        assert failed.returncode != 0, (attempt, out[-3000:])
        assert "merge.max_reject_fraction" in out, (attempt, out[-3000:])
        assert _merged(run) == finished, attempt
    assert (run / "merged" / "rejects-failed.jsonl").exists()  # what the message names
    verify = _hsextract("verify", str(run / "manifest.json"), cwd=wd)
    problems = verify.stdout.splitlines()[:-1]
    assert verify.returncode == 1 and len(problems) == 1, verify.stdout + verify.stderr
    assert problems[0].startswith(f"input {shard}: changed since the merge read it"), problems

    # Fixed: the bad record replaced by a valid one.
    n = 12
    fixed = {"id": "late", "input_ids": list(range(1, n + 1)), "loss_mask": [1] * n}
    shard.write_bytes(original + orjson.dumps(fixed) + b"\n")
    run_snakemake(wd, "-j1", "extract_all", "--configfile", str(mine))
    verify = _hsextract("verify", str(run / "manifest.json"), cwd=wd)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert not (run / "merged" / "rejects-failed.jsonl").exists()
    train = (run / "merged" / "train.jsonl").read_bytes()
    assert b'"id":"late"' in train and train != finished["train.jsonl"]

    fresh_cfg = {**cfg, "output_root": str(tmp_path / "fresh")}
    fresh_yaml = tmp_path / "fresh.yaml"
    fresh_yaml.write_text(yaml.safe_dump(fresh_cfg))
    run_snakemake(wd, "-j1", "extract_all", "--configfile", str(fresh_yaml))
    fresh = _run_dir(fresh_yaml, wd)
    assert _merged(run) == _merged(fresh)
    assert _manifest_shas(run) == _manifest_shas(fresh)


def test_published_files_are_no_older_than_any_staged_one(tmp_path: Path) -> None:
    """Snakemake fails a job whose output is older than one of its inputs ("clock skew").
    A published file is its staged one (a hard link), so it kept the merge's time of
    writing it, and train.jsonl, written first, was older than rejects.jsonl (CI, under
    load).  Staged files a second apart here; each published file no older than all."""
    import os

    from hsextract.records import publish

    staged = [tmp_path / "stage" / n for n in MERGED]
    staged[0].parent.mkdir()
    for i, p in enumerate(staged):
        p.write_text(f"{i}\n")
        os.utime(p, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    published = [tmp_path / n for n in MERGED]
    publish(staged, published)
    assert [p.read_text() for p in published] == ["0\n", "1\n", "2\n"]
    newest_input = max(p.stat().st_mtime_ns for p in staged)
    assert all(p.stat().st_mtime_ns >= newest_input for p in published)
