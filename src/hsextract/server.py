"""Server lifetime: launch, health, ensure-alive, stop -- for both engines.

The server outlives the Snakemake job that launched it (new session, detached), so chunk
jobs can share it; ``ensure()`` lets any chunk job, even one rerun days later, find it alive
or relaunch it from the recorded spec under a file lock.  A watchdog process stops it when
the workflow that owns it dies (SIGKILL, Ctrl-C), so a crash never leaves 8 GPUs held.

Files (per run dir):
- ``state/server.json``: what ``launch_server`` recorded (the Snakemake output; never
  rewritten afterwards, so it never invalidates finished chunks);
- ``state/server.<host>.live.json``: the process serving now on this host (pid, url,
  watchdog), rewritten by every relaunch.  ``launch_server`` does not wait for the
  server to load: the first chunk job to see it healthy adds ``healthy_at``,
  ``model_info`` and ``server_version`` here (:func:`wait_healthy`); one that failed to
  start gets ``failed`` (why, with the log's last lines) instead.  Per host, so chunk
  jobs spread over nodes each own their node's server; inside a SLURM job per job,
  ``server.<host>.job<N>.live.json`` (:func:`host_key`), whose server lives as long as
  that allocation.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hsextract.commands import hsextract_command
from hsextract.config_types import Config
from hsextract.dp import dp_size, expected_workers, lost_workers
from hsextract.errors import HsextractError
from hsextract.procs import owner_alive, pid_alive, start_time

OWNER_ENV = "HSEXTRACT_OWNER_PID"
#: The owner's start time (clock ticks since boot, /proc/<pid>/stat): with the pid, it names
#: the workflow process exactly, so a pid reused after the workflow died is not taken for it.
OWNER_START_ENV = "HSEXTRACT_OWNER_START"
#: Where that pid means something (see :func:`host_key`): a SLURM job's environment
#: carries the submitting workflow's, a pid of another host or allocation.
OWNER_SCOPE_ENV = "HSEXTRACT_OWNER_SCOPE"
API_KEY_ENV = "HSEXTRACT_API_KEY"
API_KEY_PLACEHOLDER = "${HSEXTRACT_API_KEY}"


class ServerError(HsextractError):
    """The server could not be started, or died, or is not ours."""


@dataclass
class ServerSpec:
    """Everything needed to (re)start the server; recorded in server.json and live.json.

    ``settings`` are the config values the server runs with (``config.launch_settings``):
    a live server whose settings digest differs from the config's is replaced, so a changed
    chunked-prefill size or SGLang flag takes effect at the next launch.
    """

    engine: str
    argv: list[str]
    env: dict[str, str]
    host: str
    port: int
    log_path: str
    fingerprint: str
    dump_dir: str
    health_timeout_s: float = 900.0
    api_key_env: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def settings_digest(self) -> str:
        from hsextract.config import settings_digest

        return settings_digest(self.settings)


#: SGLang (0.5.14, seen on the H200) derives its gRPC port as port + 10000 and refuses to
#: start if that passes 65535; an automatic port stays below this for the sglang engine.
SGLANG_MAX_PORT = 65535 - 10000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; else IANA's)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def free_port(host: str = "127.0.0.1", max_port: int = 65535) -> int:
    """A port free on ``host`` now, at most ``max_port``, outside the ephemeral range.

    Why outside: the port is free when we look but bound by the server only once its
    model is loaded.  Meanwhile every outgoing connection (SGLang's data-parallel workers
    open many, to each other and the controller) takes a local port from the ephemeral
    range, and one took ours on the H200: dp 2 exited with "[Errno 98] address already
    in use" after loading.  A port below the range is never handed out that way.
    """
    import random

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    eph_lo, eph_hi = ephemeral_ports()
    ranges = [(20000, min(max_port, eph_lo - 1)), (eph_hi + 1, max_port)]
    ranges = [(a, b) for a, b in ranges if a <= b] or [(20000, max_port)]
    for _ in range(200):
        a, b = random.choice(ranges)
        port = random.randint(a, b)
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise ServerError(f"no free port at most {max_port} on {host}; set server.port")


def refuse_taken_port(host: str, port: int) -> None:
    """A fixed ``server.port`` someone else listens on is refused before a start.

    Otherwise the server started, failed to bind, and meanwhile the other program answered
    our health check: the run failed later in a traceback (an HTTP 404 from
    ``/get_model_info``) that never named the port.  Bound as the engines bind
    (SO_REUSEADDR), so a port our stopped server left in TIME_WAIT counts as free.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), port))
        except OSError as exc:
            raise ServerError(
                f"server.port {port} on {host} is taken by a program that is not this run's "
                f"server ({exc.strerror or exc}): set server.port to another free port, or "
                "to 0 to pick a free one at each start"
            ) from None


