"""Reruns follow the data: a changed input or setting redoes exactly what it changes.

Real Snakemake on the embedded default.  Each test starts from a copy of the session's
finished demo run and compares against what a fresh run with the new config writes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import requests
import yaml
from fixtures_demo import (
    kill_processes_under,
    make_workdir,
    planned_jobs,
    run_dir_of,
    run_snakemake,
    start_snakemake,
    stop_snakemake,
    wait_until_gone,
)

from hsextract import server
from hsextract.chunks import ChunkReader, sha256_file
from hsextract.config import RUN_MARKER, dump_dir, read_config
from hsextract.records import id_hash

pytestmark = pytest.mark.workflow

#: Seconds a test waits for an event of a workflow before calling it hung: generous (a
#: loaded 2-core box runs the demo several times slower), as run_snakemake's 900.
WORKFLOW_DEADLINE_S = 900


def stamps(rd: Path) -> dict[str, tuple[str, int]]:
    return {
        f.name: (sha256_file(f), f.stat().st_mtime_ns)
        for f in sorted((rd / "hidden").glob("chunk_*.safetensors"))
    }


def set_config(workdir: Path, **overrides) -> None:
    cfg = yaml.safe_load((workdir / "config.yaml").read_text())
    for key, value in overrides.items():
        node = cfg
        *parts, last = key.split(".")
        for p in parts:
            node = node.setdefault(p, {})
        node[last] = value
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))


def train_records(rd: Path) -> dict[str, tuple[list[int], list[int]]]:
    out = {}
    for line in (rd / "merged" / "train.jsonl").read_bytes().splitlines():
        obj = orjson.loads(line)
        out[obj["id"]] = (obj["input_ids"], obj["loss_mask"])
    return out


def held_records(rd: Path) -> dict[str, tuple[list[int], list[int]]]:
    """Every record the chunk files hold, with its tokens; each id at most once."""
    held: dict[str, tuple[list[int], list[int]]] = {}
    for f in sorted((rd / "hidden").glob("chunk_*.safetensors")):
        for rec in ChunkReader(f):
            assert rec["id"] not in held, f"{rec['id']} in two chunks"
            held[rec["id"]] = (rec["input_ids"].tolist(), rec["loss_mask"].tolist())
    return held


def verify(rd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "verify", str(rd / "manifest.json")],
        capture_output=True,
        text=True,
    )


def manifest_shas(rd: Path) -> dict[str, str]:
    data = json.loads((rd / "manifest.json").read_text())
    return {c["path"]: c["sha256"] for c in data["chunks"]}


def test_a_removed_input_line_reextracts_only_its_chunk(demo_run, demo_copy):
    """The issue's scenario: hidden states always belong to the data."""
    workdir, rd = demo_copy["workdir"], demo_copy["run_dir"]
    before = stamps(rd)
    shard = workdir / "results" / "demo" / "data" / "shard_00.jsonl"
    lines = shard.read_bytes().splitlines(keepends=True)
    victim = orjson.loads(lines[4])["id"]
    shard.write_bytes(b"".join(ln for i, ln in enumerate(lines) if i != 4))

    res = run_snakemake(workdir, "-j1", "extract_all")
    after = stamps(rd)
    expected = f"chunk_{id_hash(victim) % 4:05d}.safetensors"
    assert [c for c in before if before[c] != after[c]] == [expected]
    assert "1 of 4 chunk(s) to extract, 3 current" in res.stderr
    assert (
        res.stderr.count("localrule extract_chunk:") + res.stdout.count("localrule extract_chunk:")
        == 1
    )
    # Exactly train.jsonl's records, once each, with their tokens.
    train = train_records(rd)
    assert victim not in train and len(train) == 47
    assert held_records(rd) == train
    ok = verify(rd)
    assert ok.returncode == 0, ok.stdout
    assert "Nothing to be done" in run_snakemake(workdir, "-n", "extract_all").stdout

    # A stale chunk planted by hand (the pre-change file, with its own consistent
    # sidecar and a manifest entry rehashed to match): verify still names it.
    old = demo_run["run_dir"] / "hidden" / expected
    shutil.copy2(old, rd / "hidden" / expected)
    shutil.copy2(old.with_suffix(".json"), (rd / "hidden" / expected).with_suffix(".json"))
    manifest = json.loads((rd / "manifest.json").read_text())
    for c in manifest["chunks"]:
        if c["path"] == f"hidden/{expected}":
            c["sha256"] = sha256_file(old)
    (rd / "manifest.json").write_text(json.dumps(manifest))
    bad = verify(rd)
    assert bad.returncode == 1
    assert f"chunk {Path(expected).stem}:" in bad.stdout and "stale" in bad.stdout, bad.stdout


