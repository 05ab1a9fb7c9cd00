"""What a new user tripped on in a first real run: each test is one of those, and failed
on 51ddea2 (each says how)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fixtures_demo import make_workdir


def _hsextract_into(stdout: int, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *args],
        cwd=cwd, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300,
    )  # fmt: skip


def test_a_closed_output_pipe_is_no_permissions_problem(tmp_path):
    """`hsextract status --json | head -1`: on 51ddea2 "cannot use: Broken pipe; make it
    readable and writable by this user...".  The pipe's reader is gone before the command
    writes (its read end closed first), so every write fails, on any machine."""
    wd = make_workdir(tmp_path / "w")
    for args in (["status", "--json"], ["status"], ["run-dir"]):
        r, w = os.pipe()
        os.close(r)
        try:
            proc = _hsextract_into(w, *args, cwd=wd)
        finally:
            os.close(w)
        assert proc.stderr == "", (args, proc.stderr)
        assert proc.returncode == 141, (args, proc.returncode)


IMPORTS_OF_A_STATUS = """
import json, sys
from hsextract import cli
code = cli.main(sys.argv[1:])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "snakemake"})
print("HEAVY", json.dumps(heavy), file=sys.stderr)
sys.exit(code)
"""


def test_status_of_a_finished_run_imports_neither_torch_nor_snakemake(demo_copy):
    """On 51ddea2 `hsextract status` took 3-5 s: it imported torch (the export commands'
    modules, registered for every command) and Snakemake (its config parser and
    validator).  bench/status_time.py prints its time beside `hsextract --help`'s."""
    for args in (["status"], ["status", "--json"], ["status", "--watch", "0.01"]):
        proc = subprocess.run(
            [sys.executable, "-c", IMPORTS_OF_A_STATUS, *args],
            cwd=demo_copy["workdir"], capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "HEAVY []" in proc.stderr, (args, proc.stderr)
        assert "every chunk is extracted" in proc.stdout or '"finished": true' in proc.stdout


def test_status_watch_reports_until_the_run_is_whole(demo_copy):
    """`--watch S` reports again and again while a chunk is missing, and ends by itself
    (exit 0) once the run is whole: driven by the files, not by the clock."""
    rd = demo_copy["run_dir"]
    sidecar = rd / "hidden" / "chunk_00001.json"
    aside = rd / "chunk_00001.json.aside"
    sidecar.rename(aside)  # chunk_00001 no longer done
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsextract.cli", "status", "--watch", "0.05"],
        cwd=demo_copy["workdir"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        reports = 0
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("chunks "):
                assert "3 of 4 done" in line, line
                reports += 1
            if reports == 2:
                break
        assert reports == 2, proc.stderr.read() if proc.stderr else ""
        aside.rename(sidecar)  # whole again: the watch ends on its own
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert "4 of 4 done" in out, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_run_page_shows_the_server_command_that_made_the_chunks(tmp_path):
    """report/run.html showed state/server.json's command: the last launch, which after an
    override run that extracted nothing is not the command of any chunk."""
    from hsextract.report import run_table

    made = ["python", "-m", "hsextract.engine", "--chunked-prefill-size", "257"]
    tried = ["python", "-m", "hsextract.engine", "--chunked-prefill-size", "64"]
    sidecars = [{"chunk": f"chunk_0000{i}", "server": {"argv": made}} for i in range(2)]
    out = tmp_path / "run.html"
    run_table({"totals": {}}, {}, {}, {"spec": {"argv": tried}}, out, sidecars)
    page = out.read_text()
    shown = page.split("(what extracted the chunks)", 1)[1].split("Last server launch")[0]
    assert " ".join(made) in shown and "chunk_00000, chunk_00001" in shown, page
    assert " ".join(tried) not in shown
    assert "Last server launch (extracted none of these chunks)" in page


def test_after_kill_9_of_snakemake_status_says_to_unlock_first(tmp_path):
    """On 51ddea2, after `kill -9` of the Snakemake process, status suggested
    `snakemake -j1 extract_all`, which then failed with Snakemake's LockException.  The
    run's claim is free, so the workflow is dead: status prints the `--unlock` command of
    the run's config first (it never unlocks by itself), and that command works."""
    import json
    import shlex
    import signal

    from fixtures_demo import kill_processes_under, poll, snakemake_cmd, start_snakemake

    wd = make_workdir(tmp_path / "w", **{"demo.n_records": 24, "n_chunks": 4})
    gate, log = tmp_path / "gate", tmp_path / "faults.jsonl"
    hold = {
        "log": str(log),
        "extend": [{"rid": "chunk_00001", "nth": [1], "do": "wait", "gate": str(gate)}],
    }
    proc = start_snakemake(wd, "-j1", "extract_all", faults=hold)
    try:
        poll(lambda: log.exists() and '"fault": "wait"' in log.read_text(), "the hold", 900)
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)  # Snakemake itself: its lock stays
        proc.wait(timeout=60)
        kill_processes_under(wd)  # its orphaned chunk job
        text = _hsextract_into(subprocess.PIPE, "status", cwd=wd).stdout
        assert "workflow  not running" in text, text
        line = next(x for x in text.splitlines() if x.startswith("eta "))
        unlock, run = line.split("`")[1], line.split("`")[3]
        assert "--unlock" in unlock and "extract_all" in run, line
        locked = subprocess.run(snakemake_cmd(wd, "-j1", "extract_all"),
                                capture_output=True, text=True, timeout=600)  # fmt: skip
        assert locked.returncode != 0 and "LockException" in locked.stdout + locked.stderr
        argv = shlex.split(unlock)
        assert argv[0] == "snakemake", unlock
        done = subprocess.run([sys.executable, "-m", *argv], cwd=wd,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        text = _hsextract_into(subprocess.PIPE, "status", cwd=wd).stdout
        assert "--unlock" not in text, text
        st = json.loads(_hsextract_into(subprocess.PIPE, "status", "--json", cwd=wd).stdout)
        assert st["snakemake_lock"] is None
    finally:
        gate.touch()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_processes_under(wd)


GOOD_LINE = b'{"id": "r%d", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}'


def test_a_merge_error_is_history_once_the_input_is_restored(tmp_path):
    """On 51ddea2: the merge's warning named the staging copy merged/.next/rejects.jsonl;
    after a failed merge and the input restored from a backup (its old time: nothing
    reruns), `status` kept showing the merge error and merged/rejects-failed.jsonl stayed.
    The merge alone runs here (a model's config.json is all it reads)."""
    import json
    import shutil

    from fixtures_demo import run_dir_of, run_snakemake

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 512}))
    shard = tmp_path / "data" / "shard.jsonl"
    shard.parent.mkdir()
    lines = [GOOD_LINE % i for i in range(30)]
    lines[4] = b"\x00" * 16  # one reject: within the bound
    shard.write_bytes(b"\n".join(lines) + b"\n")
    backup = tmp_path / "shard.backup"
    shutil.copy2(shard, backup)
    conf = {"demo.enabled": False, "inputs": [str(shard)], "model.path": str(model)}
    wd = make_workdir(tmp_path / "w", **conf, **{"merge.max_reject_fraction": 0.05})
    rd = run_dir_of(wd)
    target = str((rd / "merged" / "stats.json").relative_to(wd))
    ok = run_snakemake(wd, "-j1", target)
    published = (rd / "merged" / "rejects.jsonl").relative_to(wd)
    (warned,) = [x for x in ok.stderr.splitlines() if "records rejected, within" in x]
    assert warned.endswith(f"all in {published}"), warned

    lines[7] = lines[9] = b"\x00" * 16  # three of 30: over the bound
    shard.write_bytes(b"\n".join(lines) + b"\n")
    failed = run_snakemake(wd, "-j1", target, check=False)
    assert failed.returncode != 0 and (rd / "merged" / "rejects-failed.jsonl").exists()
    # Issue 57, item 6: said once (the job's sentence), not again from its log.
    out = failed.stdout + failed.stderr
    assert out.count("3 of 30 records rejected (10.00%)") == 1, out[-6000:]
    said = _hsextract_into(subprocess.PIPE, "status", cwd=wd).stdout
    assert "merge_and_shuffle" in said and "max_reject_fraction" in said, said

    shutil.copy2(backup, shard)  # restored with its time: the published merge read it
    run_snakemake(wd, "-j1", target)
    said = _hsextract_into(subprocess.PIPE, "status", cwd=wd).stdout
    assert "error     none" in said, said
    assert not (rd / "merged" / "rejects-failed.jsonl").exists()