def host_key() -> str:
    """This host, and inside a SLURM job that job: each allocation runs its own server.

    Its GPUs are the allocation's and SLURM kills it with the allocation, so a second job
    on the same node must not take it over (state and log file names use this key).
    """
    job = os.environ.get("SLURM_JOB_ID")
    return f"{socket.gethostname()}.job{job}" if job else socket.gethostname()


def inherited_owner() -> int | None:
    """The workflow process owning servers started here, if it lives in this scope.

    A SLURM job inherits the submitting workflow's variables (``--export=ALL``): its pid
    is another host's, or on one host another allocation's, so the job's own workflow
    process becomes the owner (rules/common.smk) and its server dies with the job.
    """
    if os.environ.get(OWNER_SCOPE_ENV, host_key()) != host_key():
        return None
    value = os.environ.get(OWNER_ENV)
    if not value or not owner_alive(value, os.environ.get(OWNER_START_ENV)):
        return None
    return int(value)


def owner_pid() -> int:
    """The process whose end stops the servers started now; refuses when there is none.

    In a workflow that is the Snakemake process (rules/common.smk sets $HSEXTRACT_OWNER_PID
    for its jobs).  A chunk job outlives a Snakemake killed alone (SIGKILL, OOM): it
    must not relaunch the server then, since nothing would stop it -- a fallback to its
    parent made init the owner (issue 20, item 7) and held the GPUs forever.  Outside a
    workflow (``hsextract server start``) the caller's parent, the shell, owns it.
    """
    value = os.environ.get(OWNER_ENV)
    if value and os.environ.get(OWNER_SCOPE_ENV, host_key()) == host_key():
        if inherited_owner() is None:
            raise ServerError(
                f"the workflow that owns this run (pid {value}, ${OWNER_ENV}) is gone: not "
                "starting a server nothing would stop. This job outlived its Snakemake "
                "(killed?); run the workflow again (finished chunks are kept)"
            )
        return int(value)
    parent = os.getppid()
    if parent == 1:
        raise ServerError(
            "no process would own the server (this one's parent is init): start it from a "
            f"shell or a workflow, or set ${OWNER_ENV} to the pid whose end should stop it"
        )
    return parent


def health(url: str, timeout: float = 5.0, api_key: str | None = None) -> bool:
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return requests.get(f"{url}/health", timeout=timeout, headers=headers).status_code == 200
    except requests.RequestException:
        return False


