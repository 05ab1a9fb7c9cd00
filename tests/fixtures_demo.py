"""Fixtures that run the real workflow (Snakemake, reference engine) on the embedded default."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def snakemake_cmd(workdir: Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "snakemake",
        "-s", str(REPO / "Snakefile"),
        "--directory", str(workdir),
        *args,
    ]  # fmt: skip


def default_sigint() -> None:
    """``preexec_fn`` for a child a test sends Ctrl-C: SIGINT at its default, as in a
    terminal's foreground command, however this suite was started.  A suite started with
    SIGINT ignored (``(pytest &)`` from a non-interactive shell) passes SIG_IGN on through
    fork and exec, and Python then installs no KeyboardInterrupt handler: the child would
    never see the Ctrl-C the test is about."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_snakemake(workdir: Path, *args: str, faults: dict | None = None) -> subprocess.Popen:
    """The workflow in the background, in its own process group (so a test can signal all
    of it, Ctrl-C included: :func:`default_sigint`), output merged into ``stdout``;
    ``faults`` goes to ``HSEXTRACT_FAULTS``."""
    env = {**os.environ, "HSEXTRACT_FAULTS": json.dumps(faults)} if faults else None
    return subprocess.Popen(
        snakemake_cmd(workdir, *args),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True, preexec_fn=default_sigint,
    )  # fmt: skip


def stop_snakemake(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stop a workflow from :func:`start_snakemake` and everything it started (its process
    group: a test that fails mid-run must not leave a server running); SIGKILL after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_snakemake(workdir: Path, *args: str, check: bool = True, timeout: float = 900):
    proc = subprocess.run(
        snakemake_cmd(workdir, *args), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed ({proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def make_workdir(path: Path, *, built_model: bool = True, **overrides) -> Path:
    """A workdir with the repo's config.yaml (plus overrides) and its own results/.

    The audit stage is off unless ``audit.records`` is given: it costs each full run a few
    seconds of CPU, and only the demo fixture and tests/test_audit.py are about it.

    ``built_model``: the demo's model is put in place as the ``demo_model`` job leaves it
    (:func:`_put_demo_model`), so a test's first run does not build it again: ~6 s of
    importing transformers a run, ~10 % of the suite on CI's two cores.  Tests about the
    demo stage itself, or about what a refused or dry run leaves on disk, pass False."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    overrides.setdefault("audit.records", 0)
    for key, value in overrides.items():
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    if built_model:
        _put_demo_model(path)
    return path


#: Where this test process keeps the demo models it built, by their settings' digest
#: (set by the session fixture below; None outside pytest: nothing is put in place).
_MODEL_CACHE: Path | None = None


@pytest.fixture(scope="session", autouse=True)
def _demo_model_cache(tmp_path_factory):
    global _MODEL_CACHE
    _MODEL_CACHE = tmp_path_factory.mktemp("demo-models")
    yield
    _MODEL_CACHE = None


def _put_demo_model(workdir: Path) -> None:
    """Copy the demo's model into ``workdir``'s model.path, built once per test process
    with the very function and settings file the ``demo_model`` job uses: same seed, same
    bytes, and a settings file named for the same digest, so Snakemake finds the job's
    outputs in place and plans nothing for it.  A config whose demo is off, whose model
    path is its own, or that does not load (a test of a refusal) is left as it is."""
    if _MODEL_CACHE is None:
        return
    from hsextract.config import read_config, settings_digest
    from hsextract.stages import stage_settings
    from hsextract.steps import write_settings

    try:
        cfg = read_config(workdir / "config.yaml")
    except Exception:
        return
    model = Path(cfg.model.path)
    if not cfg.demo.enabled or model.is_absolute() or (workdir / model).exists():
        return
    settings = stage_settings(cfg)["demo_model"]
    digest = settings_digest(settings)
    cached = _MODEL_CACHE / digest
    if not cached.is_dir():
        import torch

        from hsextract.demo import build_demo_model

        staging = _MODEL_CACHE / f".{digest}.{os.getpid()}"
        with torch.random.fork_rng():  # the build seeds torch; this process's RNG is not its
            build_demo_model(staging, settings["demo"])
        write_settings(staging / f"settings-{digest}.json", {"demo": settings["demo"]})
        os.replace(staging, cached)
    shutil.copytree(cached, workdir / model)


def own_config(demo_run: dict, root: Path, **extra) -> dict:
    """A user's config (demo off) over the finished demo's shards and model, absolute
    paths, its runs under ``root/out``: what a user's own data looks like to the workflow."""
    wd = demo_run["workdir"]
    cfg = {
        "inputs": [str(wd / "results" / "demo" / "data" / "shard_*.jsonl")],
        "output_root": str(root / "out"),
        "max_seq_len": 300,
        "seed": 0,
        "engine": "reference",
        "model": {"path": str(wd / "results" / "demo" / "model"), "dtype": "float32"},
        "server": {"chunked_prefill_size": 64},
        "audit": {"records": 0},  # as make_workdir: on only where it is the subject
    }
    cfg.update(extra)
    return cfg


def run_dir_of(workdir: Path) -> Path:
    out = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "run-dir", "--configfile", "config.yaml"],
        cwd=workdir, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return workdir / out.stdout.strip()


def planned_jobs(dry_run_stdout: str) -> dict[str, int]:
    """Parse Snakemake's 'Job stats' table of a dry run."""
    counts: dict[str, int] = {}
    lines = dry_run_stdout.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("Job stats"))
    except StopIteration:
        return counts
    for line in lines[start + 3 :]:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            break
        if parts[0] != "total":
            counts[parts[0]] = int(parts[1])
    return counts


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> dict:
    """One full `snakemake -j1 extract_all` of the embedded default, shared by the tests."""
    # The audit on, as the shipped config has it (tests/test_audit.py reads its outcome).
    workdir = make_workdir(tmp_path_factory.mktemp("demo"), **{"audit.records": 16})
    proc = run_snakemake(workdir, "-j1", "extract_all")
    rd = run_dir_of(workdir)
    manifest = json.loads((rd / "manifest.json").read_text())
    return {
        "workdir": workdir,
        "run_dir": rd,
        "manifest": manifest,
        "stdout": proc.stdout + proc.stderr,
    }


@pytest.fixture
def demo_copy(demo_run, tmp_path) -> dict:
    """A private copy of the finished demo (mutating tests must not disturb the others)."""
    src = demo_run["workdir"]
    dst = tmp_path / "copy"
    shutil.copytree(src, dst, symlinks=True)
    # Snakemake's metadata records absolute paths of the original dir; the copy starts clean.
    shutil.rmtree(dst / ".snakemake", ignore_errors=True)
    rd = dst / demo_run["run_dir"].relative_to(src)
    # The audit off (a rerun that changes the manifest would audit again): tests about it
    # turn it back on (tests/test_audit.py).
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    cfg["audit"]["records"] = 0
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg))
    return {"workdir": dst, "run_dir": rd, "manifest": demo_run["manifest"]}


