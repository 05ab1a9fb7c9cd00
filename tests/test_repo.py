"""The production config plans and prints its server command (the READMEs' commands:
test_readme.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_demo import REPO, planned_jobs, snakemake_cmd

from hsextract.sglang.versions import known, version_key


@pytest.fixture
def production_like(tmp_path: Path) -> dict:
    """Inputs and a DeepSeek-V3-shaped config.json (no weights): all a dry run may read."""
    from transformers import DeepseekV3Config

    model = tmp_path / "DeepSeek-V3"
    model.mkdir()
    DeepseekV3Config().to_json_file(model / "config.json")  # 61 layers, hidden 7168
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        (shards / f"part-{i}.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n')
    return {"model": model, "inputs": str(shards / "*.jsonl"), "out": tmp_path / "out"}


def test_production_config_plans_every_chunk_without_gpu(production_like, tmp_path):
    p = production_like
    model = json.dumps({"path": str(p["model"]), "dtype": "bfloat16", "revision": "t"})
    cmd = snakemake_cmd(
        tmp_path,
        "-n", "extract_all",
        "--configfile", str(REPO / "configs" / "deepseek-v3-8xh200.yaml"),
        "--config", f"inputs={json.dumps([p['inputs']])}", f"output_root={p['out']}",
        f"model={model}", "n_chunks=512",  # the config's auto would make these 3 records 1
    )  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    jobs = planned_jobs(proc.stdout)
    assert jobs["extract_chunk"] == 512
    assert "demo_model" not in jobs and "launch_server" in jobs and "apply_patch" in jobs
    assert not p["out"].exists()


@pytest.mark.parametrize("version", sorted(known(), key=version_key))
def test_production_server_command_prints_env_and_argv(version: str):
    # No SGLang env here to detect the release from: name it.
    out = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "server", "command",
         "--configfile", str(REPO / "configs" / "deepseek-v3-8xh200.yaml"),
         "--config", f"sglang={{version: {version}}}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "export SGLANG_HS_DUMP_DIR=" in out
    assert "export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in out
    argv = out.strip().splitlines()[-1]
    for flag in ("-m sglang.launch_server", "--disable-radix-cache", "--tp-size 8",
                 "--cuda-graph-backend-prefill disabled", "--cuda-graph-backend-decode disabled",
                 "--host 127.0.0.1", "--context-length 8199"):  # fmt: skip
        assert flag in argv, flag
    assert "--disable-cuda-graph" not in argv and "--tp " not in argv


def test_missing_inputs_fail_the_plan_with_the_config_key(tmp_path):
    from fixtures_demo import make_workdir

    workdir = make_workdir(tmp_path / "w", **{"demo.enabled": False, "inputs": ["nowhere/*.jsonl"]})
    proc = subprocess.run(
        snakemake_cmd(workdir, "-n", "extract_all"), capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "nowhere/*.jsonl" in proc.stdout + proc.stderr and "inputs" in proc.stdout + proc.stderr


def test_qwen3_8b_config_launches_hooks_on_the_eagle3_layers(tmp_path):
    """configs/qwen3-8b-1xh200.yaml (the race's config): hooks on SGLang's EAGLE-3 default
    layers for 36 layers, the requests admitted = the derived window x 4 sending jobs."""
    import yaml

    from hsextract.config import read_config
    from hsextract.sglang.launch import build_launch

    model = tmp_path / "Qwen3-8B"
    model.mkdir()
    shape = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
             "num_hidden_layers": 36, "hidden_size": 4096, "torch_dtype": "bfloat16"}  # fmt: skip
    (model / "config.json").write_text(json.dumps(shape))
    cfg = yaml.safe_load((REPO / "configs" / "qwen3-8b-1xh200.yaml").read_text())
    cfg["model"]["path"] = str(model)
    cfg["sglang"]["version"] = "0.5.14"  # no SGLang env here to detect it from
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    cfg = read_config(tmp_path / "c.yaml")
    argv, env = build_launch(cfg, dump_dir=str(tmp_path / "dump"), port=30000)
    hooks = json.loads(argv[argv.index("--forward-hooks") + 1])
    aux = [h["config"]["layer"] for h in hooks if h["config"]["role"] == "aux"]
    assert aux == [2, 18, 33]
    # auto, before any merge: 2 x 8,192 tokens a turn over an assumed 512-token mean = 32
    # requests a turn, x 4 sending jobs, what auto derives for that mean at the 8B's bytes
    # a token (hsextract.window).
    assert cfg.client.sending_jobs == "auto"
    assert argv[argv.index("--max-running-requests") + 1] == str(32 * 4)
    assert "SGLANG_HS_DUMP_DIR" not in env  # hooks carry the dump dir, not the patch's env
