"""The CLI's printed commands work when pasted, and its read-only views change nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fixtures_demo import default_sigint

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


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _one_sentence(proc: subprocess.CompletedProcess, *named: str) -> str:
    """A failure a user can act on: non-zero, one line on stderr naming the file, no
    traceback."""
    assert proc.returncode not in (0, None), proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hsextract: error: "), proc.stderr
    for name in named:
        assert name in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "kind", ["missing", "empty-dir", "not-json", "json-list", "json-not-a-manifest"]
)
def test_verify_on_what_is_not_a_manifest_says_so_in_one_sentence(tmp_path, kind):
    target = {
        "missing": tmp_path / "manifest.json",
        "empty-dir": tmp_path / "not-a-run",
        "not-json": tmp_path / "notes.txt",
        "json-list": tmp_path / "list.json",
        "json-not-a-manifest": tmp_path / "config.json",
    }[kind]
    if kind == "empty-dir":
        target.mkdir()
    elif kind == "not-json":
        target.write_text("chunks: 4\n")
    elif kind == "json-list":
        target.write_text("[1, 2]\n")
    elif kind == "json-not-a-manifest":
        target.write_text('{"output_root": "results"}\n')
    line = _one_sentence(_cli("verify", str(target), cwd=tmp_path), str(target))
    assert "pass the manifest.json of a run" in line


def test_server_start_outlives_the_shell_that_ran_it_until_server_stop(demo_copy):
    """Issue 38, item 13: `hsextract server start` printed a URL, then its watchdog
    stopped the server as soon as the shell that ran it (its owner) ended.  Started
    outside a workflow it has no owner and no watchdog, says so, and runs until
    `hsextract server stop`."""
    from fixtures_demo import kill_processes_under, poll, processes_under, wait_until_gone

    from hsextract.procs import pid_alive

    wd, rd = demo_copy["workdir"], demo_copy["run_dir"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSEXTRACT_OWNER")}
    try:
        # A shell that ends right after the command, as a script or `ssh host cmd` does.
        shell = subprocess.run(
            ["sh", "-c", f"{sys.executable} -m hsextract.cli server start; echo done"],
            cwd=wd, capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert shell.returncode == 0 and shell.stdout.endswith("done\n"), shell.stderr
        said = json.loads(shell.stdout.splitlines()[0])
        assert said["runs"] == "until `hsextract server stop`", said
        assert "runs until `hsextract server stop`" in shell.stderr
        live = json.loads(next((rd / "state").glob("server.*.live.json")).read_text())
        assert live["pid"] == said["pid"]
        assert live["owner_pid"] is None and live["watchdog_pid"] is None, live
        assert not any("hsextract.watchdog" in c for c in processes_under(wd).values())
        status = _cli("server", "status", cwd=wd)  # the shell is gone: still serving
        assert status.returncode == 0 and json.loads(status.stdout)["serving"], status.stdout
        stop = _cli("server", "stop", cwd=wd)
        assert stop.stdout.strip() == "stopped", stop.stdout + stop.stderr
        poll(lambda: not pid_alive(said["pid"]), "the server to stop", 60)
        assert not wait_until_gone(wd)
    finally:
        _cli("server", "stop", cwd=wd)
        kill_processes_under(wd)


def test_verify_of_a_renamed_run_dir_says_so_and_advises_no_deletion(demo_copy):
    """Issue 38, item 13: a renamed run dir was told to delete its manifest, which
    changes nothing: the name is what is wrong, and the message says how to fix it."""
    rd = demo_copy["run_dir"]
    renamed = rd.with_name("my-good-run")
    rd.rename(renamed)
    proc = _cli("verify", str(renamed), cwd=demo_copy["workdir"])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    problems = proc.stdout.strip().splitlines()[:-1]
    assert problems == [
        f"run dir {renamed} was renamed or moved: its name is not the fingerprint {rd.name} "
        f"its manifest, config and chunks were made under; rename it back to {rd} (the "
        "workflow and `hsextract` find a run by that name) -- nothing in it needs deleting "
        "or redoing"
    ], proc.stdout
    renamed.rename(rd)  # named back: verified whole
    proc = _cli("verify", str(rd), cwd=demo_copy["workdir"])
    assert proc.returncode == 0, proc.stdout


def test_verify_takes_a_run_dir_for_its_manifest(tmp_path):
    """A run dir stands for its manifest.json: the same checks, not a refusal."""
    (tmp_path / "manifest.json").write_text('{"chunks": []}\n')
    proc = _cli("verify", str(tmp_path), cwd=tmp_path)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "index.json" in proc.stdout  # verify_manifest ran: the run has no chunk index


CTRL_C_IN_A_COMMAND = """
import os, signal, sys

from hsextract import cli


def pressed(args):  # Ctrl-C while the command runs
    os.kill(os.getpid(), signal.SIGINT)
    return 0


cli._run_dir = pressed
sys.exit(cli.main(["run-dir"]))
"""


def test_ctrl_c_in_a_command_is_one_line_and_exit_130(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", CTRL_C_IN_A_COMMAND],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, preexec_fn=default_sigint,
    )  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == (
        "hsextract: interrupted: hsextract run-dir not finished; rerun the same command to continue"
    ), proc.stderr
