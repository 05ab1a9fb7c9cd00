"""Security: loopback by default, an API key for anything else, a private dump dir, and
nothing deleted or overwritten outside ``output_root`` and the dump dir."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from faultkit import FAULT_CONFIG, FaultRun, fault_test
from fixtures_demo import make_workdir, snakemake_cmd

from hsextract.config import RUN_MARKER, check_semantics
from hsextract.errors import ConfigError

pytestmark = pytest.mark.faults

KEY = "hsx-test-key-5f1c9a"


def test_non_loopback_host_needs_allow_remote_and_an_api_key(tmp_path):
    base = {"host": "127.0.0.1", "allow_remote": False, "api_key": None}
    own = {"inputs": ["shards/*.jsonl"]}  # the rest of a valid config: one's own data
    check_semantics({"server": base, **own})  # loopback: fine
    with pytest.raises(ConfigError, match="allow_remote"):
        check_semantics({"server": {**base, "host": "0.0.0.0"}})
    with pytest.raises(ConfigError, match="api_key is required"):
        check_semantics({"server": {**base, "host": "10.1.2.3", "allow_remote": True}})
    check_semantics({"server": {"host": "10.1.2.3", "allow_remote": True, "api_key": KEY}, **own})

    # The same refusal from the workflow, before anything runs (`snakemake -n`).
    def plan(**server) -> subprocess.CompletedProcess:
        overrides = {**FAULT_CONFIG, **{f"server.{k}": v for k, v in server.items()}}
        workdir = make_workdir(tmp_path / f"w{len(list(tmp_path.iterdir()))}", **overrides)
        return subprocess.run(
            snakemake_cmd(workdir, "-n", "extract_all"), capture_output=True, text=True
        )

    refused = plan(host="0.0.0.0")
    assert refused.returncode != 0
    assert "server.host='0.0.0.0' is not loopback (it resolves to 0.0.0.0); set server." in (
        refused.stdout + refused.stderr
    )
    no_key = plan(host="0.0.0.0", allow_remote=True)
    assert no_key.returncode != 0 and "server.api_key is required" in no_key.stdout + no_key.stderr
    assert plan(host="0.0.0.0", allow_remote=True, api_key=KEY).returncode == 0
    assert plan().returncode == 0  # the default config is loopback


# Run inside the workdir with the key in the environment only: start the reference engine
# from the recorded launch spec, talk to it with and without the key, stop it.
_PROBE = """
import json, os, sys, requests
from pathlib import Path
from hsextract import server
from hsextract.client import Client, ExtractionError, model_geometry
from hsextract.config import read_config
cfg = read_config("config.yaml")
recorded = json.loads(Path(sys.argv[1]).read_text())
spec = server.ServerSpec(**recorded["spec"])
state = server.start(spec, owner=os.getpid())
out = {"argv": state["spec"]["argv"], "host": spec.host}
try:
    body = {"input_ids": [1, 2, 3], "rid": "probe-nokey", "sampling_params": {}}
    out["no_key"] = requests.post(state["url"] + "/generate", json=body).status_code
    out["health_no_key"] = requests.get(state["url"] + "/health").status_code
    client = Client(cfg, model_geometry(cfg), lambda: state)
    ids, hidden, aux = client.extract("probe-key", "r0", [5, 6, 7, 8])
    out["with_key"] = [ids.tolist(), list(hidden.shape)]
    cfg = read_config("config.yaml", {"server.api_key": "wrong"})
    try:
        Client(cfg, model_geometry(cfg), lambda: state).extract("probe-bad", "r1", [5, 6])
    except ExtractionError as exc:
        out["wrong_key"] = str(exc)
finally:
    server.stop(state)