class _Job:
    """The parts of Snakemake's ``snakemake`` object a step's glue reads."""

    def __init__(self, tmp_path: Path, outputs: list[Path]) -> None:
        self.log = [str(tmp_path / "job.log")]
        self.output = [str(p) for p in outputs]
        self.rule = "extract_chunk"
        self.wildcards = {"chunk": "00002"}


def test_a_ctrl_c_as_a_chunk_finishes_keeps_the_finished_chunk(tmp_path):
    """On 51ddea2 a Ctrl-C landing after the chunk's outputs were renamed into place
    (the job still logging its end) failed the job: Snakemake deleted the finished chunk
    and the next run redid it.  And an interruption before that said "rerun the same
    command to continue" of a chunk that starts over."""
    import signal

    from hsextract.smk import JOB_DONE, run_step

    outputs = [tmp_path / "chunk_00002.safetensors", tmp_path / "chunk_00002.json"]

    def finishes_then_ctrl_c(sm: object) -> None:
        for p in outputs:
            p.write_text("done")  # renamed into place: complete
        os.kill(os.getpid(), signal.SIGINT)  # the key lands now

    saved = sys.stdout, sys.stderr
    try:
        run_step(_Job(tmp_path, outputs), finishes_then_ctrl_c)  # returns: the job is done
    finally:
        sys.stdout, sys.stderr = saved
    log = (tmp_path / "job.log").read_text()
    assert JOB_DONE in log and "interrupted" not in log, log
    assert all(p.exists() for p in outputs)

    def interrupted(sm: object) -> None:
        outputs[0].write_text("done")  # the sidecar is not written yet
        os.kill(os.getpid(), signal.SIGINT)

    outputs[1].unlink()
    try:
        run_step(_Job(tmp_path, outputs), interrupted)
        raise AssertionError("an unfinished job must fail")
    except SystemExit as exc:
        assert exc.code == 130
    finally:
        sys.stdout, sys.stderr = saved
    said = (tmp_path / "job.log").read_text().splitlines()[-1]
    assert "chunk 00002 not finished" in said and "starts it over" in said, said