def test_setting_changes_give_what_a_fresh_run_gives(demo_copy, tmp_path):
    """merge.overlength, n_chunks up and down, a new seed: each rerun equals a fresh run."""
    workdir, rd = demo_copy["workdir"], demo_copy["run_dir"]
    steps = [
        {"merge.overlength": "drop"},
        {"n_chunks": 6},
        {"seed": 7},  # reorders train.jsonl only: chunks depend on the records, not the seed
        {"n_chunks": 3},  # fewer: chunk files beyond 3 go, as a fresh run has none
    ]
    config: dict = {}
    for i, change in enumerate(steps):
        config.update(change)
        set_config(workdir, **config)
        prev_train = (rd / "merged" / "train.jsonl").read_bytes()
        prev = stamps(rd)
        # The fresh run goes at the same time as the rerun (each -j1 workflow leaves a core
        # mostly idle; CI has two): its own workdir, output root and dump dir.
        fresh = make_workdir(tmp_path / f"fresh{i}", **config)
        proc = start_snakemake(fresh, "-j1", "extract_all")
        try:
            run_snakemake(workdir, "-j1", "extract_all")
            out, _ = proc.communicate(timeout=900)
        finally:
            stop_snakemake(proc)
        assert proc.returncode == 0, f"fresh run {i} failed:\n{out[-8000:]}"
        assert run_dir_of(workdir) == rd  # none of these is in the fingerprint
        frd = run_dir_of(fresh)
        assert manifest_shas(rd) == manifest_shas(frd), change
        assert sorted(p.name for p in (rd / "hidden").iterdir()) == sorted(
            p.name for p in (frd / "hidden").iterdir()
        ), change
        assert (rd / "merged" / "train.jsonl").read_bytes() == (
            frd / "merged" / "train.jsonl"
        ).read_bytes()
        assert held_records(rd) == train_records(rd)
        assert verify(rd).returncode == 0
        if "seed" in change:
            assert (rd / "merged" / "train.jsonl").read_bytes() != prev_train
            assert stamps(rd) == prev  # nothing re-extracted
        if "merge.overlength" in change:
            stats = json.loads((rd / "merged" / "stats.json").read_text())
            assert stats["dropped_over_length"] == 1 and stats["truncated"] == 0


def test_a_server_setting_takes_effect_and_keeps_finished_chunks(demo_copy):
    workdir, rd = demo_copy["workdir"], demo_copy["run_dir"]
    before = stamps(rd)
    set_config(workdir, **{"server.chunked_prefill_size": 64})
    plan = planned_jobs(run_snakemake(workdir, "-n", "extract_all").stdout)
    assert plan.get("launch_server") == 1, plan  # the params trigger
    res = run_snakemake(workdir, "-j1", "extract_all")
    assert "localrule extract_chunk" not in res.stdout + res.stderr
    assert stamps(rd) == before  # chunked prefill is not in the fingerprint: nothing redone
    argv = json.loads((rd / "state" / "server.json").read_text())["spec"]["argv"]
    assert argv[argv.index("--chunked-prefill-size") + 1] == "64"
    # The next chunk that is extracted is extracted by a server with the new setting.
    (rd / "hidden" / "chunk_00001.safetensors").unlink()
    run_snakemake(workdir, "-j1", "extract_all")
    side = json.loads((rd / "hidden" / "chunk_00001.json").read_text())["server"]
    assert side["settings"]["chunked_prefill_size"] == 64
    assert side["argv"][side["argv"].index("--chunked-prefill-size") + 1] == "64"
    kept = json.loads((rd / "hidden" / "chunk_00000.json").read_text())["server"]
    assert kept["settings"]["chunked_prefill_size"] == 257  # its record stays true


def _pieces(d: Path) -> dict[str, int]:
    """Dump pieces under d and their sizes; tolerant of pieces consumed while we look."""
    out = {}
    for dirpath, _, files in os.walk(d):
        for name in files:
            if name.endswith(".safetensors"):
                p = Path(dirpath) / name
                try:
                    out[str(p.relative_to(d))] = p.stat().st_size
                except FileNotFoundError:
                    pass
    return out


