"""The workflow through Snakemake's SLURM executor, against a real SLURM on this machine.

A module fixture starts munge, slurmctld and two slurmd (nodes n1 and n2, one host:
``slurmd -N``) on loopback, each node with one fake GPU (a GRES backed by /dev/null), so
the profile's real GPU request (``--gpus``) is scheduled.  ``profiles/slurm`` runs as it
ships, with only the sizes a 2-core machine can give changed (``slurm_profile``).  Job
status is read with squeue (no slurmdbd): MinJobAge is far above the plugin's threshold.

Needs Debian's ``slurm-wlm`` and ``munge`` and root (slurmd runs jobs as their user);
``.ci/run`` installs them.  Deselect with ``-m 'not slurm'`` where SLURM is absent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from fixtures_demo import (
    REPO,
    engine_processes,
    make_workdir,
    run_dir_of,
    run_snakemake,
    snakemake_cmd,
)

from hsextract.chunks import sha256_file

pytestmark = [pytest.mark.workflow, pytest.mark.slurm]

DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo", "squeue", "scancel", "sbatch")
NODES = ("n1", "n2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str, step: float = 0.2):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _pid_of(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _slurm(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}")
    return proc


SLURM_CONF = """\
ClusterName=hsextract-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/socket
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.%n.log
GresTypes=gpu
# No cgroups in a container: processes are tracked by process group, tasks not confined.
# Not by parentage (linuxproc): a process whose parent died first is lost to it, never
# killed.  Seen in CI: scancel's SIGTERM hit the allocation's Snakemake inside its error
# handler, whose signal handler then waited forever on the lock the handler's own frame
# held (snakemake's JobScheduler.exit_gracefully); its batch shell died, and the SIGKILL
# after KillWait missed it, so its server lived on.  A cluster's cgroup kills the lot.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
JobAcctGatherType=jobacct_gather/none
# No slurmdbd: the plugin reads status with squeue, which knows a finished job for
# MinJobAge seconds (>= 3 x --slurm-init-seconds-before-status-checks, else sacct).
AccountingStorageType=accounting_storage/none
MinJobAge=600
MpiDefault=none
ReturnToService=2
KillWait=5
InactiveLimit=0
NodeName=DEFAULT CPUs=2 RealMemory=2000 Gres=gpu:1 State=UNKNOWN
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port}
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n2_port}
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """munged + slurmctld + slurmd n1, n2 on loopback, torn down (every daemon and job)."""
    missing = [
        d for d in DAEMONS if shutil.which(d, path=f"{os.environ['PATH']}:/usr/sbin") is None
    ]
    if missing or os.geteuid() != 0:
        pytest.fail(
            f"a real SLURM needs root and Debian's slurm-wlm + munge (missing: {missing}, "
            f"euid {os.geteuid()}): see README's test set-up, or deselect with -m 'not slurm'"
        )
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "ctld", "log", *(f"spool/{n}" for n in NODES)):
        (d / sub).mkdir(parents=True)
    os.chmod(d / "munge", 0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(128))
    os.chmod(key, 0o400)
    ports = {"ctld_port": _free_port(), "n1_port": _free_port(), "n2_port": _free_port()}
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(d=d, **ports))
    # A fake GPU per node: count-only GRES needs a device file; nothing opens it.
    (d / "gres.conf").write_text("AutoDetect=off\nName=gpu File=/dev/null\n")
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)  # sbatch, squeue ... and the workflow's jobs

    pidfiles = [d / "munge" / "munged.pid", d / "slurmctld.pid"]
    pidfiles += [d / f"slurmd.{n}.pid" for n in NODES]
    try:
        _slurm(
            "munged", "--force", f"--socket={d}/munge/socket", f"--key-file={key}",
            f"--pid-file={pidfiles[0]}", f"--log-file={d}/log/munged.log",
            f"--seed-file={d}/munge/seed",
        )  # fmt: skip
        _wait(lambda: (d / "munge" / "socket").exists(), 10, "munged's socket")
        _slurm("slurmctld", "-f", str(conf), "-i")
        for n in NODES:
            _slurm("slurmd", "-f", str(conf), "-N", n)

        def idle():
            out = _slurm("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
            return dict(zip(out[::2], out[1::2], strict=False)) == dict.fromkeys(NODES, "idle")

        _wait(idle, 60, "nodes n1 and n2 idle (see the logs in " + str(d / "log") + ")")
        yield {"dir": d, "conf": conf}
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], capture_output=True, timeout=30)

        def no_jobs():
            out = _slurm("squeue", "-h", "-o", "%T", check=False)
            return out.returncode != 0 or not (
                set(out.stdout.split()) - {"COMPLETED", "CANCELLED", "FAILED"}
            )

        try:
            _wait(no_jobs, 120, "jobs to end")
        except AssertionError:
            pass
        for pidfile in reversed(pidfiles):  # slurmd, slurmctld, munged last
            pid = _pid_of(pidfile)
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGTERM)
                try:
                    _wait(lambda p=pid: not _alive(p), 20, f"{pidfile.stem} to exit")
                except AssertionError:
                    os.kill(pid, signal.SIGKILL)
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved


