"""A newcomer's first real run, done by following the README alone.

The README's "Your data" section is read as a user reads it: the example record, the
config, the commands of "Run it" and of "What you get".  They run from a directory of the
user's own, outside this checkout, with the config as printed.  The one stand-in is the
model: a tiny Llama built here takes the place of the README's `model.path` (a
placeholder, as tests/test_readme.py fills `<manifest>`), with the vocabulary of the
example record's tokenizer so that record is valid as printed.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hsextract import settings
from tests.fixtures_demo import REPO, kill_processes_under, wait_until_gone

README = (REPO / "README.md").read_text()
#: The README's model path, which only the user's machine has; the test's tiny model
#: stands in for it.
MODEL_PLACEHOLDER = "/models/Llama-3.1-8B-Instruct"


def _section(text: str, title: str, level: int) -> str:
    """The body of the one heading ``title`` at ``level``, up to the next of that level."""
    marks = "#" * level
    parts = re.split(rf"^{marks} (.+)$", text, flags=re.M)
    bodies = [parts[i + 1] for i in range(1, len(parts) - 1, 2) if parts[i].strip() == title]
    assert len(bodies) == 1, f"README has {len(bodies)} '{marks} {title}' sections"
    return bodies[0]


def _blocks(text: str, lang: str = "") -> list[str]:
    """The fenced blocks of ``lang`` ("": no language), each fence paired with its own end."""
    fences = re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.M | re.S)
    return [body for tag, body in fences if tag == lang]


YOUR_DATA = _section(README, "Your data", 2)
(EXAMPLE_RECORD,) = _blocks(_section(YOUR_DATA, "The records", 3), "json")
(CONFIG,) = _blocks(_section(YOUR_DATA, "A config", 3), "yaml")
(RUN_IT,) = _blocks(_section(YOUR_DATA, "Run it", 3))
WHAT_YOU_GET = _section(YOUR_DATA, "What you get", 3)
(READ_IT,) = _blocks(WHAT_YOU_GET, "python")
(EXPORT,) = [b for b in _blocks(WHAT_YOU_GET) if b.startswith("snakemake ")]


def test_the_readme_config_sets_every_key_without_a_default():
    """The minimal config is complete: every key the declarations give no default, and
    `inputs` (required without the demo); the demo is not on."""
    cfg = yaml.safe_load(CONFIG)
    flat = {f"{k}.{kk}" if isinstance(v, dict) else k: None for k, v in cfg.items()
            for kk in (v if isinstance(v, dict) else [None])}  # fmt: skip
    required = {k for k, s in settings.SETTINGS.items() if s.required} | {"inputs"}
    assert required <= set(flat), f"the README's config lacks {required - set(flat)}"
    assert not cfg.get("demo", {}).get("enabled")
    assert cfg["model"]["path"] == MODEL_PLACEHOLDER


def test_the_example_record_is_one_valid_record():
    rec = json.loads(EXAMPLE_RECORD)
    assert len(EXAMPLE_RECORD.strip().splitlines()) == 1
    assert len(rec["input_ids"]) == len(rec["loss_mask"]) and set(rec["loss_mask"]) <= {0, 1}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer Llama with Llama-3's vocabulary (the example record's ids are below it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _user_data(data: Path, n: int) -> int:
    """The README's example line first, then records of its shape, in two shards."""
    rng = random.Random(0)
    lines = [EXAMPLE_RECORD.strip()]
    for i in range(n):
        length = rng.randint(4, 48)
        prompt = rng.randint(1, length - 1)
        lines.append(json.dumps({
            "id": f"chat-{i + 2:04d}",
            "input_ids": [rng.randrange(128256) for _ in range(length)],
            "loss_mask": [0] * prompt + [1] * (length - prompt),
        }))  # fmt: skip
    data.mkdir()
    half = len(lines) // 2
    (data / "part-0.jsonl").write_text("\n".join(lines[:half]) + "\n")
    (data / "part-1.jsonl").write_text("\n".join(lines[half:]) + "\n")
    return len(lines)


def _run(line: str, cwd: Path, fill: dict[str, str]) -> subprocess.CompletedProcess:
    """One README command line, as a shell in ``cwd`` with the venv active runs it."""
    for placeholder, value in fill.items():
        line = line.replace(placeholder, value)
    argv = shlex.split(line, comments=True)
    assert argv[0] in ("snakemake", "hsextract"), line
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.workflow
def test_a_first_run_by_the_readme_alone(tmp_path, tiny_model):
    """Own data, own config, from another directory: the README's commands as printed
    extract every record, the manifest lists them, `verify` passes, the Python snippet
    reads a record, and the SpecForge export writes one file per record."""
    me = tmp_path / "me"
    me.mkdir()
    assert not me.resolve().is_relative_to(REPO.resolve())
    n_records = _user_data(me / "data", 23)
    (me / "my.yaml").write_text(CONFIG.replace(MODEL_PLACEHOLDER, str(tiny_model)))
    fill = {"<checkout>": str(REPO)}

    try:
        commands = [ln for ln in RUN_IT.splitlines() if ln.strip()]
        assert [shlex.split(c)[:2] for c in commands] == [
            ["snakemake", "-s"], ["hsextract", "run-dir"], ["hsextract", "verify"],
        ], commands  # fmt: skip
        made = _run(commands[0], me, fill)
        # The run's own summary says what it made and the command that checks it.
        assert f"run finished: {n_records:,} records" in made.stdout + made.stderr, made.stderr
        run_dir = me / _run(commands[1], me, fill).stdout.strip().splitlines()[-1]  # as printed
        assert run_dir.resolve().parent == (me / "out").resolve(), run_dir
        fill["<manifest>"] = str(run_dir / "manifest.json")
        verified = _run(commands[2], me, fill)
        assert "ok" in (verified.stdout + verified.stderr).lower(), verified.stdout

        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["totals"]["records"] == n_records, manifest["totals"]

        # "Read them in Python", in the user's directory, the fingerprint filled in.
        snippet = READ_IT.replace("<fingerprint>", run_dir.name)
        snippet += (
            "\nimport json\n"
            "print(json.dumps({k: list(getattr(v, 'shape', ())) for k, v in rec.items()}))"
        )
        proc = subprocess.run([sys.executable, "-c", snippet], cwd=me, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        shapes = json.loads(proc.stdout.splitlines()[-1])
        assert {"id", "input_ids", "loss_mask", "hidden_states", "aux_hidden_states"} <= set(shapes)
        assert shapes["hidden_states"][1] == 16, shapes  # the tiny model's hidden size

        _run(EXPORT.strip(), me, fill)
        exported = list((run_dir / "export" / "specforge").rglob("data_*.ckpt"))
        assert len(exported) == n_records, len(exported)
        # The run stopped its server: nothing it started runs on in the user's directory.
        assert not wait_until_gone(me, timeout=120)
    finally:
        kill_processes_under(me)