print(json.dumps(out))
"""


@fault_test
def test_api_key_is_required_by_the_engine_and_sent_by_the_client(run: FaultRun):
    run.set_config(**{"server.api_key": KEY})
    # A new launch record with the key.  The plan, not the record, decides what is redone:
    # chunk_00000 is current and kept, chunk_00001 is extracted through the keyed server.
    (run.run_dir / "state" / "server.json").unlink()
    run.rerun_matches(first_chunk_kept=True)  # the whole workflow works: the client sends it
    side = json.loads((run.hidden / "chunk_00001.json").read_text())
    assert side["server"]["settings"]["api_key"] is True  # extracted by the keyed server
    # The key is never written down: not in the launch record, state, logs or config dump.
    for f in run.run_dir.rglob("*"):
        if f.is_file() and f.suffix in (".json", ".log", ".jsonl", ".txt", ".tsv"):
            assert KEY not in f.read_text(errors="replace"), f"API key leaked into {f}"
    env = {**run.env(None), "HSEXTRACT_API_KEY": KEY}
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE, str(run.run_dir / "state" / "server.json")],
        cwd=run.workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    out = json.loads(probe.stdout.strip().splitlines()[-1])
    assert out["host"] == "127.0.0.1" and "127.0.0.1" in out["argv"]  # loopback by default
    assert KEY not in json.dumps(out["argv"])  # the key travels in the environment
    assert out["no_key"] == 401 and out["health_no_key"] == 401
    assert out["with_key"] == [[5, 6, 7, 8], [4, 64]]
    assert "HTTP 401" in out["wrong_key"] and "server.api_key must match" in out["wrong_key"]
    run.assert_no_processes_left()


@fault_test
def test_dump_dir_symlink_or_foreign_owner_is_refused(run: FaultRun):
    shm = run.workdir / "shm"
    elsewhere = shm / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "sentinel").write_text("not yours")
    (shm / "evil").symlink_to(elsewhere)
    (run.run_dir / "state" / "server.json").unlink()  # relaunch with the new dump.dir
    run.set_config(**{"dump.dir": "shm/evil"})
    out = run.fail()
    run.assert_failed_cleanly(out, "dump dir shm/evil is a symlink; refusing")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["sentinel"]
    assert (elsewhere / "sentinel").read_text() == "not yours"
    theirs = shm / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 12345, 12345)
    run.set_config(**{"dump.dir": "shm/theirs"})
    out = run.fail()
    run.assert_failed_cleanly(out, "dump dir shm/theirs is owned by uid 12345", "refusing")
    assert list(theirs.iterdir()) == []
    run.set_config(**{"dump.dir": "shm/fresh"})
    run.rerun_matches(first_chunk_kept=True)  # a new dump dir relaunches; chunk_00000 kept
    side = json.loads((run.hidden / "chunk_00001.json").read_text())
    assert side["server"]["settings"]["dump_dir"].endswith("shm/fresh")


def _snapshot(root: Path, skip: list[Path]) -> dict[str, tuple]:
    """Every entry under root (not following links), except the skipped subtrees."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        dirnames[:] = [n for n in dirnames if d / n not in skip]
        for name in dirnames + filenames:
            p = d / name
            st = p.lstat()
            if p.is_symlink():
                out[str(p.relative_to(root))] = ("link", os.readlink(p), st.st_mtime_ns)
            elif p.is_file():
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
                out[str(p.relative_to(root))] = ("file", digest, st.st_mtime_ns, st.st_mode)
            else:
                out[str(p.relative_to(root))] = ("dir", st.st_mode)
    return out


@fault_test
def test_nothing_outside_output_root_and_dump_dir_is_touched(run: FaultRun):
    wd, results = run.workdir, run.workdir / "results"
    outside = wd / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "precious.bin").write_bytes(os.urandom(4096))
    (outside / "deep" / "notes.txt").write_text("keep me")
    # Bait inside output_root that leads outside: a symlinked dir, a stale run dir (marked,
    # so it is deleted) holding links out, an unmarked dir.
    (results / "linked_run").symlink_to(outside)
    stale = results / "0123456789ab"
    (stale / "hidden").mkdir(parents=True)
    (stale / RUN_MARKER).write_text("{}")
    (stale / "hidden" / "chunk_00000.safetensors").write_bytes(b"old")
    (stale / "hidden" / "to_precious").symlink_to(outside / "precious.bin")
    (stale / "to_outside").symlink_to(outside)
    (results / "unmarked").mkdir()
    (results / "unmarked" / "data.txt").write_text("not ours to delete")
    # Next to the dump dir: someone else's (unmarked) dir in the same parent.
    (wd / "shm" / "other").mkdir()
    (wd / "shm" / "other" / "piece.safetensors").write_bytes(b"theirs")
    skip = [results / run.run_dir.name, wd / "shm" / "dump", wd / ".snakemake", stale]
    before = _snapshot(wd, skip)
    # A new run of this config from its inputs: every stage, stale deletion included.
    shutil.rmtree(run.run_dir)
    # ... and a link posing as a stale temp chunk file (the writer removes such leftovers).
    run.hidden.mkdir(parents=True)
    (run.hidden / ".chunk_00001.safetensors.1.tmp").symlink_to(outside / "precious.bin")
    res = run.rerun_matches(first_chunk_kept=False)
    assert "rule delete_stale_states" in res.output
    assert not stale.exists()  # a marked run dir of another fingerprint: removed
    after = _snapshot(wd, skip)
    assert after == before, {k: (before.get(k), after.get(k)) for k in before.keys() ^ after.keys()}
    report = json.loads((run.run_dir / "state" / "stale_deleted.json").read_text())
    assert [Path(i["path"]).name for i in report["removed"]] == [stale.name]