def test_redoing_one_chunk_with_other_bytes_updates_the_manifest(demo_copy):
    """Issue 38 item 7: a chunk redone by its file target with a setting that changes its
    bytes (chunked prefill: other float sums) leaves a consistent run: the manifest lists
    the new sha256 and totals, verify passes, the dataset reads every record."""
    from hsextract.chunks import ManifestDataset

    workdir, rd = demo_copy["workdir"], demo_copy["run_dir"]
    victim = rd / "hidden" / "chunk_00001.safetensors"
    old = manifest_shas(rd)["hidden/chunk_00001.safetensors"]
    set_config(workdir, **{"server.chunked_prefill_size": 64})
    victim.unlink()
    run_snakemake(workdir, "-j1", str(victim.relative_to(workdir)))
    new = sha256_file(victim)
    assert new != old  # the scenario: other bytes (else the manifest is trivially right)
    assert manifest_shas(rd)["hidden/chunk_00001.safetensors"] == new
    manifest = json.loads((rd / "manifest.json").read_text())
    assert manifest["totals"]["bytes"] == sum(c["bytes"] for c in manifest["chunks"])
    assert manifest["totals"]["bytes"] == sum(
        f.stat().st_size for f in (rd / "hidden").glob("chunk_*.safetensors")
    )
    ok = verify(rd)
    assert ok.returncode == 0, ok.stdout
    ds = ManifestDataset(rd / "manifest.json")
    assert len([ds[i] for i in range(len(ds))]) == manifest["totals"]["records"]


