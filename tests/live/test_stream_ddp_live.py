"""speculators' own Trainer under DDP on two GPUs, training from a run in progress under a
disk budget (issue 39, item 6).  Marker ``multi_gpu``: deselected everywhere else (never
skipped); ``bash h200/run_ddp.sh`` runs it in one device call (h200/README.md, "Two GPUs").

The producer is tests/test_stream_trainers.py's (the real budget gate, ChunkWriter and
journal, in a thread of this process: 10 chunks of 4 records, a budget of 4.5 chunks); the
trainer is tests/stream_speculators_rank.py -- the rank body the CPU test runs with world
1 -- under torchrun: 2 ranks, one GPU each, speculators' own ``maybe_setup_distributed``
(NCCL), its DDP model, its rank-0 checkpointer, ``AckOnCheckpoint`` acking after each
checkpoint rank 0 committed.  A batch is 300 tokens, one record a rank: 20 steps a pass,
a chunk covered (and checkpointed) every 2.

``HSEXTRACT_DDP_CPU=1``: the same tests with the ranks on the CPU over gloo (the rank's
``--cpu``), a check of this harness where no GPU is; it is not the GPU result (no NCCL,
no CUDA, no torch.compile, which speculators turns on only with CUDA).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from fixtures_demo import kill_processes_under

from hsextract.records import INDEX_FORMAT
from hsextract.stream import journal
from tests.test_stream import wait_for
from tests.test_stream_trainers import (
    N_CHUNKS,
    RECORDS,
    TOKENS,
    Producer,
    _bytes_per_token,
    _settings,
    all_keys,
)

pytestmark = pytest.mark.multi_gpu

REPO = Path(__file__).resolve().parents[2]
RANK = REPO / "tests" / "stream_speculators_rank.py"
CPU = os.environ.get("HSEXTRACT_DDP_CPU") == "1"
WORLD = 2
STEPS = N_CHUNKS * RECORDS // WORLD  # one 300-token record a rank a step
JOB_S = 400  # a deadline for one torchrun job, not a wait: the tests wait for its exit
DIE_STEP = 5  # mid-chunk: chunks 0 and 1 committed (steps 2, 4), step 5 trained, not committed


@pytest.fixture
def two_gpus():
    if CPU:
        return
    import torch

    n = torch.cuda.device_count()
    assert n >= WORLD, (
        f"{n} CUDA device(s) here; this test needs {WORLD} of one host (device kind "
        "nvidia-h100-x2: h200/README.md), or HSEXTRACT_DDP_CPU=1 for the CPU check"
    )


def plan(run: Path) -> None:
    """``chunks/index.json`` as the workflow's plan writes it before any chunk (the field
    read here): the sampler's ``len()`` -- by which speculators' Trainer sizes its LR
    schedule and times its recovery syncs, on every rank -- then counts the run's planned
    tokens, the same on both ranks, not the chunks announced when each rank asks."""
    index = run / "chunks" / "index.json"
    index.parent.mkdir(parents=True)
    chunks = [{"chunk": f"chunk_{i:05d}", "records": RECORDS, "tokens": RECORDS * TOKENS}
              for i in range(N_CHUNKS)]  # fmt: skip
    index.write_text(json.dumps({"format": INDEX_FORMAT, "chunks": chunks}))


def launch(job: Path, run: Path, out: Path, log: Path, *extra: str) -> subprocess.Popen:
    """torchrun, 2 ranks, in its own directory (``kill_processes_under`` ends all it
    started, the loader workers too); its output in ``job/torchrun.log``."""
    job.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(WORLD), "--max-restarts", "0", str(RANK),
           "--run-dir", str(run), "--out", str(out), "--log-dir", str(log),
           "--batch-tokens", str(TOKENS), "--checkpoint-chunks", "1", "--workers", "1",
           "--prefetch", "1", *extra, *(["--cpu"] if CPU else [])]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH")])
    )
    # NVLink multicast stays off in every process (the device's rule for shared hosts).
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1")  # fmt: skip
    out_f = open(job / "torchrun.log", "w")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(cmd, cwd=job, env=env, stdout=out_f, stderr=subprocess.STDOUT)


def finished(proc: subprocess.Popen, job: Path) -> tuple[int, str]:
    """Its exit status (waited for, up to the deadline) and the end of its output."""
    try:
        rc = proc.wait(timeout=JOB_S)
    except subprocess.TimeoutExpired:
        rc = None
    text = (job / "torchrun.log").read_text(errors="replace")[-6000:]
    assert rc is not None, f"torchrun still running after {JOB_S} s:\n{text}"
    return rc, text


def batches(log: Path, rank: int) -> list[tuple[int, list[tuple[int, int]]]]:
    return [
        (b["n"], [tuple(k) for k in b["keys"]])
        for b in journal.read_lines(log / f"batches.{rank}.jsonl")
    ]


def trainer_acks(run: Path) -> list[dict]:
    """The trainer's ack lines (the test's own unblocking ack has no step)."""
    lines = journal.read_lines(run / "stream" / "acks.jsonl")
    return [a for a in lines if a["type"] == "ack" and a["step"] is not None]


def assert_acks_follow_checkpoints(run: Path, logs: list[Path], trained: dict[int, set]) -> None:
    """Every ack went through rank 0's check (the Trainer's checkpoint of that step on
    disk first), and every record of each chunk it acks is in a batch trained at or before
    that step (``trained``: batch number -> the records both ranks trained in it)."""
    checked = {(tuple(c["seqs"]), c["step"]) for lg in logs
               for c in journal.read_lines(lg / "acks.checked.jsonl")}  # fmt: skip
    for a in trainer_acks(run):
        assert (tuple(a["seqs"]), a["step"]) in checked, a
        before = set().union(*(keys for n, keys in trained.items() if n <= a["step"]))
        for seq in a["seqs"]:
            assert {(seq, j) for j in range(RECORDS)} <= before, (a, seq)


def assert_ranks_agree(log: Path) -> None:
    """Both ranks trained the whole pass in lockstep and hold the same weights (DDP)."""
    res = [json.loads((log / f"result.{r}.json").read_text()) for r in range(WORLD)]
    assert all(r["global_step"] == STEPS and r["finite"] and r["changed"] for r in res), res
    assert len({r["digest"] for r in res}) == 1, res


def test_speculators_trainer_under_ddp_trains_from_a_run_in_progress_under_a_budget(
    tmp_path, two_gpus
):
    """Two ranks train one pass while it is extracted: every record exactly once across
    the ranks, acks only after a checkpoint rank 0 committed covers them, unacked bytes
    within the budget, the producer held by it."""
    run, out, log = tmp_path / "run", tmp_path / "ckpt", tmp_path / "log"
    bpt = _bytes_per_token(tmp_path / "scratch")
    ss = _settings(bpt)  # room for one rank's window: speculators' ranks share each chunk
    producer = Producer(run, ss, bpt)
    plan(run)
    producer.start()
    try:
        job = launch(tmp_path / "job", run, out, log)
        rc, text = finished(job, tmp_path / "job")
    finally:
        producer.stop.set()
        journal.AckWriter(run).ack(list(range(N_CHUNKS)))  # unblock a waiting producer
        producer.join(60)
        kill_processes_under(tmp_path)
    assert rc == 0, text
    assert producer.error is None, producer.error
    assert_ranks_agree(log)
    got = [batches(log, r) for r in range(WORLD)]
    assert [n for n, _ in got[0]] == [n for n, _ in got[1]] == list(range(1, STEPS + 1))
    assert Counter(k for g in got for _, b in g for k in b) == all_keys()
    trained = {n: set(b0) | set(b1) for (n, b0), (_, b1) in zip(*got, strict=True)}
    assert_acks_follow_checkpoints(run, [log], trained)
    acks = trainer_acks(run)
    assert sorted(s for a in acks for s in a["seqs"]) == list(range(N_CHUNKS))
    assert len(acks) >= N_CHUNKS // 2  # checkpoints within the pass, not only at its end
    first = journal.read_lines(log / "acks.checked.jsonl")[0]
    assert first["announced"] < N_CHUNKS and producer.waited  # in progress, held by the budget
    assert producer.peak <= ss.budget_bytes < N_CHUNKS * RECORDS * TOKENS * bpt
    deleted = journal.read_lines(run / "stream" / "deleted.jsonl")
    assert len(deleted) >= N_CHUNKS - 4  # freed by the gate while the run went on


@pytest.mark.parametrize("dies", [0, 1], ids=["rank0-dies", "rank1-dies"])
def test_a_rank_killed_mid_pass_and_the_job_resumed_trains_each_record_once(
    tmp_path, two_gpus, dies
):
    """Rank ``dies`` is SIGKILLed after step 5 (mid-chunk: chunks 0-1 committed and acked
    at steps 2 and 4, step 5 trained, not committed); torchrun ends the job.  The job
    rerun with ``--resume`` while the producer waits at its budget: it trains exactly the
    records the committed checkpoint did not cover -- each record once over both jobs --,
    without the chunks acked before (deleted by the gate meanwhile)."""
    run, out = tmp_path / "run", tmp_path / "ckpt"
    log1, log2 = tmp_path / "log1", tmp_path / "log2"
    bpt = _bytes_per_token(tmp_path / "scratch")
    ss = _settings(bpt)
    producer = Producer(run, ss, bpt)
    plan(run)
    producer.start()
    try:
        job = launch(tmp_path / "job1", run, out, log1, "--die-at-step", str(DIE_STEP),
                     "--die-rank", str(dies))  # fmt: skip
        rc1, text1 = finished(job, tmp_path / "job1")
        kill_processes_under(tmp_path)  # a loader worker the kill orphaned, if any
        assert rc1 != 0 and not list(log1.glob("result.*.json")), text1
        saved = json.loads((out / "0" / "training_state.json").read_text())
        assert saved["local_step"] == saved["global_step"] == DIE_STEP - 1, (saved, text1)
        acked = {s for a in trainer_acks(run) for s in a["seqs"]}
        assert acked == {0, 1}, (acked, text1)
        # The run goes on without a trainer: the gate frees what job 1 acked, and the
        # producer waits at its budget (it cannot finish without more acks).
        sdir = run / "stream"

        def freed() -> bool:
            return acked <= {d["seq"] for d in journal.read_lines(sdir / "deleted.jsonl")}

        wait_for(freed, timeout=120)
        assert len(journal.read_state(sdir).chunks) < N_CHUNKS
        job = launch(tmp_path / "job2", run, out, log2, "--resume")
        rc2, text2 = finished(job, tmp_path / "job2")
    finally:
        producer.stop.set()
        journal.AckWriter(run).ack(list(range(N_CHUNKS)))  # unblock a waiting producer
        producer.join(60)
        kill_processes_under(tmp_path)
    assert rc2 == 0, text2
    assert producer.error is None, producer.error
    assert_ranks_agree(log2)
    first = [batches(log1, r) for r in range(WORLD)]
    again = [batches(log2, r) for r in range(WORLD)]
    # Job 1 trained past its last checkpoint (the killed step): lost, and trained again.
    assert all(max(n for n, _ in b) >= DIE_STEP for b in first)
    committed = Counter(k for b in first for n, keys in b if n < DIE_STEP for k in keys)
    assert {s for s, _ in committed} == acked
    assert [n for n, _ in again[0]] == [n for n, _ in again[1]] == list(range(DIE_STEP, STEPS + 1))
    resumed = Counter(k for b in again for _, keys in b for k in keys)
    assert committed + resumed == all_keys()  # each record once over both jobs
    assert not {s for s, _ in resumed} & acked  # nothing of the chunks acked before
    trained = {n: {k for b in first for m, keys in b if m == n for k in keys}
               for n in range(1, DIE_STEP)}  # fmt: skip
    trained.update({n: {k for b in again for m, keys in b if m == n for k in keys}
                    for n in range(DIE_STEP, STEPS + 1)})  # fmt: skip
    assert_acks_follow_checkpoints(run, [log1, log2], trained)
    assert {s for a in trainer_acks(run) for s in a["seqs"]} == set(range(N_CHUNKS))
    assert producer.peak <= ss.budget_bytes and producer.waited
