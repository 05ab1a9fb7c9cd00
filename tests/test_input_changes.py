"""What the merge read is what the run holds: inputs are compared by identity, not by age.

Real Snakemake on your own shards (``demo.enabled: false``) and the demo's seeded model:
a shard changed and given an older mtime (``cp -p``, ``rsync -a``, ``tar x``) reruns the
merge and re-extracts the chunk whose record changed; ``**`` globs recurse in the
workflow as in the library; a merge that fails on rejects names a file that still exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import yaml
from fixtures_demo import REPO, make_workdir, run_dir_of, run_snakemake

from hsextract.chunks import sha256_file
from hsextract.demo import build_demo_data, build_demo_model
from hsextract.records import FAILED_REJECTS, id_hash, identity_as_made, input_identity

pytestmark = pytest.mark.workflow

N_CHUNKS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The demo's seeded model, built once here (no demo run needed)."""
    demo = yaml.safe_load((REPO / "config.yaml").read_text())["demo"]
    path = tmp_path_factory.mktemp("model") / "model"
    build_demo_model(path, demo)
    return path


def own_workdir(path: Path, model: Path, inputs: list[str], **overrides) -> Path:
    return make_workdir(
        path,
        **{
            "demo.enabled": False,
            "inputs": inputs,
            "model.path": str(model),
            "n_chunks": N_CHUNKS,
            **overrides,
        },
    )


def write_shards(data: Path, n: int = 3) -> list[Path]:
    demo = yaml.safe_load((REPO / "config.yaml").read_text())["demo"]
    paths = [data / f"shard_{i:02d}.jsonl" for i in range(n)]
    data.mkdir(parents=True, exist_ok=True)
    build_demo_data(paths, {**demo, "n_shards": n}, 512)
    return paths


def hsextract(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
    )


def stamps(rd: Path) -> dict[str, tuple[str, int]]:
    return {
        f.name: (sha256_file(f), f.stat().st_mtime_ns)
        for f in sorted((rd / "hidden").glob("chunk_*.safetensors"))
    }


def change_one_token_keep_size(shard: Path, line: int) -> dict:
    """The issue's edit: one token of one record, same byte count; then an older mtime."""
    lines = shard.read_bytes().splitlines(keepends=True)
    rec = orjson.loads(lines[line])
    tok = rec["input_ids"][0]
    rec["input_ids"][0] = tok + 1 if tok % 10 != 9 else tok - 1  # same digit count
    size = shard.stat().st_size
    lines[line] = orjson.dumps(rec) + b"\n"
    shard.write_bytes(b"".join(lines))
    subprocess.run(["touch", "-d", "2024-01-01", str(shard)], check=True)
    assert shard.stat().st_size == size  # only the mtime (backwards) and the bytes tell
    return rec


def test_a_changed_shard_with_an_older_mtime_reextracts_its_chunk(tmp_path, model):
    """The issue's repro: one token changed (same size), then `touch -d 2024-01-01`."""
    wd = own_workdir(tmp_path / "w", model, ["data/*.jsonl"])
    write_shards(wd / "data")
    run_snakemake(wd, "-j1", "extract_all")
    rd = run_dir_of(wd)
    before = stamps(rd)

    rec = change_one_token_keep_size(wd / "data" / "shard_01.jsonl", 2)

    plan = hsextract(wd, "plan")
    assert plan.returncode == 0, plan.stderr
    assert "data/shard_01.jsonl: changed since the merge read it" in plan.stdout, plan.stdout
    assert "mtime" in plan.stdout and "2024-01-01" in plan.stdout
    ver = hsextract(wd, "verify", str(rd / "manifest.json"))
    assert ver.returncode == 1, ver.stdout
    assert "input data/shard_01.jsonl: changed since the merge read it (sha256" in ver.stdout

    run_snakemake(wd, "-j1", "extract_all")
    after = stamps(rd)
    changed = f"chunk_{id_hash(rec['id']) % N_CHUNKS:05d}.safetensors"
    assert [c for c in before if before[c] != after[c]] == [changed]
    train = {
        o["id"]: o["input_ids"]
        for o in map(orjson.loads, (rd / "merged" / "train.jsonl").read_bytes().splitlines())
    }
    assert train[rec["id"]][0] == rec["input_ids"][0]  # the new token
    ver = hsextract(wd, "verify", str(rd / "manifest.json"))
    assert ver.returncode == 0, ver.stdout
    plan = hsextract(wd, "plan")
    assert f"0 of {N_CHUNKS} chunk(s) to extract" in plan.stdout
    assert "inputs changed" not in plan.stdout and "shard_01" not in plan.stdout
    assert "Nothing to be done" in run_snakemake(wd, "-n", "extract_all").stdout