def slurm_profile(dest: Path) -> Path:
    """profiles/slurm as it ships, at this machine's size: 1 fake GPU, 1 CPU and 500 MB per
    chunk job, two chunk jobs per allocation (so the 4 demo chunks take both nodes), squeue
    status checked every few seconds, and the SLURM logs of successful jobs kept."""
    cfg = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    cfg["resources"] = {"gpu": 1}
    cfg["group-components"] = {"extract": 2}
    cfg["default-resources"] = {**cfg["default-resources"], "mem_mb": 500}
    cfg["set-resources"]["extract_chunk"].update(gpu=1, cpus_per_gpu=1, mem_mb=500)
    cfg.update(
        {
            "slurm-status-command": "squeue",
            "slurm-init-seconds-before-status-checks": 2,
            "slurm-keep-successful-logs": True,
        }
    )
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.yaml").write_text(yaml.safe_dump(cfg))
    return dest


def manifest_shas(rd: Path) -> dict[str, str]:
    data = json.loads((rd / "manifest.json").read_text())
    return {c["path"]: c["sha256"] for c in data["chunks"]}


def submitted(output: str) -> dict[str, str]:
    """SLURM job id -> what it ran ('group_extract_extract_chunk', 'rule_x'), from the log."""
    return dict(
        (m.group(1), m.group(2))
        for m in re.finditer(r"SLURM jobid (\d+) \(log: \S*/slurm_logs/([^/]+)/\d+\.log\)", output)
    )


def chunk_allocations(rd: Path) -> dict[str, tuple[str, bool]]:
    """chunk -> (host key it ran on, finished), from the chunk logs."""
    out = {}
    for log in sorted((rd / "logs").glob("extract_chunk_*.log")):
        text = log.read_text(errors="replace")
        m = re.search(r"chunk job on (\S+)", text)
        if m:
            out[log.stem.removeprefix("extract_")] = (m.group(1), "chunk done" in text)
    return out


def stamps(rd: Path) -> dict[str, tuple[str, int]]:
    return {
        f.name: (sha256_file(f), f.stat().st_mtime_ns)
        for f in sorted((rd / "hidden").glob("chunk_*.safetensors"))
    }


def engines_of(workdir: Path) -> list[int]:
    """Servers and watchdogs started from this workdir (other tests may run servers now)."""
    return engine_processes(workdir)


def assert_nothing_left(workdir: Path, rd: Path) -> None:
    """No server or watchdog survives its allocation; no live file claims one does."""
    _wait(lambda: not engines_of(workdir), 180, "the allocations' servers to stop")
    assert not list((rd / "state").glob("server.*.live.json*"))  # forget_finished_jobs