def processes_under(root: Path) -> dict[int, str]:
    """Every process but this one whose working directory is under ``root``, with its
    command line: a workflow run there (``--directory``), its jobs, and the servers and
    watchdogs they started (they inherit it).  Other test runs share the machine: a test
    asserts on, and cleans up, only what runs under its own directory."""
    root_s = str(Path(root).resolve())
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone, or not ours to read
        if cwd == root_s or cwd.startswith(root_s + "/"):
            found[int(entry.name)] = cmd
    return found


def engine_processes(root: Path) -> list[int]:
    """PIDs of the hsextract reference engines and watchdogs started under ``root``."""
    return [
        pid
        for pid, cmd in processes_under(root).items()
        if "hsextract.engine" in cmd or "hsextract.watchdog" in cmd
    ]


def poll(predicate, what: str, timeout: float = 300):
    """The first truthy value of ``predicate``, polled until a generous deadline: a test
    waits on the event, never on the clock."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.1)
    return value


def wait_until_gone(root: Path, timeout: float = 60) -> dict[int, str]:
    """Poll until nothing runs under ``root`` (a watchdog needs a moment to act); what is
    left at the deadline."""
    deadline = time.monotonic() + timeout
    left = processes_under(root)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = processes_under(root)
    return left


def kill_processes_under(root: Path) -> None:
    """SIGKILL what still runs under ``root``, by pid: a test's ``finally``, so a failed
    assert never leaves its server (or an orphaned job) running for the next test."""
    for pid in processes_under(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