def test_extract_all_redoes_a_chunk_whose_bytes_changed(demo_copy):
    """Issue 38 item 7: a chunk file written to after its extraction is re-hashed by the
    plan (it is newer than its sidecar) and redone if its bytes changed; one only touched
    keeps its bytes and is not redone, and the next plan has nothing to do."""
    workdir, rd = demo_copy["workdir"], demo_copy["run_dir"]
    before = stamps(rd)
    changed = rd / "hidden" / "chunk_00002.safetensors"
    data = bytearray(changed.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size
    changed.write_bytes(bytes(data))
    touched = rd / "hidden" / "chunk_00000.safetensors"
    os.utime(touched)  # newer than its sidecar, same bytes
    assert sha256_file(changed) != before[changed.name][0]

    res = run_snakemake(workdir, "-j1", "extract_all")
    out = res.stdout + res.stderr
    assert "1 of 4 chunk(s) to extract, 3 current" in res.stderr, out
    assert "chunk_00002: its bytes changed since extraction" in res.stderr
    assert out.count("localrule extract_chunk:") == 1
    after = stamps(rd)
    assert after[changed.name][0] == before[changed.name][0]  # re-extracted: the same bytes
    assert {c: after[c][0] for c in after} == {c: before[c][0] for c in before}
    assert "chunk_00000:" not in res.stderr  # touched, not redone: its bytes were hashed
    assert touched.stat().st_mtime_ns <= touched.with_suffix(".json").stat().st_mtime_ns
    ok = verify(rd)
    assert ok.returncode == 0, ok.stdout
    assert "Nothing to be done" in run_snakemake(workdir, "-n", "extract_all").stdout


def test_stale_deletion_never_touches_a_live_foreign_or_older_run(tmp_path, monkeypatch):
    """Two output roots with one fingerprint, one mid-extraction; a live second run in the
    same root; a run dir an older hsextract wrote.

    A is held mid-chunk on an event: its server stops after chunk_00001's first pass until
    the test creates the gate file, however long B's four Snakemake runs take."""
    # A's request is held while B runs six commands: its timeout must outlast them however
    # slow the machine (at the default 600 s a loaded box timed it out, and the retry
    # swept the pieces this test checks are kept).
    small = {"demo.n_records": 16, "n_chunks": 2, "client.request_timeout_s": 86400}
    a = make_workdir(tmp_path / "A", **small)
    gate, fault_log = tmp_path / "open-A", tmp_path / "a-faults.jsonl"
    hold = {
        "log": str(fault_log),
        # The hold's own limit (600 s by default) would release A on its own while B runs.
        "extend": [{"rid": "chunk_00001", "nth": [1], "do": "wait", "gate": str(gate),
                    "timeout_s": 86400}],
    }  # fmt: skip
    proc = start_snakemake(a, "-j1", "extract_all", faults=hold)
    # B's server needs an owner the test controls (not pytest: a server outlived the test
    # that way): this process ends when the test does, its pipe closed, and the watchdog
    # then stops the server, even if the test is killed.
    owner = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    b = tmp_path / "B"
    try:
        monkeypatch.chdir(a)
        a_dump = dump_dir(read_config("config.yaml"))
        # A builds the demo and extracts a chunk first: on a loaded box that took more than
        # the 300 s this waited.  The wait ends on the event, or on A's exit (it ran past
        # the hold, or failed); the deadline only stops a hang.
        deadline = time.monotonic() + WORKFLOW_DEADLINE_S

        def held() -> bool:
            mid = any(k.startswith("chunk_00001") for k in _pieces(a_dump))
            return mid and fault_log.exists()

        while not held():
            assert proc.poll() is None, "A ended without being held mid-chunk"
            assert time.monotonic() < deadline, "A never got mid-chunk"
            time.sleep(0.05)
        in_flight = _pieces(a_dump)

        make_workdir(b, **small)  # same config: same fingerprint
        brd = run_dir_of(b)
        assert brd.name == run_dir_of(a).name
        # B: a second run (other aux layers) with a live server, and an old-version run.
        other = ["--config", "aux_layers=[1,3,5]"]
        ord_ = b / subprocess.run(
            [sys.executable, "-m", "hsextract.cli", "run-dir", *other],
            cwd=b, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        run_snakemake(b, "-j1", str((ord_ / "chunks" / "index.json").relative_to(b)), *other)
        started = subprocess.run(
            [sys.executable, "-m", "hsextract.cli", "server", "start", *other],
            cwd=b, capture_output=True, text=True, timeout=300,
            env={**os.environ, "HSEXTRACT_OWNER_PID": str(owner.pid)},
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        old = b / "results" / "0123456789ab"
        (old / "hidden").mkdir(parents=True)
        (old / RUN_MARKER).write_text(json.dumps({"fingerprint": old.name, "config": {}}))
        (old / "hidden" / "chunk_00000.safetensors").write_bytes(b"x" * 1000)
        (old / "hidden" / "chunk_00000.json").write_text("{}")

        dry = run_snakemake(b, "-n", "extract_all")
        assert f"keep   {ord_.resolve()}" in dry.stderr and "live server" in dry.stderr
        assert f"keep   {old.resolve()}" in dry.stderr and "finished chunk" in dry.stderr
        run_snakemake(b, "-j1", str((brd / "state" / "stale_deleted.json").relative_to(b)))
        report = json.loads((brd / "state" / "stale_deleted.json").read_text())
        assert report["removed"] == [], report["removed"]
        assert ord_.exists() and old.exists()
        assert _pieces(a_dump) == in_flight  # A's pieces, mid-extraction, all still there
        assert proc.poll() is None, "A should still be held mid-chunk"

        # Once its server is gone and nothing holds it, the unfinished second run goes
        # (the old one still holds a finished chunk, so it stays).
        subprocess.run(
            [sys.executable, "-m", "hsextract.cli", "server", "stop", *other],
            cwd=b, check=True, capture_output=True,
        )  # fmt: skip
        run_snakemake(
            b, "-j1", "--forcerun", "delete_stale_states",
            str((brd / "state" / "stale_deleted.json").relative_to(b)),
        )  # fmt: skip
        assert not ord_.exists() and old.exists()
        gate.touch()  # A goes on from where it was held
        out, _ = proc.communicate(timeout=300)
    finally:
        gate.touch()
        stop_snakemake(proc)
        owner.stdin.close()
        owner.wait()
        left = wait_until_gone(tmp_path)  # B's server stops with its owner, A's with A
        kill_processes_under(tmp_path)
    assert not left, f"processes of this test left running: {left}"
    assert proc.returncode == 0, out[-4000:]
    assert [json.loads(x)["fault"] for x in fault_log.read_text().splitlines()] == ["wait"]
    assert verify(run_dir_of(a)).returncode == 0


def test_dump_space_stays_within_the_budget_with_two_jobs(demo_run, tmp_path, monkeypatch):
    """-j 2: the chunk jobs share dump.shm_budget_gb; sampled /dev/shm use never exceeds it.

    Long records (400-512 tokens) and a budget of three of the longest requests: the two
    jobs' windows (two in flight each, more while the other job holds no sending turn:
    client._Window) would take more, so they must share.  Held on an event, not on slow
    passes or on the client's speed: the first extend pass (one request, cut by the
    257-token chunk, so nothing completes) waits until the server holds the two requests
    besides the held one (running or queued), each reserved in the shared ledger (the
    jobs' leases) before it was sent.  With the server held no request can finish and no
    reservation can be given back, so that state is reached on every machine, and a fourth
    request would be refused by the budget alone; which job holds the three depends on
    which took its turn first, so that both reserved from the one ledger is checked over
    the whole run.  (Pieces of
    both jobs at one moment are not a deterministic event: a finished request's pieces are
    consumed by its client while the server is held.)
    """
    import random

    from hsextract.budget import LEDGER_DIR, dump_bytes_for_request

    per = dump_bytes_for_request(512, 64, 3, "float32", 257)
    budget = 3 * per
    rng = random.Random(5)
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for i in range(24):
            n = rng.randint(400, 512)
            rec = {"id": f"long-{i}", "input_ids": [rng.randrange(512) for _ in range(n)],
                   "loss_mask": [1] * n}  # fmt: skip
            f.write(json.dumps(rec) + "\n")
    model = demo_run["workdir"] / "results" / "demo" / "model"
    wd = make_workdir(
        tmp_path / "w",
        **{
            "demo.enabled": False,
            "inputs": [str(data)],
            "model.path": str(model),
            "n_chunks": 2,
            "dump.shm_budget_gb": budget / 2**30,
            "client.requests_in_flight": 2,
            # The held requests wait for the other job's start: no timeout of theirs may end
            # that wait on a slow machine (the default 600 s could).
            "client.request_timeout_s": 86400,
            # Passes filled across requests (SGLang's own scheduling).
            "server.batch_invariant": False,
        },
    )
    gate, log = tmp_path / "open", tmp_path / "f.jsonl"
    hold = {
        "log": str(log),
        "extend": [
            {"rid": "chunk_", "nth": [1], "do": "wait", "gate": str(gate), "timeout_s": 86400}
        ],  # released by the test, never by the clock
    }
    proc = start_snakemake(wd, "-j2", "extract_all", faults=hold)

    def held() -> list[dict]:
        return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []

    def ledger(ddir: Path) -> list[tuple[str, int]]:
        """(owner, bytes) of every reservation: ``<pid>-<start>-<seq>-<bytes>``."""
        out = []
        for name in os.listdir(ddir / LEDGER_DIR) if (ddir / LEDGER_DIR).is_dir() else []:
            parts = name.split("-")
            if len(parts) == 4 and parts[3].isdigit():
                out.append(("-".join(parts[:2]), int(parts[3])))
        return out

    at_hold, owners = None, set()
    try:
        monkeypatch.chdir(wd)
        ddir = dump_dir(read_config("config.yaml"))
        live = server.live_path(run_dir_of(wd) / "state")
        # The deadline runs from the hold, not from the test's start: the workflow's start
        # (demo, merge, server) is no part of what it bounds, and on a loaded box it took
        # most of the 300 s this once allowed from the start.
        peak, reserved_peak, deadline = 0, 0, None
        while proc.poll() is None:
            peak = max(peak, sum(_pieces(ddir).values()))
            taken = ledger(ddir)
            owners |= {o for o, _ in taken}
            reserved_peak = max(reserved_peak, sum(b for _, b in taken))
            if held() and not gate.exists():
                if deadline is None:
                    deadline = time.monotonic() + WORKFLOW_DEADLINE_S
                assert time.monotonic() < deadline, f"the budget never filled: ledger {taken}"
                state = server.read_json(live)
                info = requests.get(f"{state['url']}/get_server_info", timeout=10).json()
                pieces = _pieces(ddir)  # the held pass's piece: written by a writer thread
                ready = {k.split("/")[0] for k in pieces} == {held()[0]["rid"]}
                # All three at the server, whether admitted to its running batch or
                # still queued: which, depends on when each arrived (SGLang admits all
                # that fit before a pass), so only their sum is deterministic.
                # Each job's requests are reserved in its lease (one ledger entry a
                # job, budget.SharedByteBudget): the three at the server are in it.
                if ready and info["running"] + info["waiting"] == 3:
                    at_hold = {"ledger": taken, "pieces": pieces, "info": info}
                    gate.touch()
            time.sleep(0.002)
    finally:
        gate.touch()
        stop_snakemake(proc)
        kill_processes_under(tmp_path)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-4000:]
    assert [w["fault"] for w in held()] == ["wait"], held()
    assert at_hold is not None, "the run ended without the budget's three requests at once"
    assert len(owners) == 2, owners  # both jobs reserved from the one ledger
    # The jobs reserved from the one budget while nothing could be freed, and the three
    # reservations fit it (a fourth of >= 400 tokens would not).
    reserved = sum(b for _, b in at_hold["ledger"])
    assert reserved <= budget < reserved + dump_bytes_for_request(400, 64, 3, "float32", 257)
    assert per // 2 < peak <= budget, (peak, budget)
    assert reserved_peak <= budget, (reserved_peak, budget)
    for sc in (run_dir_of(wd) / "hidden").glob("chunk_*.json"):
        assert 0 < json.loads(sc.read_text())["shm_peak_bytes"] <= budget