def test_slurm_run_matches_local_run(slurm_cluster, demo_run, tmp_path):
    workdir = make_workdir(tmp_path / "wd")
    profile = slurm_profile(tmp_path / "profile")
    proc = run_snakemake(workdir, "--profile", str(profile), "extract_all", timeout=300)
    rd = run_dir_of(workdir)
    out = proc.stdout + proc.stderr

    assert manifest_shas(rd) == manifest_shas(demo_run["run_dir"])

    # Only the chunk jobs went to SLURM, in two allocations of two chunks each, one per node.
    jobs = submitted(out)
    assert sorted(jobs.values()) == ["group_extract_extract_chunk"] * 2, jobs
    q = _slurm("squeue", "-h", "--states=all", "-j", ",".join(jobs), "-o", "%i %T %N %b")
    rows = {r.split()[0]: r.split()[1:] for r in q.stdout.splitlines()}
    assert {r[0] for r in rows.values()} == {"COMPLETED"}, q.stdout
    assert sorted(r[1] for r in rows.values()) == ["n1", "n2"], q.stdout
    # ... and each chunk ran inside one of them, each allocation starting one server.
    where = chunk_allocations(rd)
    assert sorted(where) == [f"chunk_{i:05d}" for i in range(4)]
    keys = {key for key, done in where.values() if done}
    assert {k.rsplit(".job", 1)[1] for k in keys} == set(jobs), where
    for key in keys:
        server_log = (rd / "logs" / "servers" / f"{key}.log").read_text()
        assert server_log.count(" start: ") == 1, server_log
    # The head node neither gated GPUs nor started a server.
    assert json.loads((rd / "state" / "gpu_gate.json").read_text())["per_node"] is True
    assert json.loads((rd / "state" / "server.json").read_text())["started"] is False
    assert_nothing_left(workdir, rd)