def test_the_embedded_default_too(demo_copy):
    """The same on the demo's own shards, compared with what demo_data recorded."""
    wd, rd = demo_copy["workdir"], demo_copy["run_dir"]
    before = stamps(rd)
    rec = change_one_token_keep_size(wd / "results" / "demo" / "data" / "shard_01.jsonl", 3)
    run_snakemake(wd, "-j1", "extract_all")
    after = stamps(rd)
    assert [c for c in before if before[c] != after[c]] == [
        f"chunk_{id_hash(rec['id']) % N_CHUNKS:05d}.safetensors"
    ]
    train = [orjson.loads(x) for x in (rd / "merged" / "train.jsonl").read_bytes().splitlines()]
    assert next(o for o in train if o["id"] == rec["id"])["input_ids"][0] == rec["input_ids"][0]
    assert "Nothing to be done" in run_snakemake(wd, "-n", "extract_all").stdout


def test_identity_as_made(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("x\n")
    b.write_text("y\n")
    assert identity_as_made([a, b], None) == [str(a), str(b)]  # not made by us yet
    made = input_identity([a, b], content=True)
    # As made, even once touched (Snakemake touches a job's outputs after it): the same name.
    os.utime(b, ns=(made[1]["mtime_ns"] + 10**9,) * 2)
    assert identity_as_made([a, b], made) == [str(a), str(b)]
    a.write_text("z\n")
    os.utime(a, ns=(made[0]["mtime_ns"] - 10**9,) * 2)
    (now,) = input_identity([a], content=True)
    assert identity_as_made([a, b], made) == [now, str(b)]


def test_double_star_globs_recurse_in_the_workflow(tmp_path, model):
    wd = own_workdir(tmp_path / "w", model, ["data/**/*.jsonl"])
    shards = write_shards(wd / "data", 3)
    want = ["data/a/b/two.jsonl", "data/a/one.jsonl", "data/top.jsonl"]
    for src, dst in zip(shards, want, strict=True):
        (wd / dst).parent.mkdir(parents=True, exist_ok=True)
        src.rename(wd / dst)
    rd = run_dir_of(wd)
    run_snakemake(wd, "-j1", str((rd / "merged" / "train.jsonl").relative_to(wd)))
    stats = json.loads((rd / "merged" / "stats.json").read_text())
    assert sorted(i["path"] for i in stats["inputs"]) == want
    n_lines = sum(len((wd / p).read_bytes().splitlines()) for p in want)
    assert stats["records_in"] == n_lines


def test_a_merge_failing_on_rejects_names_a_file_that_exists(tmp_path, model):
    wd = own_workdir(tmp_path / "w", model, ["data/*.jsonl"])
    (shard,) = write_shards(wd / "data", 1)
    good = shard.read_bytes()
    shard.write_bytes(good + b"{oops\n" * 20)
    rd = run_dir_of(wd)
    target = str((rd / "merged" / "train.jsonl").relative_to(wd))
    proc = run_snakemake(wd, "-j1", target, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    kept = rd / "merged" / FAILED_REJECTS
    assert f"All are in {kept.relative_to(wd)};" in out, out[-3000:]
    assert not (rd / "merged" / "rejects.jsonl").exists()  # Snakemake removed the output
    rejects = [json.loads(line) for line in kept.read_text().splitlines()]
    assert len(rejects) == 20 and {r["reason"] for r in rejects} == {"invalid_json"}
    assert all(r["file"] == "data/shard_00.jsonl" for r in rejects)

    shard.write_bytes(good)  # fixed: the rerun is a run that never failed
    run_snakemake(wd, "-j1", target)
    assert not kept.exists()