def test_the_speculators_export_without_prenorm_final_is_one_sentence_with_a_command(tmp_path):
    """On 51ddea2 it stopped inside Snakemake's `InputFunctionException ... Traceback:`
    block and named no command to run."""
    from fixtures_demo import snakemake_cmd

    wd = make_workdir(tmp_path / "w")
    proc = subprocess.run(snakemake_cmd(wd, "-n", "export_speculators"),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "InputFunctionException" not in out and "Traceback" not in out, out[-3000:]
    (said,) = [x for x in out.splitlines() if x.startswith("hsextract: error: ")]
    assert "prenorm_final: true" in said and "`snakemake -j1 export_speculators" in said, said


def test_verify_names_the_command_that_redoes_a_missing_chunk(demo_copy):
    """On 51ddea2 a missing chunk was "chunk_00001: ... missing", with no command."""
    import shlex

    wd, rd = demo_copy["workdir"], demo_copy["run_dir"]
    (rd / "hidden" / "chunk_00001.safetensors").unlink()
    proc = _hsextract_into(subprocess.PIPE, "verify", str(rd), cwd=wd)
    assert proc.returncode == 1
    (line,) = [x for x in proc.stdout.splitlines() if "chunk_00001.safetensors missing" in x]
    argv = shlex.split(line.split("`")[1])
    assert argv[:2] == ["snakemake", "-j1"], line
    plan = subprocess.run([sys.executable, "-m", *argv, "-n"], cwd=wd,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "extract_chunk" in plan.stdout and "chunk_00001" in plan.stdout, plan.stdout[-3000:]


def test_the_specforge_train_line_works_pasted_into_a_shell(demo_copy, tmp_path):
    """On 51ddea2 the `train:` line printed the export directory unquoted: a space or a
    `$` in it split or expanded the argument in the shell it was pasted into."""
    import shlex

    out = tmp_path / "my exports $HOME"
    manifest = demo_copy["run_dir"] / "manifest.json"
    proc = _hsextract_into(subprocess.PIPE, "export", "specforge", "--manifest", str(manifest),
                           "--out", str(out), cwd=demo_copy["workdir"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("train: ")]
    argv = shlex.split(line.removeprefix("train: "))
    assert f"data.hidden_states_path={out.resolve()}" in argv, argv


def test_a_config_error_under_snakemake_is_the_one_sentence(tmp_path):
    """On 51ddea2 Snakemake printed 3-5 `File ".../config.py"` lines before the sentence
    that `hsextract` prints alone (a refused --config value, an empty glob)."""
    from fixtures_demo import snakemake_cmd

    wd = make_workdir(tmp_path / "w")
    cases = {
        ("--config", "max_seq_len=-3"): "--config max_seq_len=-3: config key max_seq_len",
        ("--config", "demo={enabled: false}", "inputs=[nothing/*.jsonl]"): "",
    }
    for args, says in cases.items():
        proc = subprocess.run(snakemake_cmd(wd, "-n", *args),
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out[-2000:]
        assert 'File "' not in out and "Traceback" not in out, out[-3000:]
        (line,) = [x for x in out.splitlines() if x.startswith("hsextract: error: ")]
        assert says in line, line


def test_a_missing_input_and_an_empty_glob_say_where_they_looked(tmp_path, monkeypatch):
    """On 51ddea2: "input '…' is not a file" for a path that does not exist, and a glob
    matching nothing did not say which directory it looked in (a relative one is read
    from the working directory, which may not be the one the user meant)."""
    import pytest

    from hsextract.records import InputError, resolve_inputs

    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError) as missing:
        resolve_inputs(["data/shard.jsonl"])
    assert "does not exist" in str(missing.value) and "is not a file" not in str(missing.value)
    assert str(tmp_path / "data" / "shard.jsonl") in str(missing.value)
    (tmp_path / "data").mkdir()
    with pytest.raises(InputError) as empty:
        resolve_inputs(["data/*.jsonl"])
    assert f"it looked in {tmp_path / 'data'};" in str(empty.value), str(empty.value)
    with pytest.raises(InputError) as nowhere:
        resolve_inputs(["elsewhere/*.jsonl"])
    assert f"{tmp_path / 'elsewhere'}, which does not exist" in str(nowhere.value)