def test_a_cancelled_allocation_redoes_only_its_unfinished_chunks(
    slurm_cluster, demo_run, tmp_path
):
    workdir = make_workdir(tmp_path / "wd")
    profile = slurm_profile(tmp_path / "profile")
    rd = run_dir_of(workdir)
    # Each chunk's first pass waits on a gate of its own: the test lets one chunk of an
    # allocation through, and cancels the allocation while its next chunk is held.
    gates = {f"chunk_{c:05d}": tmp_path / f"go-{c}" for c in range(4)}
    fault_log = tmp_path / "faults.jsonl"
    hold = {
        "log": str(fault_log),
        "extend": [
            {"rid": f"{chunk}-", "nth": [1], "do": "wait", "gate": str(gate)}
            for chunk, gate in gates.items()
        ],
    }
    env = {**os.environ, "HSEXTRACT_FAULTS": json.dumps(hold)}
    log = open(tmp_path / "run1.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        snakemake_cmd(workdir, "--profile", str(profile), "extract_all"),
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    job = None
    try:

        def caught():
            """The allocation with a finished chunk and one held mid-extraction; on the
            way, open the gate of a held chunk once all its allocation runs is held (two
            chunks of one allocation may run side by side: one goes first)."""
            assert proc.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
            waits = fault_log.read_text().splitlines() if fault_log.exists() else []
            held = {json.loads(x)["rid"][: len("chunk_00000")] for x in waits}
            by_job: dict[str, dict[str, bool]] = {}
            for chunk, (key, done) in chunk_allocations(rd).items():
                by_job.setdefault(key.rsplit(".job", 1)[1], {})[chunk] = done
            for j, chunks in by_job.items():
                running = sorted(c for c, done in chunks.items() if not done)
                waiting = [c for c in running if c in held and not gates[c].exists()]
                if waiting and any(chunks.values()):
                    return j
                if waiting and waiting == running:
                    gates[waiting[0]].touch()
            return None

        job = _wait(caught, 300, "an allocation with one chunk done and one held", 0.1)
        before = chunk_allocations(rd)
        _slurm("scancel", job)
        # The other allocation goes on; the cancelled one's held chunk stays held.
        for chunk, (key, _) in before.items():
            if not key.endswith(f".job{job}"):
                gates[chunk].touch()
        for chunk, gate in gates.items():
            if chunk not in before:
                gate.touch()
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        for gate in gates.values():
            gate.touch()
    out = (tmp_path / "run1.log").read_text()
    assert rc != 0, out[-3000:]
    # The allocation was cancelled by SLURM (slurmstepd's line, in the job's log) and the
    # other one ran to its end: Snakemake waits for running jobs before it exits.
    assert re.search(rf"\*\*\* JOB {job} ON n[12] CANCELLED", out), out[-3000:]
    assert_nothing_left(workdir, rd)

    kept = stamps(rd)
    # The cancelled allocation's chunk mid-extraction (the other allocation's go on).
    in_flight = {c for c, (key, done) in before.items() if key.endswith(f".job{job}") and not done}
    assert len(in_flight) == 1, before
    assert kept and not in_flight & {n.removesuffix(".safetensors") for n in kept}

    # The rerun (no faults) redoes the chunks the cancelled allocation did not finish.
    proc = run_snakemake(workdir, "--profile", str(profile), "extract_all", timeout=300)
    after = stamps(rd)
    for name, stamp in kept.items():
        assert after[name] == stamp, f"{name} was redone"
    redone = {name for name in after if name not in kept}
    assert {c + ".safetensors" for c in in_flight} <= redone
    # ... and nothing else: one chunk job per unfinished chunk, in one allocation.
    out = proc.stdout + proc.stderr
    assert out.count("rule extract_chunk:") == len(redone) == 4 - len(kept), out[-3000:]
    assert list(submitted(out).values()) == ["group_extract_extract_chunk"], out[-3000:]
    assert manifest_shas(rd) == manifest_shas(demo_run["run_dir"])
    assert_nothing_left(workdir, rd)


def test_a_cancelled_allocation_leaves_no_process_that_outlived_its_shell(slurm_cluster, tmp_path):
    """The test cluster kills a cancelled allocation's every process, as a cluster's
    cgroup does: one that ignores the SIGTERM (as a Snakemake stuck in its own signal
    handler did, its server kept alive by it) and whose batch shell died first is killed
    after KillWait, not left running because its parent is gone."""
    pidfile = tmp_path / "child.pid"
    child = (
        f"{sys.executable} -c 'import os, signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f'open("{pidfile}.tmp", "w").write(str(os.getpid())); '
        f'os.rename("{pidfile}.tmp", "{pidfile}"); time.sleep(600)\''
    )
    job = _slurm("sbatch", "--parsable", "--nodelist=n1", "--cpus-per-task=1", "--mem=100",
                 f"--output={tmp_path}/slurm-%j.log", "--wrap", f"{child} & wait")  # fmt: skip
    job_id = job.stdout.strip().split(";")[0]
    pid = None
    try:
        pid = int(_wait(lambda: pidfile.exists() and pidfile.read_text(), 120, "the child"))
        _slurm("scancel", job_id)
        _wait(lambda: not _alive(pid), 120, f"the SIGTERM-ignoring process {pid} to be killed")
    finally:
        _slurm("scancel", job_id, check=False)
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_an_allocations_first_server_start_clears_a_cancelled_ones_pieces(tmp_path, monkeypatch):
    """On a compute node no stale deletion runs (that is the head's): a cancelled
    allocation's in-flight pieces are cleared when the run's next allocation there starts
    its server, unless another live server of the run on this host may own them."""
    from hsextract import server, steps
    from hsextract.config import RUN_MARKER

    monkeypatch.setenv("SLURM_JOB_ID", "41")
    state, dump = tmp_path / "state", tmp_path / "dump"
    state.mkdir()
    gated = []

    def leftovers():
        for d in (dump, dump / ".budget", dump / "chunk_00003-000001-0123abcd"):
            d.mkdir(parents=True, exist_ok=True)
        (dump / RUN_MARKER).write_text("{}")
        (dump / f".{RUN_MARKER}.9.tmp").write_text("{}")  # a server starting now, not live
        (dump / "chunk_00003-000001-0123abcd" / "000000000.safetensors").write_bytes(b"x")
        (dump / "notes.txt").write_text("a user's file in an adopted dump.dir: it stays")

    def check():
        steps._with_node_cleanup(lambda: gated.append(1), dump, state)()
        return sorted(p.name for p in dump.iterdir())

    host = socket.gethostname()
    leftovers()
    server.write_json(state / f"server.{host}.job40.live.json", {"pid": 2**22 + 7})  # dead
    assert check() == [f".{RUN_MARKER}.9.tmp", ".budget", RUN_MARKER, "notes.txt"]
    leftovers()
    server.write_json(state / f"server.{host}.job42.live.json", {"pid": os.getpid()})  # alive
    assert "chunk_00003-000001-0123abcd" in check()
    (state / f"server.{host}.job42.live.json").unlink()
    server.write_json(server.live_path(state), {"pid": 2**22 + 7})  # our own: a relaunch
    assert "chunk_00003-000001-0123abcd" in check()
    assert len(gated) == 3  # the GPU gate runs every time


def test_train_while_extracting_with_the_trainer_on_another_node(slurm_cluster, tmp_path):
    """Issue 39, across nodes: the chunk jobs in SLURM allocations, the trainer a SLURM job
    of its own on n2; journal, acks and reservations are files of the shared output_root
    (one host here, so the filesystem is trivially shared; the protocol uses nothing
    else: no service, no socket between them).  Every record trained on once, the budget
    held on disk through the run, nothing left reserved or running."""
    from collections import Counter

    from hsextract.budget import bytes_per_token
    from hsextract.stream import gate, journal

    workdir = make_workdir(tmp_path / "wd", **{"n_chunks": 8, "demo.n_records": 32,
                                             "max_seq_len": 128})  # fmt: skip
    rd = run_dir_of(workdir)
    run_snakemake(workdir, "-j1", str((rd / "chunks" / "index.json").relative_to(workdir)))
    tokens = [c["tokens"] for c in json.loads((rd / "chunks" / "index.json").read_text())["chunks"]]
    bpt = bytes_per_token(64, 3, "float32")  # the demo model: H 64, 3 aux layers
    stream = {"prefetch_chunks": 1, "checkpoint_chunks": 1, "low_mark": 0.85, "poll_s": 0.2}
    ss = gate.StreamSettings(budget_gb=0, **stream)
    w = ss.window_chunks()
    budget = int(max(w, (w - 1) / ss.low_mark) * max(tokens) * bpt) + 1000  # the least allowed
    assert budget < 0.75 * sum(tokens) * bpt
    cfg = yaml.safe_load((workdir / "config.yaml").read_text())
    cfg["stream"] = {"budget_gb": budget / 1e9, **stream}
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))
    want = Counter(
        json.loads(line)["id"]
        for p in sorted((rd / "chunks").glob("chunk_*.jsonl"))
        for line in p.read_text().splitlines()
    )
    out = tmp_path / "trainer"
    out.mkdir()
    trainer_cmd = (f"{sys.executable} {REPO / 'tests' / 'stream_trainer.py'} --run-dir {rd} "
                   f"--out {out} --world 1 --workers 2 --ckpt-every 2")  # fmt: skip
    trainer = _slurm("sbatch", "--parsable", "--nodelist=n2", "--cpus-per-task=1", "--mem=400",
                     f"--output={out}/slurm-%j.log", "--wrap", trainer_cmd)  # fmt: skip
    trainer_id = trainer.stdout.strip().split(";")[0]
    sdir = rd / "stream"
    peak = [0]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            try:
                st = journal.read_state(sdir)
                peak[0] = max(peak[0], gate.unacked_bytes(rd, st, 1))
            except (FileNotFoundError, ValueError):
                pass  # no journal yet, or a file deleted while measured
            sampling.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    profile = slurm_profile(tmp_path / "profile")
    try:
        proc = run_snakemake(workdir, "--profile", str(profile), "extract_all", timeout=600)

        def trainer_state() -> str | None:
            q = _slurm("squeue", "-h", "--states=all", "-j", trainer_id, "-o", "%T %N")
            state = q.stdout.split()
            return " ".join(state) if state and state[0] in {"COMPLETED", "FAILED"} else None

        ended = _wait(trainer_state, 300, "the trainer's SLURM job to end")
        log = "".join(p.read_text() for p in out.glob("slurm-*.log"))
        assert ended == "COMPLETED n2", f"{ended}\n{log[-3000:]}"
    finally:
        sampling.set()
        sampler.join()
        subprocess.run(["scancel", trainer_id], capture_output=True, timeout=30)
    # The chunk jobs ran in SLURM allocations, not on the head node.
    assert set(submitted(proc.stdout + proc.stderr).values()) == {"group_extract_extract_chunk"}
    done = json.loads((out / "done.json").read_text())
    assert Counter(i for rank in done["trained"] for i in rank) == want
    st = journal.read_state(sdir)
    assert sorted(st.chunks) == list(range(8)) and all(st.is_acked(s) for s in range(8))
    assert 0 < peak[0] <= budget, (peak[0], budget)
    assert gate.reservations(sdir) == {}
    assert_nothing_left(workdir, rd)
