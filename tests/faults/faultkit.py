"""Helpers and fixtures of the fault-injection suite (real Snakemake, real engine).

Every scenario compares against one uninterrupted ``snakemake -j1 extract_all`` of a small
embedded default (16 records, 2 chunks).  A scenario starts from a copy of that workdir
with chunk_00001, the manifest and Snakemake's metadata removed: the state of a run that
finished chunk_00000 and stopped (its server gone, as after a restart), so
``extract_all`` plans the chunk_00001 job and the manifest, and that job relaunches the
server from its record.  The faults hit chunk_00001; chunk_00000 must survive untouched.

Faults are armed through ``HSEXTRACT_FAULTS`` (see :mod:`hsextract.faults`) in the
environment of one Snakemake invocation only; the rerun runs without it.  Each workdir
has its own dump dir (``dump.dir: shm/dump``, relative to the workdir), so scenarios
cannot see each other's pieces.

Speed: a scenario is ~2-4 Snakemake invocations of 5-15 s, mostly process start-up
(torch imports, model load).  Scenarios are independent, so :func:`fault_test` plays them
in a small background pool (``HSEXTRACT_FAULT_JOBS``, default 2) as soon as the first one
is needed; each pytest test waits for its own scenario and re-raises its failure.  The
process checks look only at processes whose working directory is the scenario's own
(other people's tests may run on the same machine): see ``fixtures_demo.processes_under``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from fixtures_demo import make_workdir, processes_under, run_dir_of, snakemake_cmd, wait_until_gone

from hsextract.chunks import check_chunk, sha256_file

#: Small and quick, with short timeouts so transient faults cost seconds, not minutes.
FAULT_CONFIG = {
    "demo.n_records": 16,
    "n_chunks": 2,
    "dump.dir": "shm/dump",
    "client.request_timeout_s": 8,
    "client.piece_timeout_s": 2,
    "client.retries": 2,
    "client.backoff_s": 0.2,
    "server.health_timeout_s": 120,
}
FAULTS_ENV = "HSEXTRACT_FAULTS"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "fault_scenario(name): played in the background by fault_outcomes"
    )


@pytest.fixture(scope="session")
def fault_baseline(tmp_path_factory) -> dict:
    """One uninterrupted run of the suite's config: the sha256s every rerun must equal."""
    workdir = make_workdir(tmp_path_factory.mktemp("fault-baseline") / "w", **FAULT_CONFIG)
    (workdir / "shm").mkdir()
    env = {k: v for k, v in os.environ.items() if k != FAULTS_ENV}
    proc = subprocess.run(
        snakemake_cmd(workdir, "-j1", "extract_all"),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rd = run_dir_of(workdir)
    manifest = json.loads((rd / "manifest.json").read_text())
    return {
        "workdir": workdir,
        "run_dir": rd,
        "manifest": manifest,
        "shas": {c["path"]: c["sha256"] for c in manifest["chunks"]},
        "sizes": {c["path"]: (rd / c["path"]).stat().st_size for c in manifest["chunks"]},
    }


@dataclass
class Result:
    returncode: int
    output: str  # stdout + stderr: what the user saw on the terminal


@dataclass
class FaultRun:
    """A workdir ready to extract, plus the checks every fault scenario makes."""

    workdir: Path
    run_dir: Path
    baseline: dict
    tmp: Path
    first_stamp: tuple[str, int] | None = None

    @property
    def hidden(self) -> Path:
        return self.run_dir / "hidden"

    def log(self, name: str) -> str:
        path = self.run_dir / "logs" / name
        return path.read_text() if path.exists() else ""

    def set_config(self, **overrides) -> None:
        cfg = yaml.safe_load((self.workdir / "config.yaml").read_text())
        for key, value in overrides.items():
            node = cfg
            parts = key.split(".")
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = value
        (self.workdir / "config.yaml").write_text(yaml.safe_dump(cfg))

    def env(self, faults: dict | None) -> dict:
        env = {k: v for k, v in os.environ.items() if k != FAULTS_ENV}
        if faults is not None:
            env[FAULTS_ENV] = json.dumps(faults)
        return env

    def spec(self, **rules) -> dict:
        """A fault spec that logs every fault it fires to this scenario's fault log."""
        return {"log": str(self.tmp / "faults.jsonl"), **rules}

    def fault_log(self) -> list[dict]:
        path = self.tmp / "faults.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    def snakemake(self, *args: str, faults: dict | None = None, timeout: float = 300) -> Result:
        proc = subprocess.run(
            snakemake_cmd(self.workdir, *args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(faults),
        )
        return Result(proc.returncode, proc.stdout + proc.stderr)

    def popen(self, *args: str, faults: dict | None = None) -> subprocess.Popen:
        """Snakemake in its own session (so the test can kill its whole process group)."""
        return subprocess.Popen(
            snakemake_cmd(self.workdir, *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env(faults),
            start_new_session=True,
        )

    def extract_all(self, faults: dict | None = None) -> Result:
        return self.snakemake("-j1", "extract_all", faults=faults)

    def fail(self, faults: dict | None = None) -> str:
        """Run ``extract_all`` with the fault armed; it must fail; return what the user saw."""
        res = self.extract_all(faults)
        assert res.returncode != 0, f"the faulted run succeeded:\n{res.output[-4000:]}"
        return res.output

    def processes(self) -> dict[int, str]:
        """Whatever runs from this workdir: a workflow, an orphaned job, a server, a watchdog."""
        return processes_under(self.workdir)

    def assert_no_processes_left(self, timeout: float = 120) -> None:
        """Nothing of ours runs on: polled, since the watchdog needs a moment to act."""
        left = wait_until_gone(self.workdir, timeout)
        assert not left, f"processes left behind: {left}"

    def assert_chunks_sound(self, allow_tmp: bool = False) -> list[str]:
        """Every chunk file present is complete and correct; returns their names.

        Complete: it has its sidecar, whose sha256 is the file's.  Correct: it passes the
        structural check and equals the uninterrupted run's file byte for byte.
        """
        present = []
        files = sorted(self.hidden.glob("chunk_*.safetensors")) if self.hidden.exists() else []
        for f in files:
            rel = str(f.relative_to(self.run_dir))
            sidecar = f.with_suffix(".json")
            assert sidecar.exists(), f"{f} exists without its sidecar"
            sha = sha256_file(f)
            assert json.loads(sidecar.read_text())["sha256"] == sha, f"{f}: sidecar sha256 differs"
            assert sha == self.baseline["shas"][rel], f"{f} differs from the uninterrupted run"
            check_chunk(f)
            present.append(f.stem)
        if not allow_tmp and self.hidden.exists():
            tmp = sorted(p.name for p in self.hidden.iterdir() if p.name.startswith("."))
            assert not tmp, f"temporary chunk files left in {self.hidden}: {tmp}"
        return present

    def mtimes(self) -> dict[str, int]:
        return {f.name: f.stat().st_mtime_ns for f in self.hidden.glob("chunk_*.safetensors")}

    def first_chunk_stamp(self) -> tuple[str, int]:
        f = self.hidden / "chunk_00000.safetensors"
        return sha256_file(f), f.stat().st_mtime_ns

    def rerun_matches(self, first_chunk_kept: bool = True) -> Result:
        """`snakemake -j1 extract_all` without the fault completes and equals the baseline.

        The chunk finished before the fault (chunk_00000) is neither lost nor redone.
        """
        res = self.extract_all()
        assert res.returncode == 0, f"the rerun failed:\n{res.output[-6000:]}"
        manifest = json.loads((self.run_dir / "manifest.json").read_text())
        shas = {c["path"]: c["sha256"] for c in manifest["chunks"]}
        assert shas == self.baseline["shas"], "the rerun's chunks differ from an uninterrupted run"
        assert len(self.assert_chunks_sound()) == len(shas)
        self.assert_no_processes_left()
        if first_chunk_kept:
            assert self.first_chunk_stamp() == self.first_stamp, "chunk_00000 was rewritten"
        return res

    def assert_failed_cleanly(self, output: str, *needles: str) -> list[str]:
        """The common checks after a faulted run: message, chunk files, processes."""
        for needle in needles:
            assert needle in output, f"{needle!r} not in what the user saw:\n{output[-5000:]}"
        present = self.assert_chunks_sound()
        self.assert_no_processes_left()
        return present


def prepare(baseline: dict, dst: Path) -> FaultRun:
    """A copy of the baseline workdir, poised to extract chunk_00001 (see the module doc)."""
    src = baseline["workdir"]
    shutil.copytree(src, dst, symlinks=True)
    # Snakemake's metadata holds absolute paths of the original dir; start clean.
    shutil.rmtree(dst / ".snakemake", ignore_errors=True)
    rd = dst / baseline["run_dir"].relative_to(src)
    for f in (rd / "hidden").glob("chunk_00001.*"):
        f.unlink()
    (rd / "manifest.json").unlink()
    for f in (rd / "state").glob("server.*.live.json*"):
        f.unlink()
    for f in (rd / "logs").glob("extract_chunk_*.log"):
        f.unlink()
    run = FaultRun(workdir=dst, run_dir=rd, baseline=baseline, tmp=dst.parent)
    run.first_stamp = run.first_chunk_stamp()
    return run


# -- the background pool ---------------------------------------------------------------

SCENARIOS: dict[str, Callable[[FaultRun], None]] = {}


def fault_test(fn: Callable[[FaultRun], None]) -> Callable:
    """Make ``def test_x(run: FaultRun)`` a pytest test whose body plays in the pool."""
    name = fn.__name__
    SCENARIOS[name] = fn

    @pytest.mark.faults
    @pytest.mark.fault_scenario(name)
    def test(fault_outcomes) -> None:
        fault_outcomes[name].result()

    # Not functools.wraps: pytest would read the scenario's signature through __wrapped__.
    test.__name__ = test.__qualname__ = name
    test.__module__, test.__doc__ = fn.__module__, fn.__doc__
    return test


@pytest.fixture(scope="module")
def fault_outcomes(request, fault_baseline, tmp_path_factory):
    """Start this file's selected scenarios in the pool; a test waits for its own future.

    Per file, not per session: under pytest-xdist (the README's test command) every worker
    collects the whole suite into ``session.items`` but runs only the files it is handed,
    so a session-wide pool played every scenario of the suite once on each worker that ran
    any fault file (CI, 2026-12-06: the faults' tests took up to 10x their time)."""
    names = []
    for item in request.session.items:
        if item.path != request.path:
            continue
        marker = item.get_closest_marker("fault_scenario")
        if marker and marker.args[0] not in names:
            names.append(marker.args[0])
    pool = ThreadPoolExecutor(max_workers=int(os.environ.get("HSEXTRACT_FAULT_JOBS", "2")))

    def play(name: str) -> None:
        run = prepare(fault_baseline, tmp_path_factory.mktemp(name) / "w")
        SCENARIOS[name](run)

    futures: dict[str, Future] = {name: pool.submit(play, name) for name in names}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)
    base = FaultRun(tmp_path_factory.getbasetemp(), Path(), fault_baseline, Path())
    base.assert_no_processes_left()  # nothing started under this session's temp dirs