def server_version(url: str, api_key: str | None = None, timeout: float = 30.0) -> str | None:
    """The engine's own version (SGLang's /get_server_info ``version``), if it says."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = requests.get(f"{url}/get_server_info", timeout=timeout, headers=headers)
        return str(resp.json().get("version")) if resp.status_code == 200 else None
    except (requests.RequestException, ValueError, AttributeError):
        return None


def model_info(url: str, api_key: str | None = None, timeout: float = 30.0) -> dict:
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = requests.get(f"{url}/get_model_info", timeout=timeout, headers=headers)
    resp.raise_for_status()
    return resp.json()


def log_tail(path: str | Path, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


#: The servers this process started, by pid: their exit code is known here (a server
#: started by another process, the launch_server job, is only seen alive or gone).
_children: dict[int, subprocess.Popen] = {}


def start(
    spec: ServerSpec, *, owner: int | None = None, wait: bool = True, detached: bool = False
) -> dict:
    """Start the server detached and its watchdog; return its state.

    With ``wait`` (the default) return once it is healthy (:func:`wait_healthy`); without,
    at once: its state then has no ``healthy_at``, and whoever needs the server waits for
    it (``ensure()``: the chunk jobs, while the model loads).  ``owner`` (default
    :func:`owner_pid`) is the process whose end stops it, through the watchdog; none that
    runs now, no server.  ``detached`` (``hsextract server start`` outside a workflow): no
    owner and no watchdog, it runs until ``hsextract server stop`` -- the shell that ran
    the command may be gone the next moment (a script, ``ssh host cmd``), and a server
    stopped then is of no use to whoever started it.
    """
    owner_start: str | None = None
    if not detached:
        owner = owner if owner is not None else owner_pid()
        owner_start = start_time(owner)
        if owner_start is None or not pid_alive(owner):
            raise ServerError(f"the server's owner (pid {owner}) is gone: not starting it")
    Path(spec.log_path).parent.mkdir(parents=True, exist_ok=True)
    prepare_dump_dir(Path(spec.dump_dir), owner=spec.extra.get("run_dir"))
    env = {**os.environ, **spec.env}
    if spec.api_key_env and spec.api_key_env not in env:
        raise ServerError(f"server needs the API key in ${spec.api_key_env}, which is unset")
    argv = [env.get(API_KEY_ENV, "") if a == API_KEY_PLACEHOLDER else a for a in spec.argv]
    with open(spec.log_path, "ab") as logf:
        logf.write(f"\n==== {time.strftime('%F %T')} start: {' '.join(spec.argv)}\n".encode())
        logf.flush()
        # A new session: Ctrl-C in the terminal reaches Snakemake, not the server; the
        # watchdog, not the terminal, decides when the server goes away.
        proc = subprocess.Popen(
            argv, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
        )
    _children[proc.pid] = proc
    watchdog = None
    if not detached:
        assert owner is not None and owner_start is not None
        watchdog = subprocess.Popen(
            [sys.executable, "-m", "hsextract.watchdog", str(owner), str(proc.pid), owner_start],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(spec.log_path, "ab"),  # noqa: SIM115 - inherited by the child
            start_new_session=True,
        )
    state = {
        "pid": proc.pid,
        "pgid": proc.pid,
        "watchdog_pid": watchdog.pid if watchdog else None,
        "owner_pid": None if detached else owner,
        "owner_start": owner_start,
        "url": spec.url,
        "host": socket.gethostname(),
        "started_at": time.time(),
        "spec": asdict(spec),
    }
    return wait_healthy(state) if wait else state


class _Superseded(Exception):
    """The live file names another server than the one waited for: look again."""


def _same_server(a: dict | None, b: dict | None) -> bool:
    if not a or not b:
        return False
    return (a.get("pid"), a.get("started_at")) == (b.get("pid"), b.get("started_at"))


def _exited(state: dict) -> str | None:
    """How the server exited, if it did (its exit code when this process started it)."""
    proc = _children.get(int(state["pid"]))
    if proc is not None:
        code = proc.poll()
        return None if code is None else f"exited with code {code}"
    return None if pid_alive(state["pid"]) else f"exited (pid {state['pid']} is gone)"


def wait_healthy(state: dict, *, live: Path | None = None, poll_s: float = 0.1) -> dict:
    """Wait until the server of ``state`` answers /health; return its state, healthy.

    The one wait for a starting server, in whichever process waits: the one that started
    it, or a chunk job that found it starting (``ensure()``).  It waits until
    ``started_at + health_timeout_s``.  Healthy: ``healthy_at``, ``model_info`` and
    ``server_version`` are added.  Dead or timed out: it is stopped and :class:`ServerError`
    says why, with the log's last lines.  With ``live`` (the live state file), both are
    recorded there under its lock, once, by the first to see them, and a waiter returns
    (or fails with the recorded message) as soon as another has.
    """
    spec = ServerSpec(**state["spec"])
    deadline = float(state["started_at"]) + spec.health_timeout_s
    api_key = _api_key_for(state["spec"])  # the key the client will send
    while True:
        if live is not None:
            current = read_json(live)
            if not _same_server(current, state):
                raise _Superseded
            assert current is not None
            if current.get("failed"):
                raise ServerError(current["failed"])
            if current.get("healthy_at"):
                return current
        exited = _exited(state)
        if exited:
            _fail(
                state,
                live,
                f"{spec.engine} server {exited} before becoming healthy; last lines of "
                f"{spec.log_path}:\n{log_tail(spec.log_path)}",
            )
        if health(spec.url, timeout=2.0, api_key=api_key):
            break
        if time.time() > deadline:
            _fail(
                state,
                live,
                f"{spec.engine} server not healthy after {spec.health_timeout_s:.0f}s "
                f"(server.health_timeout_s); last lines of {spec.log_path}:\n"
                f"{log_tail(spec.log_path)}",
            )
        time.sleep(poll_s)
    try:
        info = model_info(spec.url, api_key)
        if not isinstance(info, dict):
            raise ValueError(f"not a JSON object: {info!r:.80}")
    except (OSError, ValueError) as exc:  # requests' errors are OSErrors
        _fail(
            state,
            live,
            f"{spec.url} answered /health but not /get_model_info ({exc}): port {spec.port} "
            "is served by a program that is not this run's server; set server.port to "
            "another free port, or to 0 to pick a free one at each start",
        )
    healthy = {
        **state,
        "healthy_at": time.time(),
        "model_info": info,
        "server_version": server_version(spec.url, api_key),
    }
    if live is None:
        return healthy
    from filelock import FileLock

    with FileLock(str(live) + ".lock"):
        current = read_json(live)
        if not _same_server(current, state):
            return healthy  # replaced meanwhile: the caller finds out at its next request
        assert current is not None
        if current.get("healthy_at") or current.get("failed"):
            if current.get("failed"):
                raise ServerError(current["failed"])
            return current  # another waiter recorded it first
        write_json(live, healthy)
    return healthy


def _fail(state: dict, live: Path | None, message: str) -> None:
    """Stop a server that failed to start, record why in the live file, raise."""
    stop(state)
    if live is not None:
        from filelock import FileLock

        with FileLock(str(live) + ".lock"):
            current = read_json(live)
            if _same_server(current, state):
                assert current is not None
                if current.get("failed"):
                    message = current["failed"]  # the first waiter's words, for everyone
                else:
                    write_json(live, {**current, "failed": message, "failed_at": time.time()})
    raise ServerError(message)


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_process_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the group, wait, then SIGKILL: SGLang's TP workers are in the same group."""
    if not _signal_group(pgid, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return
        time.sleep(0.1)
    _signal_group(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Members may be zombies awaiting their parent's wait(); reap what is ours.
    try:
        while os.waitpid(-pgid, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop(state: dict) -> None:
    pgid = int(state.get("pgid") or state.get("pid") or 0)
    if pgid > 0:
        stop_process_group(pgid)
    wd = state.get("watchdog_pid")
    if wd and pid_alive(wd):
        try:
            os.kill(int(wd), signal.SIGTERM)
        except ProcessLookupError:
            pass


def live_path(state_dir: Path) -> Path:
    return Path(state_dir) / f"server.{host_key()}.live.json"


def forget_finished_jobs(state_dir: Path) -> list[str]:
    """Remove the live files of SLURM jobs that are over (``server.<host>.job<N>``).

    SLURM kills a job's server with the job, and nothing of the job is left to remove its
    live file, which stale deletion would read as a server in use forever.  A job still
    listed by ``squeue`` keeps its file; without ``squeue`` nothing is removed.
    """
    import re
    import shutil

    files = {}
    # The .lock next to each live file too: one per allocation, 6,400 on a 64-node run.
    for path in Path(state_dir).glob("server.*.job*.live.json*"):
        m = re.fullmatch(r"server\..+\.job(\d+)\.live\.json(\.lock)?", path.name)
        if m:
            files[path] = m.group(1)
    if not files or shutil.which("squeue") is None:
        return []
    jobs = ",".join(sorted(set(files.values())))
    # squeue's default states are the unfinished ones; an id it no longer knows is over.
    proc = subprocess.run(["squeue", "-h", "-j", jobs, "-o", "%i"], capture_output=True, text=True)
    if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
        return []  # slurmctld unreachable: keep them
    running = set(proc.stdout.split())
    gone = []
    for path, job in files.items():
        if job not in running:
            path.unlink(missing_ok=True)
            gone.append(path.name)
    return gone


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # pid and thread: two threads of one process (servers started at once) write the same
    # marker, and a shared temporary name makes one rename fail.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def _api_key_for(spec: dict) -> str | None:
    return os.environ.get(spec.get("api_key_env") or API_KEY_ENV)


def is_serving(
    state: dict | None, spec: ServerSpec, *, probes: int = 1, interval_s: float = 0.0
) -> bool:
    """Our process, alive, serving this run with these settings, and healthy.

    A server whose process is alive gets ``probes`` health checks ``interval_s`` apart
    before it counts as unhealthy: one slow answer from a busy 8-GPU server must not make
    a chunk job replace it under every other job.
    """
    if not state or state.get("failed") or not pid_alive(state.get("pid")):
        return False
    if lost_workers(state):
        return False
    if not _same_settings(state, spec):
        return False
    live = state.get("spec", {})
    for attempt in range(max(1, probes)):
        if attempt:
            time.sleep(interval_s)
            if not pid_alive(state.get("pid")):
                return False
        if health(state["url"], timeout=10.0, api_key=_api_key_for(live)):
            return True
    return False


def _same_settings(state: dict, spec: ServerSpec) -> bool:
    live = state.get("spec", {})
    return (
        live.get("fingerprint") == spec.fingerprint
        and ServerSpec(**live).settings_digest == spec.settings_digest
    )


def starting(state: dict | None, spec: ServerSpec) -> bool:
    """A server of this run with ``spec``'s settings, alive, that has not yet answered
    /health and has not failed: it is loading its model, and is waited for, not replaced."""
    if not state or state.get("healthy_at") or state.get("failed"):
        return False
    return pid_alive(state.get("pid")) and _same_settings(state, spec)


def _of_this_owner(state: dict) -> bool:
    """Started under the workflow running now (its owner, pid and start time)."""
    try:
        owner = owner_pid()
    except ServerError:
        return False  # no owner: the start path says so
    return state.get("owner_pid") == owner and str(state.get("owner_start")) == str(
        start_time(owner)
    )


def _start_failed_here(state: dict | None, spec: ServerSpec) -> bool:
    """A start of this run's server under the workflow running now that failed, or whose
    process is gone without ever answering /health: it is not retried by every chunk job
    (a new workflow run, another owner, starts afresh)."""
    if not state or state.get("healthy_at") or not _same_settings(state, spec):
        return False
    if not state.get("failed") and pid_alive(state.get("pid")):
        return False  # still starting
    return _of_this_owner(state)


def ensure(
    spec: ServerSpec,
    state_dir: Path,
    *,
    gate=None,
    probes: int = 1,
    interval_s: float = 0.0,
    wait: bool = True,
    detached: bool = False,
) -> dict:
    """Live state of a healthy server for this run started with ``spec``'s settings.

    If this host's live server is gone, unhealthy after ``probes`` checks, or runs other
    settings (the config changed since it started), it is replaced, under a file lock so
    that concurrent chunk jobs start one server between them.  ``gate`` (a no-argument
    callable) runs before a start: for SGLang it re-checks that the GPUs are clean, since
    whatever killed the server may still hold them.

    A server still starting (:func:`starting`: ``launch_server`` does not wait for it) is
    waited for (:func:`wait_healthy`, outside the lock, so every chunk job waits at once),
    until ``started_at + health_timeout_s``.  One that failed to start under this workflow
    raises its recorded message at once.  ``wait=False`` returns as soon as a server is
    started or found starting (``launch_server``).  ``detached``: a server started here
    has no owner (:func:`start`); one found alive keeps the lifetime it has.
    """
    from filelock import FileLock

    live = live_path(state_dir)
    live.parent.mkdir(parents=True, exist_ok=True)
    while True:
        with FileLock(str(live) + ".lock"):
            state = read_json(live)
            if starting(state, spec):
                if not wait:
                    return state  # type: ignore[return-value]
            elif _start_failed_here(state, spec):
                if state.get("failed"):  # type: ignore[union-attr]
                    raise ServerError(
                        f"{state['failed']}\n(this start's failure is recorded in {live}: a "  # type: ignore[index]
                        "new `snakemake` run starts the server afresh; "
                        f"`{hsextract_command('server', 'stop')}` clears the record)"
                    )
                # Gone before anyone saw it healthy (a bad flag exits at once): the wait
                # below says so and records it.
            elif is_serving(state, spec, probes=probes, interval_s=interval_s):
                return state  # type: ignore[return-value]
            else:
                if state:
                    why = _why_replaced(state, spec)
                    print(f"hsextract: replacing the server of {live.name}: {why}", file=sys.stderr)
                    stop(state)  # half-dead, unhealthy or stale: make sure nothing lingers
                if gate is not None:
                    gate()
                if spec.extra.get("port_auto"):
                    port = free_port(spec.host, spec.extra.get("max_port", 65535))
                    spec = replace(spec, port=port)
                    spec.argv = _with_port(spec.argv, spec.port)
                else:
                    refuse_taken_port(spec.host, spec.port)
                state = start(spec, wait=False, detached=detached)
                write_json(live, state)
                if not wait:
                    return state
        try:
            return wait_healthy(state, live=live)  # type: ignore[arg-type]
        except _Superseded:
            continue  # replaced meanwhile (another job found it dead): look again


def _why_replaced(state: dict, spec: ServerSpec) -> str:
    live = state.get("spec", {})
    if state.get("failed"):
        return "its start failed: " + str(state["failed"]).splitlines()[0]
    if not pid_alive(state.get("pid")):
        return f"its process {state.get('pid')} is gone"
    if lost := lost_workers(state):
        return lost
    if live.get("fingerprint") != spec.fingerprint:
        return f"it serves fingerprint {live.get('fingerprint')}"
    old = live.get("settings", {})
    changed = sorted(k for k in set(old) | set(spec.settings) if old.get(k) != spec.settings.get(k))
    if changed:
        return "the config changed since it started: " + ", ".join(
            f"{k} {old.get(k)!r} -> {spec.settings.get(k)!r}" for k in changed
        )
    return "it did not answer /health"


def _with_port(argv: list[str], port: int) -> list[str]:
    out = list(argv)
    i = out.index("--port")
    out[i + 1] = str(port)
    return out


def stop_live(state_dir: Path, *, keep_failed: bool = False) -> bool:
    """Stop this host's live server of a run dir, if any; used by onsuccess/onerror.

    Its dump dir goes too when empty: it is the recorded one, which may differ from what
    the current config would pick (a moved project relaunches from the record).  With
    ``keep_failed`` (the workflow's end), a record of a start that failed stays, for
    ``hsextract status`` to say why; the next workflow run replaces it.
    """
    live = live_path(state_dir)
    state = read_json(live)
    if not state:
        return False
    stop(state)
    if not (keep_failed and state.get("failed")):
        live.unlink(missing_ok=True)
    dump = state.get("spec", {}).get("dump_dir")
    if dump:
        remove_dump_dir_if_empty(Path(dump))
    return True


def prepare_dump_dir(path: Path, owner: str | None = None) -> Path:
    """Create the dump dir as ours (mode 0700), or adopt an existing one only if it is ours.

    /dev/shm is world-writable: another user could pre-create our name as a symlink or a
    dir they own and read, swap or plant pieces.  Refuse both.  A dir of ours is adopted
    only when empty or already marked (``config.dump_dir_refusal``): it will be emptied
    and removed, so a user's ``dump.dir: scratch/mine`` holding files, /dev/shm itself or
    a mount point is refused before it is chmod'ed or written to.  The marker names the
    run dir that owns it, so stale deletion never touches another output root's pieces.
    """
    from hsextract.config import RUN_MARKER, dump_dir_refusal

    path = Path(path)
    if path.is_symlink():
        raise ServerError(f"dump dir {path} is a symlink; refusing (remove it or set dump.dir)")
    try:
        path.mkdir(mode=0o700, parents=False)
    except FileExistsError:
        st = path.lstat()
        if not path.is_dir():
            raise ServerError(f"dump dir {path} exists and is not a directory") from None
        why = dump_dir_refusal(path)  # before anything is changed in it
        if why:
            raise ServerError(why) from None
        if st.st_uid != os.getuid():
            raise ServerError(
                f"dump dir {path} is owned by uid {st.st_uid}, not us ({os.getuid()}); "
                "refusing: another user may control it. Remove it or set dump.dir"
            ) from None
        if st.st_mode & 0o077:
            os.chmod(path, 0o700)
    except FileNotFoundError:
        raise ServerError(f"parent of dump dir {path} does not exist (dump.dir)") from None
    marker = path / RUN_MARKER
    if owner is not None:
        run = Path(owner).resolve()
        info = {"kind": "dump", "run_dir": str(run), "output_root": str(run.parent)}
        if read_json(marker) != info:
            write_json(marker, info)
    elif not marker.exists():
        marker.touch()
    return path


def build_spec(cfg: Config, *, run_dir: Path, log_path: Path) -> ServerSpec:
    """The launch spec for the configured engine, from the config alone."""
    from hsextract.config import dump_dir, fingerprint, server_aux_layers
    from hsextract.window import for_run

    server = cfg.server
    port_auto = server.port == 0
    max_port = SGLANG_MAX_PORT if cfg.engine == "sglang" else 65535
    port = free_port(server.host, max_port) if port_auto else server.port
    ddir = str(dump_dir(cfg))
    env: dict[str, str] = {}
    api_key_env = API_KEY_ENV if server.api_key else None
    if cfg.engine == "reference":
        env["SGLANG_HS_DUMP_DIR"] = ddir  # the engine captures through the patch's path
        layers = server_aux_layers(cfg)
        if layers is not None:
            env["HSEXTRACT_AUX_LAYERS"] = json.dumps(layers)
        argv = [
            sys.executable, "-m", "hsextract.engine",
            "--model-path", str(Path(cfg.model.path).resolve()),
            "--dtype", cfg.model.dtype,
            "--device", server.device,
            "--host", server.host,
            "--port", str(port),
            # The same max_seq_len the merge stage enforced: one source of truth.
            "--context-length", str(cfg.max_seq_len),
            "--chunked-prefill-size", str(server.chunked_prefill_size),
            "--max-running-requests", str(for_run(cfg).max_running),
        ]  # fmt: skip
        if not server.batch_invariant:
            argv.append("--no-batch-invariant")
        if dp_size(cfg) > 1:
            argv += ["--dp-size", str(dp_size(cfg))]
        if layers is not None:
            argv += ["--aux-layers", json.dumps(layers)]
    else:
        from hsextract.sglang.launch import build_launch

        argv, sg_env = build_launch(cfg, dump_dir=ddir, port=port)
        env.update(sg_env)
        # SGLang takes the key only on its command line; the recorded spec (server.json,
        # logs) holds a placeholder that start() fills from the environment.
        argv = [API_KEY_PLACEHOLDER if a == server.api_key else a for a in argv]
    return ServerSpec(
        engine=cfg.engine,
        argv=argv,
        env=env,
        host=server.host,
        port=port,
        log_path=str(log_path),
        fingerprint=fingerprint(cfg),
        dump_dir=ddir,
        health_timeout_s=float(server.health_timeout_s),
        api_key_env=api_key_env,
        extra={
            "port_auto": port_auto,
            "run_dir": str(run_dir),
            "max_port": max_port,
            **({"workers": expected_workers(cfg)} if expected_workers(cfg) else {}),
        },
        settings=spec_settings(cfg),
    )


def spec_settings(cfg: Config) -> dict[str, Any]:
    """The settings a server of this config runs with (``config.launch_settings``), with
    ``server.max_running_requests: auto`` as the value derived from the run's record lengths
    (hsextract.window): a server started before the merge counted other lengths is replaced,
    the sidecars record the limit that ran, and the settings file's name keeps ``auto``."""
    from hsextract.config import launch_settings
    from hsextract.window import for_run

    settings = launch_settings(cfg)
    if cfg.server.max_running_requests == "auto":
        settings["max_running_requests"] = for_run(cfg).max_running
    return settings


def remove_dump_dir_if_empty(path: Path) -> bool:
    """Drop our dump dir once nothing in it can still be used: /dev/shm is RAM.

    Called once this host's server is stopped (the workflow's end, ``hsextract server
    stop``), so its tombstones (``.abandoned``) have done their job.  What a SIGKILLed chunk
    job left goes too: its request dirs and their pieces, its reservation in the ledger
    (``.budget``) and the sending turns (``.turns``) -- but only when no live job holds a
    turn or a reservation.  A job reserves before it sends a request and releases once the
    request's pieces are read, so then no piece is anyone's, and the ledger's lock, held
    while they go, keeps a job from starting a request meanwhile.  Only names the capture
    protocol writes are removed (``stale.clear_protocol_files``), and request dirs only
    under our marker (a dir without it was never a server's): a file of someone else's is
    kept, and so is the dir with it.
    """
    from hsextract import stale
    from hsextract.budget import LEDGER_DIR, TURNS_DIR, SendingTurn, SharedByteBudget
    from hsextract.config import RUN_MARKER

    path = Path(path)
    if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
        return False
    names = {p.name for p in path.iterdir()}
    if RUN_MARKER not in names and names - {stale.ABANDONED_DIR, LEDGER_DIR, TURNS_DIR}:
        return False
    if SendingTurn.held(path):
        return False
    ledger = SharedByteBudget(path, 0)
    try:
        with ledger.unused() as unused:
            if not unused:
                return False
            foreign = stale.clear_protocol_files(path)
    finally:
        ledger.close()
    if foreign:
        return False
    (path / RUN_MARKER).unlink(missing_ok=True)
    try:
        path.rmdir()
    except OSError:
        return False  # a marker's temp file: a server of this run starting now
    return True
