"""The readers' verdict dirs (chunkfile.VerifiedDir) that killed readers leave in the temp
dir: swept by the next one made, when provably ours and abandoned, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hsextract.chunkfile import VerifiedDir, shared_verdict_path

#: A reader process: makes a verdict dir (shared at argv[1], else private), says where,
#: and holds it until its stdin closes.
READER = """
import sys
from hsextract.chunkfile import VerifiedDir
d = VerifiedDir.shared(sys.argv[1]) if len(sys.argv) > 1 else VerifiedDir()
print(d.path, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def tmp(tmp_path, monkeypatch) -> Path:
    """A temp dir of the test's own, for this process and the readers it starts."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    monkeypatch.setenv("TMPDIR", str(d))
    return d


def start_reader(procs: list[subprocess.Popen], *shared: str) -> Path:
    proc = subprocess.Popen(
        [sys.executable, "-c", READER, *shared],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    procs.append(proc)
    path = proc.stdout.readline().strip()
    assert path, "the reader process died before making its verdict dir"
    return Path(path)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL: no finalizer runs."""
    proc.kill()
    proc.wait()


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def users(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("user-"))


def test_a_killed_readers_verdict_dirs_are_swept_and_nothing_else(tmp, tmp_path):
    """A reader SIGKILLed leaves its dir (private, or a node's shared one); the next
    VerifiedDir removes both, and leaves a live reader's dir, anything not named as ours,
    not a real dir, not mode 0700, or whose user runs on another host -- each holding the
    same dead user's record, so only the check under test keeps it."""
    procs: list[subprocess.Popen] = []
    try:
        live = VerifiedDir()
        dead_private = start_reader(procs)
        dead_shared = start_reader(procs, shared_verdict_path("0123456789abcdef"))
        for p in procs:
            kill(p)
        assert dead_private.parent == tmp and dead_shared.parent == tmp
        assert dead_private.is_dir() and dead_shared.is_dir()  # no finalizer ran
        (record,) = users(dead_private)
        pid, start = record.split("-")[1:3]

        def holding(d: Path, rec: str = record, mode: int = 0o700) -> Path:
            d.mkdir()
            (d / rec).touch()
            (d / ("0" * 32 + ".ok")).touch()
            d.chmod(mode)
            return d

        stays = [
            Path(live.path),
            holding(tmp / "hsextract-verified-mode0750", mode=0o750),
            holding(tmp / "hsextract-verified-longname1"),  # 9 characters: not mkdtemp's 8
            holding(tmp / f"hsextract-verified-{os.getuid() + 1}-0123456789abcdef"),
            holding(tmp / "other-hsextract-verified-abcdefgh"),
            holding(tmp / "hsextract-verified-elsewher", f"user-{pid}-{start}-elsewhere.example"),
            holding(tmp / "hsextract-verified-young123", "nothing"),  # no record, just made
        ]
        target = holding(tmp_path / "target")
        (tmp / "hsextract-verified-symlink1").symlink_to(target)
        (tmp / "hsextract-verified-aregfile").write_text("")
        stays += [tmp / "hsextract-verified-symlink1", target, tmp / "hsextract-verified-aregfile"]
        old = holding(tmp / "hsextract-verified-old12345", "nothing")  # no record, long idle
        an_hour_ago = time.time() - 3600
        os.utime(old, (an_hour_ago, an_hour_ago))

        fresh = VerifiedDir()
        assert not dead_private.exists() and not dead_shared.exists() and not old.exists()
        assert all(os.path.lexists(p) for p in stays)
        assert (target / record).exists() and users(Path(live.path))
        assert Path(fresh.path).is_dir() and users(Path(fresh.path)) == users(Path(live.path))
    finally:
        stop(procs)


def test_another_users_verdict_dir_is_never_swept(tmp, monkeypatch):
    """The same abandoned dir, seen by another uid: not ours, it stays."""
    procs: list[subprocess.Popen] = []
    try:
        dead = start_reader(procs)
        kill(procs[0])
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)
        VerifiedDir()
        assert dead.is_dir()
        monkeypatch.setattr(os, "getuid", lambda: real)
        VerifiedDir()
        assert not dead.exists()
    finally:
        stop(procs)


def test_a_shared_verdict_dir_lives_while_any_rank_that_used_it_runs(tmp):
    """A node's ranks share one dir: killed, its maker leaves it to the rank still reading
    through it, which joins it with its verdicts (a restarted job keeps them); the dir
    goes once no rank that used it runs, whether the last one exits or is killed."""
    procs: list[subprocess.Popen] = []
    try:
        path = shared_verdict_path("fedcba9876543210")
        maker = start_reader(procs, path)
        verdict = maker / ("0" * 32 + ".ok")
        verdict.touch()
        kill(procs[0])
        assert start_reader(procs, path) == maker  # joins the dead job's dir
        assert verdict.exists() and len(users(maker)) == 2
        VerifiedDir()
        assert maker.is_dir()  # its maker is dead, a rank using it is not
        kill(procs[1])
        VerifiedDir()
        assert not maker.exists()

        # Exits: the dir goes with the last rank using it, not with its maker.
        made = start_reader(procs, path)
        assert start_reader(procs, path) == made
        procs[2].stdin.close()
        assert procs[2].wait() == 0
        assert made.is_dir() and len(users(made)) == 1
        procs[3].stdin.close()
        assert procs[3].wait() == 0
        assert not made.exists()
    finally:
        stop(procs)
