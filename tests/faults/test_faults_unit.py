"""The fault-injection knob itself: off by default, parsed strictly, counted exactly."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from hsextract import faults
from hsextract.chunks import ChunkWriter

pytestmark = pytest.mark.faults


def arm(monkeypatch, spec: dict | None) -> None:
    loaded = faults.load(json.dumps(spec)) if spec is not None else None
    monkeypatch.setattr(faults, "SPEC", loaded)
    monkeypatch.setattr(faults, "ACTIVE", loaded is not None)
    monkeypatch.setattr(faults, "_seen", {})


def test_off_unless_the_variable_is_set():
    assert faults.load(None) is None and faults.load("") is None
    code = "from hsextract import faults; print(faults.ACTIVE)"
    env = {k: v for k, v in os.environ.items() if k != faults.ENV}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    env[faults.ENV] = json.dumps({"generate": [{"do": "500"}]})
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert (off.stdout.strip(), on.stdout.strip()) == ("False", "True")


def test_a_malformed_spec_is_refused():
    with pytest.raises(faults.FaultSpecError, match="not JSON"):
        faults.load("{nope")
    with pytest.raises(faults.FaultSpecError, match="'do' must be one of"):
        faults.load(json.dumps({"generate": [{"do": "explode"}]}))
    with pytest.raises(faults.FaultSpecError, match="needs a 'gate' file"):
        faults.load(json.dumps({"extend": [{"do": "wait"}]}))


def test_wait_holds_the_pass_until_the_gate_file_exists(monkeypatch, tmp_path):
    """The event a test holds a run on: logged when the hold begins, released by a file."""
    log, gate = tmp_path / "log.jsonl", tmp_path / "go"
    arm(monkeypatch, {"log": str(log), "extend": [{"rid": "c-1", "nth": [1], "do": "wait",
                                                    "gate": str(gate)}]})  # fmt: skip
    held = threading.Thread(target=faults.after_extend, args=(["c-1-0"],))
    held.start()
    deadline = time.monotonic() + 30
    while not log.exists():
        assert time.monotonic() < deadline, "the wait never began"
        time.sleep(0.01)
    assert held.is_alive(), "the pass was not held"
    gate.touch()
    held.join(timeout=30)
    assert not held.is_alive(), "the open gate did not release the pass"
    assert [json.loads(x)["fault"] for x in log.read_text().splitlines()] == ["wait"]
    faults.after_extend(["c-1-0"])  # nth [1]: the second pass is not held


def test_once_file_disarms_later_processes(tmp_path):
    spec = {"once": str(tmp_path / "fired"), "generate": [{"do": "500"}]}
    assert faults.load(json.dumps(spec)) is not None
    (tmp_path / "fired").touch()
    assert faults.load(json.dumps(spec)) is None


def test_every_matching_rule_counts_every_occurrence(monkeypatch, tmp_path):
    arm(
        monkeypatch,
        {
            "log": str(tmp_path / "log.jsonl"),
            "generate": [
                {"rid": "c-1", "nth": [1], "do": "500"},
                {"rid": "c-1", "nth": [3], "do": "500"},
            ],
        },
    )
    hits = [faults.before_generate(f"c-1-{i}") is not None for i in range(4)]
    assert hits == [True, False, True, False]
    assert faults.before_generate("c-2-0") is None
    logged = [json.loads(x)["rid"] for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert logged == ["c-1-0", "c-1-2"]


def test_enospc_at_the_chunk_writer(monkeypatch, tmp_path):
    arm(monkeypatch, {"chunk_write": [{"chunk": "chunk_00001", "nth": [2], "do": "enospc"}]})
    out = tmp_path / "chunk_00001.safetensors"
    w = ChunkWriter(out, [2, 3], hidden_size=4, n_aux=1, dtype=torch.float32, metadata={})
    w.put(0, torch.arange(2), torch.ones(2), torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(OSError) as exc:
        w.put(1, torch.arange(3), torch.ones(3), torch.zeros(3, 4), torch.zeros(3, 4))
    assert exc.value.errno == errno.ENOSPC
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_writer_removes_what_a_killed_writer_left(tmp_path):
    out = tmp_path / "chunk_00000.safetensors"
    stale = tmp_path / ".chunk_00000.safetensors.999999.tmp"
    stale.write_bytes(b"x" * 100)
    target = tmp_path / "precious"
    target.write_text("keep")
    (tmp_path / ".chunk_00000.safetensors.888888.tmp").symlink_to(target)
    other = tmp_path / ".chunk_00001.safetensors.999999.tmp"  # another chunk's: not ours
    other.write_bytes(b"y")
    w = ChunkWriter(out, [1], hidden_size=2, n_aux=1, dtype=torch.float32, metadata={})
    assert sorted(w.removed_stale) == [
        ".chunk_00000.safetensors.888888.tmp",
        ".chunk_00000.safetensors.999999.tmp",
    ]
    w.abort()
    assert target.read_text() == "keep" and other.exists() and not stale.exists()
