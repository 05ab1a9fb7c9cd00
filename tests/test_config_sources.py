"""One config wherever you stand (issue 34): the workflow and every ``hsextract`` command read
the same config -- the ``--configfile`` files or, with none, ./config.yaml, then ``--config``
-- and a bad value stops at validation in one sentence naming the key.  Real Snakemake."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fixtures_demo import (
    REPO,
    make_workdir,
    own_config,
    planned_jobs,
    run_snakemake,
    snakemake_cmd,
)

from hsextract.commands import config_entry
from hsextract.config import is_loopback, load_config, read_config, run_dir
from hsextract.errors import ConfigError


def _planned_outputs(stdout: str) -> set[str]:
    return set(re.findall(r"output: (.+)", stdout))


def _hsextract(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *args], cwd=cwd, capture_output=True, text=True
    )


def test_the_same_command_from_two_directories_plans_the_same_run(demo_run, tmp_path):
    """On 8e5f95d the directory holding the demo's config.yaml merged it beneath
    --configfile: model.revision demo-v1 (another fingerprint) and the demo's
    max_reject_fraction, so the plans differed, and `hsextract run-dir` disagreed."""
    mine = tmp_path / "my.yaml"
    mine.write_text(yaml.safe_dump(own_config(demo_run, tmp_path, n_chunks=3)))
    project = make_workdir(tmp_path / "project")  # holds the demo's config.yaml
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    plans, run_dirs = [], []
    for cwd in (project, elsewhere):
        proc = subprocess.run(
            snakemake_cmd(cwd, "-n", "extract_all", "--configfile", str(mine)),
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        plans.append(_planned_outputs(proc.stdout))
        cli = _hsextract("run-dir", "--configfile", str(mine), cwd=cwd)
        assert cli.returncode == 0, cli.stderr
        run_dirs.append(cli.stdout.strip())
    assert plans[0] == plans[1] and plans[0]
    assert run_dirs[0] == run_dirs[1]
    # Every planned output is in the run dir the CLI names (same fingerprint, same
    # settings files: their digests name them).
    assert all(p.startswith(run_dirs[0] + "/") for p in plans[0] if "/out/" in p)
    assert len(load_config(mine)["model"]) == 3 and "revision" in load_config(mine)["model"]
    assert load_config(mine)["model"]["revision"] is None  # not the demo's demo-v1


def test_the_cli_reads_the_working_directorys_config_only_without_configfile(tmp_path):
    project = make_workdir(tmp_path / "p", n_chunks=2)
    proc = _hsextract("run-dir", cwd=project)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(run_dir(read_config(project / "config.yaml")))
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _hsextract("run-dir", cwd=empty)
    assert proc.returncode != 0
    assert f"no --configfile was given and {empty} holds no config.yaml" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ({"n_chunks": 4.0}, "config key n_chunks = 4.0 must be a whole number"),
        ({"seed": 0.0}, "config key seed = 0.0 must be a whole number"),
        ({"max_seq_len": 300.0}, "config key max_seq_len = 300.0 must be a whole number"),
        ({"aux_layers": [1, 2.0]}, "config key aux_layers[1] = 2.0 must be a whole number"),
        ({"server.typo": 1}, "config key server.typo is not a setting; server takes"),
        ({"server.prot": 1}, "server.prot (did you mean port?)"),
        ({"n_chunks": "x"}, 'config key n_chunks = "x" is refused'),
    ],
)
def test_bad_values_are_refused_at_validation_naming_the_key(tmp_path, override, says):
    project = make_workdir(tmp_path / "p")
    cfg_path = project / "config.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(cfg_path, override)
    assert says in str(err.value)
    assert "\n" not in str(err.value)
    # The same sentence from the CLI, no traceback, --config as Snakemake takes it (a
    # group's key inside its mapping: no dotted keys), and the --config entry named.
    arg = next(iter(override))
    entry = config_entry(arg.split("."), override[arg])
    proc = _hsextract("run-dir", "--config", entry, cwd=project)
    assert proc.stderr.startswith(f"hsextract: error: --config {shlex.quote(entry)}: ")
    assert proc.returncode != 0 and says in proc.stderr and "Traceback" not in proc.stderr


def test_a_float_setting_in_snakemake_stops_before_any_job(tmp_path):
    """`--config n_chunks=4.0` passed the schema on 8e5f95d, then crashed in range()."""
    project = make_workdir(tmp_path / "p", built_model=False)
    proc = subprocess.run(
        snakemake_cmd(project, "-n", "extract_all", "--config", "n_chunks=4.0"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "config key n_chunks = 4.0 must be a whole number" in out, out[-2000:]
    assert not (project / "results").exists()


def test_unreadable_config_files_are_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_chunks: [1,\n")
    with pytest.raises(ConfigError, match=rf"config file {re.escape(str(bad))} is not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just text\n")
    with pytest.raises(ConfigError, match="holds a str, not a mapping"):
        load_config(scalar)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_loopback_is_decided_by_the_resolved_address(tmp_path):
    """`127.x.example.com` passed the loopback check textually on 8e5f95d."""
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("127.x.example.com")  # does not resolve: not known to be loopback
    assert not is_loopback("10.1.2.3")
    names = {socket.gethostname()}
    for name in names:  # a name that resolves to a non-loopback address
        try:
            addrs = {i[4][0] for i in socket.getaddrinfo(name, None)}
        except socket.gaierror:
            continue
        assert is_loopback(name) == all(a.startswith("127.") or a == "::1" for a in addrs)
    project = make_workdir(tmp_path / "p")
    with pytest.raises(ConfigError, match=r"'127\.x\.example\.com' is not loopback \(it does not"):
        load_config(project / "config.yaml", {"server.host": "127.x.example.com"})


def test_a_failed_merge_then_fixed_input_reruns_the_merge(demo_run, tmp_path):
    """Issue 34, item 2: a merge that fails (rejects over the threshold) has had its
    train.jsonl deleted by Snakemake; once the input is restored (same bytes, same mtime:
    the settings file of the finished run is current again), `extract_all` said "Nothing to
    be done" on 8e5f95d and left the run without train.jsonl.  Since issue 38 the failed
    merge leaves the published train.jsonl alone (tests/test_failed_merge.py), so with the
    input restored nothing needs to rerun: no merge, no chunk, and the run is whole."""
    data = tmp_path / "data"
    shutil.copytree(demo_run["workdir"] / "results" / "demo" / "data", data)
    cfg = own_config(demo_run, tmp_path, n_chunks=3, inputs=[str(data / "shard_*.jsonl")])
    cfg["merge"] = {"max_reject_fraction": 0.0}
    mine = tmp_path / "my.yaml"
    mine.write_text(yaml.safe_dump(cfg))
    wd = tmp_path
    run_snakemake(wd, "-j1", "extract_all", "--configfile", str(mine))
    run = Path(_hsextract("run-dir", "--configfile", str(mine), cwd=wd).stdout.strip())
    run = run if run.is_absolute() else wd / run
    train = run / "merged" / "train.jsonl"
    good = train.read_bytes()
    chunks = {p.name: p.stat().st_mtime_ns for p in (run / "hidden").glob("chunk_*.safetensors")}
    shard = data / "shard_00.jsonl"
    original, st = shard.read_bytes(), shard.stat()
    shard.write_bytes(original + b'{"input_ids": "not a list"}\n')
    failed = run_snakemake(wd, "-j1", "extract_all", "--configfile", str(mine), check=False)
    assert failed.returncode != 0
    shard.write_bytes(original)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    proc = run_snakemake(wd, "-j1", "extract_all", "--configfile", str(mine))
    jobs = planned_jobs(proc.stdout + proc.stderr)
    assert "merge_and_shuffle" not in jobs, proc.stderr[-3000:]
    assert train.read_bytes() == good
    assert {
        p.name: p.stat().st_mtime_ns for p in (run / "hidden").glob("chunk_*.safetensors")
    } == chunks
    verify = _hsextract("verify", str(run / "manifest.json"), cwd=wd)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_the_project_config_is_the_only_default(tmp_path):
    """The Snakefile names no configfile of its own: what is read is what load_config says."""
    assert "\nconfigfile:" not in (REPO / "Snakefile").read_text()
    project = make_workdir(tmp_path / "p", built_model=False)
    proc = subprocess.run(
        snakemake_cmd(project, "-n", "extract_all"), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"demo_data", "demo_model"} <= set(planned_jobs(proc.stdout))


def test_inputs_that_match_the_runs_own_outputs_are_refused(tmp_path):
    """`inputs: [data/**/*.jsonl]` with `output_root: data/results` made the merge read its
    own train.jsonl on the next plan (a cyclic graph) on 8e5f95d."""
    project = make_workdir(tmp_path / "p", **{"demo.enabled": False})
    (project / "data").mkdir()
    (project / "data" / "a.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n')
    over = {"inputs": ["data/**/*.jsonl"], "output_root": "data/results"}
    cwd = os.getcwd()
    os.chdir(project)
    try:
        with pytest.raises(ConfigError, match=r"inputs entry 'data/\*\*/\*\.jsonl' matches files"):
            load_config("config.yaml", over)
        # A glob that stays out of output_root is fine, even beside it.
        load_config("config.yaml", {**over, "inputs": ["data/*.jsonl"]})
    finally:
        os.chdir(cwd)


def test_inputs_through_a_symlink_that_match_the_runs_outputs_are_refused(tmp_path):
    """Issue 38, item 9: on 51ef369 `inputs: link/**/*.jsonl` with `link -> data` and
    `output_root: data/out` was accepted (the check compared the paths as written), then
    failed later with "the inputs changed".  Both sides are resolved now."""
    project = make_workdir(tmp_path / "p", **{"demo.enabled": False})
    (project / "data").mkdir()
    (project / "data" / "a.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n')
    (project / "link").symlink_to("data")
    cwd = os.getcwd()
    os.chdir(project)
    try:
        for over in (
            {"inputs": ["link/**/*.jsonl"], "output_root": "data/out"},
            {"inputs": ["data/**/*.jsonl"], "output_root": "link/out"},
        ):
            with pytest.raises(ConfigError, match="matches files this run writes"):
                load_config("config.yaml", over)
        load_config("config.yaml", {"inputs": ["link/*.jsonl"], "output_root": "link/out"})
    finally:
        os.chdir(cwd)


def test_a_relative_model_path_names_the_model_it_resolves_to(demo_run, tmp_path):
    """Issue 38, item 4: on 51ef369 `model.path: models/m` was hashed as written, so the same
    fingerprint named whichever model lay there from the directory a command ran in.  Two
    directories holding different models under the same relative path now make two run
    dirs; the same model reached by a relative and an absolute path (or a symlink) one."""
    model = demo_run["workdir"] / "results" / "demo" / "model"
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        shutil.copytree(model, d / "models" / "m")
    # b's model: same shapes and sizes, other weights (one value changed).
    weights = b / "models" / "m" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0x01
    weights.write_bytes(bytes(raw))
    (tmp_path / "link").symlink_to(a / "models" / "m")
    cfg = own_config(demo_run, tmp_path)
    cfg["model"]["path"] = "models/m"
    mine = tmp_path / "my.yaml"
    mine.write_text(yaml.safe_dump(cfg))
    fp = {}
    for d in (a, b):
        cli = _hsextract("run-dir", "--configfile", str(mine), cwd=d)
        assert cli.returncode == 0, cli.stderr
        fp[d.name] = Path(cli.stdout.strip()).name
    assert fp["a"] != fp["b"]
    for path in (str(a / "models" / "m"), str(tmp_path / "link")):
        cfg["model"]["path"] = path
        mine.write_text(yaml.safe_dump(cfg))
        cli = _hsextract("run-dir", "--configfile", str(mine), cwd=b)
        assert Path(cli.stdout.strip()).name == fp["a"], (path, cli.stderr)


def test_a_config_file_turning_the_demo_off_on_the_demos_file_is_refused(demo_run, tmp_path):
    """Issue 38, item 5: `--configfile config.yaml my.yaml` (the demo's file under the
    user's) silently applied the demo's max_seq_len: 512 on 51ef369 (20 of 30 records
    truncated, said only in the merge log).  Refused like the --config route, naming both
    files, for the workflow and the CLI alike."""
    project = make_workdir(tmp_path / "project")
    cfg = own_config(demo_run, tmp_path)
    del cfg["max_seq_len"]  # the demo's would apply
    cfg["demo"] = {"enabled": False}
    (project / "my.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        snakemake_cmd(project, "-n", "extract_all", "--configfile", "config.yaml", "my.yaml"),
        capture_output=True, text=True, timeout=300, cwd=project,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    said = r"--configfile \S*my\.yaml turns the demo off on \S*config\.yaml, the demo's config"
    assert re.search(said, out), out[-3000:]
    assert "Traceback" not in out
    cli = _hsextract("plan", "--configfile", "config.yaml", "my.yaml", cwd=project)
    assert cli.returncode != 0 and "turns the demo off on config.yaml" in cli.stderr
