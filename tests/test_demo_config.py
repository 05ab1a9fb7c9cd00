"""The demo never silently replaces a user's data or model (real Snakemake, dry runs).

A new user's ``snakemake -j1 extract_all --config 'inputs=["my/*.jsonl"]'`` with the
shipped config used to extract the demo's shards without a word, because
``demo.enabled`` is true there and ``inputs`` was then ignored.  Now the combination is
refused, saying what to set; so is a ``model.path`` the demo would overwrite, and a
config without the demo and without ``inputs``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fixtures_demo import make_workdir, planned_jobs, snakemake_cmd

from hsextract.demo import build_demo_model
from hsextract.errors import ConfigError


def _dry(workdir, *config: str) -> subprocess.CompletedProcess:
    args = ["-n", "extract_all", *(["--config", *config] if config else [])]
    return subprocess.run(snakemake_cmd(workdir, *args), capture_output=True, text=True)


def test_inputs_beside_the_demo_are_refused_saying_what_to_set(tmp_path):
    wd = make_workdir(tmp_path / "w", built_model=False)
    (wd / "my").mkdir()
    (wd / "my" / "a.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n')
    proc = _dry(wd, 'inputs=["my/*.jsonl"]')
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "inputs ['my/*.jsonl'] would be ignored: demo.enabled is true" in out
    assert "--configfile" in out and "model.path" in out
    assert not (wd / "results").exists()  # refused before anything ran


def test_the_shipped_config_runs_the_demo_and_old_demo_inputs_still_do(tmp_path):
    wd = make_workdir(tmp_path / "w", built_model=False)
    proc = _dry(wd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"demo_data", "demo_model", "extract_chunk"} <= set(planned_jobs(proc.stdout))
    # Configs written before the check named the demo's own shards: still accepted.
    proc = _dry(wd, 'inputs=["results/demo/data/shard_*.jsonl"]')
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_without_the_demo_inputs_are_required(tmp_path):
    wd = make_workdir(tmp_path / "w", built_model=False, **{"demo.enabled": False})
    proc = _dry(wd)
    assert proc.returncode != 0
    assert "inputs is not set: list the JSON-lines shards to extract" in proc.stdout + proc.stderr


def test_your_inputs_and_model_without_the_demo_plan_no_demo_job(tmp_path):
    wd = make_workdir(tmp_path / "w", built_model=False)
    (wd / "my").mkdir()
    (wd / "my" / "a.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n')
    model = wd / "mymodel"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 512}))
    mine = {
        "inputs": ["my/*.jsonl"],
        "output_root": "results",
        "n_chunks": 2,
        "max_seq_len": 4096,
        "seed": 0,
        "engine": "reference",
        "model": {"path": str(model), "dtype": "float32"},
    }
    (wd / "my.yaml").write_text(yaml.safe_dump(mine))
    proc = subprocess.run(
        snakemake_cmd(wd, "-n", "extract_all", "--configfile", str(wd / "my.yaml")),
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = planned_jobs(proc.stdout)
    assert "demo_data" not in jobs and "demo_model" not in jobs and "merge_and_shuffle" in jobs


def test_turning_the_demo_off_on_the_demos_config_is_refused(tmp_path):
    """Issue 34: `--config 'demo={enabled: false}' ...` on the shipped config kept the demo's
    max_seq_len: 512 and truncated 20 of 20 long records without a word."""
    wd = make_workdir(tmp_path / "w", built_model=False)
    (wd / "my").mkdir()
    (wd / "my" / "a.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n')
    proc = _dry(wd, 'inputs=["my/*.jsonl"]', "demo={enabled: false}", "model={path: m}")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "--config turns the demo off on config.yaml, the demo's config" in out
    assert "pass it with --configfile" in out
    assert not (wd / "results").exists()


def test_the_demo_never_overwrites_a_real_model(tmp_path):
    wd = make_workdir(tmp_path / "w", built_model=False)
    model = tmp_path / "real-model"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 129280}')
    proc = _dry(wd, f"model={{path: {model}}}")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"model.path='{model}' holds files the demo did not write (config.json)" in out
    assert "demo.enabled=false" in out
    assert (model / "config.json").read_text() == '{"vocab_size": 129280}'


def test_the_cli_refuses_the_same_combination(tmp_path):
    wd = make_workdir(tmp_path / "w", built_model=False)
    proc = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "run-dir", "--config", 'inputs=["x/*.jsonl"]'],
        cwd=wd, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.startswith("hsextract: error: inputs ['x/*.jsonl'] would be ignored")


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_model_path_holding_someones_files_is_refused_and_left_whole(tmp_path):
    """Issue 20, item 5: mymodels/ with llama/weights.bin and a README (no config.json)
    was rmtree'd and replaced by the demo model."""
    wd = make_workdir(tmp_path / "w", built_model=False, **{"model.path": "mymodels"})
    mine = wd / "mymodels"
    (mine / "llama").mkdir(parents=True)
    (mine / "llama" / "weights.bin").write_bytes(b"\x07" * 64)
    (mine / "README").write_text("my models")
    before = _tree(mine)
    # The demo model alone: the job that wiped the directory.
    proc = subprocess.run(snakemake_cmd(wd, "-j1", "mymodels/config.json"),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert sorted(os.listdir(mine)) == ["README", "llama"] and _tree(mine) == before
    assert proc.returncode != 0, out[-3000:]
    assert "model.path='mymodels' holds files the demo did not write (README, llama)" in out
    assert "point model.path at a new directory" in out


@pytest.fixture(scope="module")
def demo_recipe() -> dict:
    return yaml.safe_load((Path(__file__).resolve().parents[1] / "config.yaml").read_text())["demo"]


def test_the_demo_builds_only_into_a_new_empty_or_own_dir(tmp_path, demo_recipe):
    from hsextract.demo import DEMO_MARKER

    new = tmp_path / "new" / "model"
    build_demo_model(new, demo_recipe)
    own = json.loads((new / DEMO_MARKER).read_text())["files"]
    assert {"config.json", "model.safetensors"} <= set(own)
    assert sorted(os.listdir(new)) == sorted([*own, DEMO_MARKER])
    first = _tree(new)
    build_demo_model(new, demo_recipe)  # its own dir: its own files replaced, same bytes
    assert _tree(new) == first
    empty = tmp_path / "empty"
    empty.mkdir()
    build_demo_model(empty, demo_recipe)
    assert (empty / "model.safetensors").read_bytes() == first["model.safetensors"]
    # Built before the marker existed: only the names it wrote, and a settings file.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (legacy / name).write_bytes(b"old")
    (legacy / "settings-0123456789ab.json").write_text("{}")
    build_demo_model(legacy, demo_recipe)
    assert (legacy / "model.safetensors").read_bytes() == first["model.safetensors"]


@pytest.mark.parametrize("planted", ["notes.txt", "sub/weights.bin", "config.json"])
def test_the_demo_never_writes_into_a_dir_it_did_not_create(tmp_path, demo_recipe, planted):
    d = tmp_path / "model"
    (d / planted).parent.mkdir(parents=True, exist_ok=True)
    (d / planted).write_bytes(b"someone's")
    before = _tree(d)
    with pytest.raises(ConfigError, match=f"model.path='{d}' holds files the demo did not"):
        build_demo_model(d, demo_recipe)
    assert _tree(d) == before


def test_in_its_own_dir_the_demo_replaces_only_its_own_files(tmp_path, demo_recipe):
    d = tmp_path / "model"
    build_demo_model(d, demo_recipe)
    (d / "notes.txt").write_text("added by hand")
    (d / "model.safetensors").write_bytes(b"stale")
    build_demo_model(d, demo_recipe)
    assert (d / "notes.txt").read_text() == "added by hand"
    assert (d / "model.safetensors").read_bytes() != b"stale"
