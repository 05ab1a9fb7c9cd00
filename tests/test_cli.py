"""The CLI's printed commands work when pasted, and its read-only views change nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
KEY = "k3y with 'quotes' and $dollars"

# Stands in for the SGLang env's python: prints the argv and env it was started with.
FAKE_PYTHON = """#!/usr/bin/env python3
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "dump": os.environ.get("SGLANG_HS_DUMP_DIR"),
                  "overwrite": os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")}))
"""


def test_server_command_runs_as_printed_with_the_api_key_from_the_environment(tmp_path):
    fake = tmp_path / "sglang-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(engine="sglang", output_root=str(tmp_path / "results"))
    cfg["demo"]["enabled"] = False
    cfg["inputs"] = [str(tmp_path / "x.jsonl")]
    cfg["model"] = {"path": str(tmp_path / "model"), "dtype": "bfloat16"}
    cfg["server"].update(host="0.0.0.0", port=31000, allow_remote=True, api_key="in-config-only")
    # The fake python cannot say which release it has: name it.
    cfg["sglang"] = {"python": str(fake), "version": "0.5.14", "tp_size": 1}
    cfg["dump"] = {"dir": str(tmp_path / "dump dir")}  # a space: quoting matters
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    printed = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "server", "command", "--configfile", "c.yaml"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "in-config-only" not in printed  # the key never appears in the command
    assert '"$HSEXTRACT_API_KEY"' in printed
    # Pasted into a shell that has the key in its environment:
    ran = subprocess.run(
        ["bash", "-c", printed], capture_output=True, text=True, check=True,
        env={**os.environ, "HSEXTRACT_API_KEY": KEY},
    )  # fmt: skip
    got = json.loads(ran.stdout)
    argv = got["argv"]
    assert argv[:2] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--api-key") + 1] == KEY
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert got["dump"] == str(tmp_path / "dump dir") and got["overwrite"] == "1"


def test_plan_reports_without_writing(demo_copy):
    wd, rd = demo_copy["workdir"], demo_copy["run_dir"]
    (rd / "hidden" / "chunk_00002.safetensors").unlink()
    before = sorted(str(p) for p in wd.rglob("*"))
    out = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "plan"], cwd=wd, capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    assert "1 of 4 chunk(s) to extract, 3 current" in out
    assert "chunk_00002: not extracted yet" in out
    assert sorted(str(p) for p in wd.rglob("*")) == before
