"""Every command hsextract prints works as printed, and a bad config or port is a sentence.

Issue 38, items 10-12: the README's `--config server.port=30000` crashed Snakemake; the
commands suggested by messages left out the user's --configfile (the demo ran, or no
rule was found); a port held by another program, an unwritable output_root, a huge
n_chunks, a malformed --config and a key written twice ended in tracebacks or silence.
"""

from __future__ import annotations

import http.server
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from fixtures_demo import REPO, make_workdir, snakemake_cmd

from hsextract.config import load_config, read_config_file
from hsextract.errors import ConfigError


def _hsextract(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _user_config(tmp_path: Path) -> Path:
    """A user's config file, the demo's settings with its own output root, kept apart
    from any directory a command runs in."""
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["output_root"] = str(tmp_path / "my runs")
    path = tmp_path / "conf" / "my.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(cfg))
    return path


# --- item 10: one --config form for snakemake and hsextract ----------------------------


def _readme_config_entries() -> list[str]:
    """Every `--config ...` the README and docs/ show, as the words a shell passes."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    text = "\n".join(p.read_text() for p in docs)
    entries = []
    for span in re.findall(r"`([^`\n]*--config [^`\n]*)`", text):
        try:
            words = [w.removeprefix("[") for w in shlex.split(span)]  # a synopsis' [--config
        except ValueError:
            continue
        for word in words[words.index("--config") + 1 :]:
            if word.startswith(("-", "...")):
                break
            entries.append(word)
    return [e for e in entries if "=" in e]


def test_every_readme_config_entry_is_taken_by_snakemake_and_hsextract(tmp_path):
    """On 51ef369 the README showed `--config server.port=30000`, which Snakemake refuses
    ("Invalid config definition"); hsextract took it.  Now one form works in both, and
    hsextract refuses the dotted one naming it."""
    from snakemake.cli import parse_config

    entries = _readme_config_entries()
    assert any(e.startswith("server=") for e in entries), entries
    for entry in entries:
        parse_config([entry])  # raises ValueError on what Snakemake refuses

    from hsextract.cli import parse_config_entries  # the CLI parses them as Snakemake does

    for entry in entries:
        assert parse_config_entries([entry]) == parse_config([entry])
    work = make_workdir(tmp_path / "w", output_root=str(tmp_path / "out"))
    proc = subprocess.run(
        snakemake_cmd(work, "-n", "extract_all", "--config", "server={port: 30000}"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    dotted = _hsextract("run-dir", "--config", "server.port=30000", cwd=work)
    assert dotted.returncode == 1 and "Traceback" not in dotted.stderr
    assert "--config 'server={port: 30000}'" in dotted.stderr, dotted.stderr


# --- item 11: suggested commands carry the user's config ------------------------------


def _suggested(text: str) -> list[str]:
    return re.findall(r"`((?:cd [^`]*&& )?snakemake [^`]*)`", text)


def test_status_hint_runs_the_users_config_from_anywhere(tmp_path):
    """On 51ef369 status said `snakemake -j1 extract_all`: from the project it runs the
    demo, elsewhere Snakemake finds no Snakefile.  As printed (dry-run), it plans the
    user's run, from a directory holding neither a Snakefile nor a config.yaml."""
    mine = _user_config(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    status = _hsextract("status", "--configfile", str(mine), cwd=elsewhere)
    assert status.returncode == 0, status.stderr
    (hint,) = _suggested(status.stdout)
    assert str(mine) in hint, hint
    dry = hint.replace("snakemake -j1", f"{shlex.quote(sys.executable)} -m snakemake -n", 1)
    proc = subprocess.run(
        dry, shell=True, cwd=elsewhere, capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert proc.returncode == 0, f"{hint}\n{proc.stderr[-3000:]}"
    assert str(tmp_path / "my runs") in proc.stdout  # the user's run, not the demo's


def test_a_chunks_redo_advice_names_the_runs_config_and_a_rule(tmp_path, monkeypatch):
    """A reader holding only a chunk path (verify, ManifestDataset) advised
    `snakemake -j1 <chunk>`: MissingRuleException outside the project, the demo's run
    inside it.  The workflow records its config sources in the run dir; the advice,
    printed in another directory, is a command Snakemake plans."""
    from hsextract.chunkfile import redo_chunk

    mine = _user_config(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    proc = subprocess.run(
        snakemake_cmd(project, "-j1", "demo_data", "--configfile", str(mine)),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = [p for p in (tmp_path / "my runs").iterdir() if p.name != "demo"]
    chunk = run / "hidden" / "chunk_00001.safetensors"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("HSEXTRACT_CONFIG_SOURCES", raising=False)
    (hint,) = _suggested(redo_chunk(chunk))
    assert str(mine) in hint and "-s" in shlex.split(hint), hint
    dry = hint.replace("snakemake -j1", f"{shlex.quote(sys.executable)} -m snakemake -n", 1)
    proc = subprocess.run(
        dry, shell=True, cwd=elsewhere, capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert proc.returncode == 0, f"{hint}\n{proc.stderr[-3000:]}"
    assert "chunk_00001.safetensors" in proc.stdout


def test_a_recorded_runs_advice_leaves_out_another_workflows_one_off_overrides(
    tmp_path, monkeypatch
):
    """Issue 57 (8): a run dir records the sources of the last workflow that ran jobs for
    it; after ``export_specforge --config 'export={specforge: {gzip: true}}'`` with a
    debugging ``client={sending_jobs: 1}``, a chunk's redo advice (verify, a trainer's
    reader) re-applied both.  It keeps what makes the run (a launch setting, the seed, a
    key hsextract does not declare) and leaves the one-offs out."""
    from hsextract import commands
    from hsextract.chunkfile import redo_chunk

    mine = _user_config(tmp_path)
    run = tmp_path / "my runs" / "0123abcd"
    (run / "hidden").mkdir(parents=True)
    given = (
        "export={specforge: {gzip: true}}",
        "client={sending_jobs: 1, requests_in_flight: 4}",
        "server={chunked_prefill_size: 64, port: 30001}",
        "seed=3",
        "audit={records: 0}",
        "unknown_key=1",
    )
    commands.record(run, commands.ConfigSources(
        workdir=str(tmp_path), configfiles=(str(mine),), config=given, run_dir=str(run),
    ))  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(commands.SOURCES_ENV, raising=False)
    (hint,) = _suggested(redo_chunk(run / "hidden" / "chunk_00001.safetensors"))
    words = shlex.split(hint)
    entries = words[words.index("--config") + 1 :]
    assert entries == ["server={chunked_prefill_size: 64, port: 30001}", "seed=3",
                       "unknown_key=1"], hint  # fmt: skip
    # Only a recorded workflow's one-offs go: the workflow's own jobs keep all of theirs.
    commands.set_current(commands.ConfigSources(str(tmp_path), (str(mine),), given, str(run)))
    try:
        words = shlex.split(commands.snakemake_command(run / "hidden" / "x", run_dir=run))
        assert words[words.index("--config") + 1 :] == list(given)
    finally:
        commands.set_current(None)


# Prose that names a command without suggesting it be run: a docstring, the settings
# table's note (README text, where the project's own demo is meant).
PROSE = ("the shards `hsextract plan` and the merge see", "`hsextract plan` says the size")


def test_no_message_writes_a_snakemake_command_by_hand():
    """Every suggested command goes through hsextract.commands (one renderer)."""
    # A message's command: in single backticks, or a string starting with it (a docstring's
    # ``snakemake -n`` names the program, it suggests nothing).
    bare = re.compile(
        r"(?<!`)(`|[\"'])(snakemake -[jn]|hsextract (server|plan|status|stream|run-dir)\b)"
    )
    found = [
        f"{path.relative_to(REPO)}:{i}"
        for root in ("src", "scripts", "rules")
        for path in sorted((REPO / root).rglob("*.py")) + sorted((REPO / root).rglob("*.smk"))
        if path.name != "commands.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if bare.search(line)
        and not line.lstrip().startswith("#")
        and not any(prose in line for prose in PROSE)
    ]
    assert not found, f"commands written by hand (use hsextract.commands): {found}"


# --- item 12: one sentence, not a traceback --------------------------------------------


class _NotOurs(http.server.BaseHTTPRequestHandler):
    """Another program's HTTP service: healthy, but no /get_model_info."""

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_a_fixed_port_held_by_another_service_is_named(tmp_path):
    """On 51ef369: `HTTPError: 404 .../get_model_info`."""
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotOurs)
    port = other.server_address[1]
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    try:
        work = make_workdir(tmp_path / "w", output_root=str(tmp_path / "out"))
        proc = _hsextract("server", "start", "--config", f"server={{port: {port}}}", cwd=work)
    finally:
        other.shutdown()
        other.server_close()
    assert proc.returncode == 1, proc.stdout
    assert "Traceback" not in proc.stderr and "404" not in proc.stderr, proc.stderr
    assert f"server.port {port} on 127.0.0.1 is taken by a program that is not" in proc.stderr
    assert proc.stderr.rstrip().endswith("or to 0 to pick a free one at each start")


def test_an_unwritable_output_root_stops_the_workflow_in_one_sentence(tmp_path):
    """On 51ef369 a read-only output_root ended in `OSError [Errno 30]` and a traceback
    from the run lock.  Here the root cannot be created (a file stands in its path: an
    error of the same class as EROFS, which needs a mount to make)."""
    blocker = tmp_path / "a file"
    blocker.write_text("not a directory\n")
    work = make_workdir(tmp_path / "w", output_root=str(blocker / "out"))
    proc = subprocess.run(
        snakemake_cmd(work, "-j1", "extract_all"), capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert proc.returncode == 1
    assert f"hsextract: error: output_root {blocker / 'out'} cannot be written" in proc.stderr
    assert "Traceback" not in proc.stderr and "OSError" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.rstrip().endswith("or make that one writable")
    assert blocker.read_text() == "not a directory\n"


def test_a_huge_n_chunks_is_refused_at_validation(tmp_path, monkeypatch):
    """On 51ef369 `n_chunks: 100000000` validated, then ran out of memory planning."""
    work = make_workdir(tmp_path / "w", n_chunks=100_000_000)
    monkeypatch.chdir(work)
    with pytest.raises(ConfigError, match=r"n_chunks = 100000000 is refused: .*maximum of"):
        load_config(work / "config.yaml")


def test_a_malformed_config_value_names_config_and_the_key(tmp_path):
    """On 51ef369 hsextract blamed ./config.yaml for a --config value that did not parse."""
    work = make_workdir(tmp_path / "w")
    proc = _hsextract("run-dir", "--config", "server={port: 30000", cwd=work)
    assert proc.returncode == 1
    assert "config.yaml" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("hsextract: error: --config 'server={port: 30000': config key")
    assert "fix that --config value" in proc.stderr


def test_a_key_written_twice_in_a_config_file_is_refused(tmp_path):
    """On 51ef369 YAML kept the last of the two silently."""
    path = tmp_path / "dup.yaml"
    path.write_text("seed: 1\nserver:\n  port: 30000\n  host: 127.0.0.1\n  port: 30001\n")
    with pytest.raises(ConfigError) as err:
        read_config_file(path)
    said = str(err.value)
    assert said.startswith(f"config file {path} is not valid YAML (line 5, column 3)"), said
    assert "key 'port' is set twice in one mapping (lines 3 and 5)" in said
