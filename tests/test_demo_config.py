"""The demo never silently replaces a user's data or model (real Snakemake, dry runs).

A new user's ``snakemake -j1 extract_all --config 'inputs=["my/*.jsonl"]'`` with the
shipped config used to extract the demo's shards without a word, because
``demo.enabled`` is true there and ``inputs`` was then ignored.  Now the combination is
refused, saying what to set; so is a ``model.path`` the demo would overwrite, and a
config without the demo and without ``inputs``.
"""

from __future__ import annotations

import json
import subprocess
import sys

from fixtures_demo import make_workdir, planned_jobs, snakemake_cmd


def _dry(workdir, *config: str) -> subprocess.CompletedProcess:
    args = ["-n", "extract_all", *(["--config", *config] if config else [])]
    return subprocess.run(snakemake_cmd(workdir, *args), capture_output=True, text=True)


def test_inputs_beside_the_demo_are_refused_saying_what_to_set(tmp_path):
    wd = make_workdir(tmp_path / "w")
    (wd / "my").mkdir()
    (wd / "my" / "a.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n')
    proc = _dry(wd, 'inputs=["my/*.jsonl"]')
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "inputs ['my/*.jsonl'] would be ignored: demo.enabled is true" in out
    assert "demo={enabled: false}" in out and "model.path" in out
    assert not (wd / "results").exists()  # refused before anything ran


def test_the_shipped_config_runs_the_demo_and_old_demo_inputs_still_do(tmp_path):
    wd = make_workdir(tmp_path / "w")
    proc = _dry(wd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"demo_data", "demo_model", "extract_chunk"} <= set(planned_jobs(proc.stdout))
    # Configs written before the check named the demo's own shards: still accepted.
    proc = _dry(wd, 'inputs=["results/demo/data/shard_*.jsonl"]')
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_without_the_demo_inputs_are_required(tmp_path):
    wd = make_workdir(tmp_path / "w", **{"demo.enabled": False})
    proc = _dry(wd)
    assert proc.returncode != 0
    assert "inputs is not set: list the JSON-lines shards to extract" in proc.stdout + proc.stderr


def test_your_inputs_and_model_without_the_demo_plan_no_demo_job(tmp_path):
    wd = make_workdir(tmp_path / "w")
    (wd / "my").mkdir()
    (wd / "my" / "a.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n')
    model = wd / "mymodel"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 512}))
    proc = _dry(wd, 'inputs=["my/*.jsonl"]', "demo={enabled: false}", f"model={{path: {model}}}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = planned_jobs(proc.stdout)
    assert "demo_data" not in jobs and "demo_model" not in jobs and "merge_and_shuffle" in jobs


def test_the_demo_never_overwrites_a_real_model(tmp_path):
    wd = make_workdir(tmp_path / "w")
    model = tmp_path / "real-model"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 129280}')
    proc = _dry(wd, f"model={{path: {model}}}")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"model.path='{model}' holds a model the demo did not build" in out
    assert "demo.enabled=false" in out
    assert (model / "config.json").read_text() == '{"vocab_size": 129280}'


def test_the_cli_refuses_the_same_combination(tmp_path):
    wd = make_workdir(tmp_path / "w")
    proc = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "run-dir", "--config", 'inputs=["x/*.jsonl"]'],
        cwd=wd, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.startswith("hsextract: error: inputs ['x/*.jsonl'] would be ignored")
