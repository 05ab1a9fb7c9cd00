"""Data-parallel replicas inside one server: SGLang's own ``--dp-size`` (``sglang.dp_size``).

One server per node still (one health check, one watchdog, one GPU gate): with
``dp_size`` N it runs N scheduler workers behind one port, each its own TP group of
``tp_size`` GPUs, and SGLang's data-parallel controller hands each request to one of them
(``--load-balance-method``, default round robin).  What follows from that, in one place:

* GPUs: the server takes dp x tp of them.  SGLang 0.5.14 gives DP rank d, TP rank t the
  CUDA ordinal ``base_gpu_id + d*tp*gpu_id_step + t*gpu_id_step``
  (``data_parallel_controller.py`` ``launch_dp_schedulers``, ``launch_tensor_parallel_group``:
  ``base_gpu_id += tp_size * pp_size * gpu_id_step``); :func:`server_gpus` maps those
  through ``CUDA_VISIBLE_DEVICES`` to the devices the GPU gate checks.
* Client side, per replica: ``client.requests_in_flight``, ``client.tokens_in_flight`` and
  ``dump.shm_budget_gb`` are per DP worker (so is ``server.max_running_requests``, in SGLang
  already), so a chunk job keeps ``requests_in_flight x dp`` requests and ``tokens_in_flight
  x dp`` tokens in flight under a ``shm_budget_gb x dp`` budget (:func:`requests_in_flight`,
  :func:`shm_budget_bytes`, hsextract.window for ``auto``):
  each replica sees the queue one server saw at dp 1, and a config tuned at dp 1 stays tuned.
* Liveness: SGLang watches only the DP controller, not the schedulers it starts
  (``engine.py`` ``SubprocessWatchdog`` gets the controller process; the controller's event
  loop never polls its workers), so a killed DP worker leaves a server that answers
  /health while every request routed to that worker waits forever.  :func:`workers_alive`
  counts the workers; ``server.is_serving`` replaces a server that lost one.
"""

from __future__ import annotations

import os
from pathlib import Path

from hsextract.config_types import Config
from hsextract.errors import ConfigError

#: How a DP worker names itself: SGLang's schedulers set their process title
#: (``sglang::scheduler_DP1``, ``..._DP1_TP0``; scheduler.py ``configure_scheduler_process``),
#: the reference engine's workers their comm (``hsref::dp1``, ``engine.py``).
SGLANG_WORKER_TITLE = "sglang::scheduler"
REFERENCE_WORKER_COMM = "hsref::dp"


def dp_size(cfg: Config) -> int:
    """Data-parallel workers of the one server (``sglang.dp_size``; both engines)."""
    value = cfg.sglang.dp_size
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"sglang.dp_size must be an integer >= 1, got {value!r}")
    return value


def tp_size(cfg: Config) -> int:
    return cfg.sglang.tp_size if cfg.engine == "sglang" else 1


def server_gpu_count(cfg: Config) -> int:
    """GPUs one server takes (a chunk job's ``gpu`` resource): dp x tp; 0 on the
    reference engine, which runs on CPU unless ``server.device`` says otherwise."""
    return dp_size(cfg) * tp_size(cfg) if cfg.engine == "sglang" else 0


def requests_in_flight(cfg: Config) -> int:
    """Requests one chunk job keeps in flight: ``client.requests_in_flight`` per replica
    (``auto``: from the run's record lengths, hsextract.window)."""
    from hsextract.window import for_run

    return for_run(cfg).requests * dp_size(cfg)


def shm_budget_bytes(cfg: Config) -> int:
    """The dump dir's byte budget shared by a node's chunk jobs: ``dump.shm_budget_gb``
    per replica (its in-flight requests' pieces scale with the replicas)."""
    return int(float(cfg.dump.shm_budget_gb) * 2**30) * dp_size(cfg)


def budget_keys(cfg: Config) -> str:
    """How the two figures above were reached, for messages."""
    n = dp_size(cfg)
    return f" x sglang.dp_size {n}" if n > 1 else ""


def expected_workers(cfg: Config) -> int | None:
    """Worker processes a healthy server has, when nobody else watches them (dp > 1):
    SGLang dp x tp schedulers, the reference engine dp workers; None at dp 1."""
    n = dp_size(cfg)
    return n * tp_size(cfg) if n > 1 else None


def _option(args: list[str], flag: str) -> str | None:
    from hsextract.sglang.launch import _option_value

    return _option_value(args, flag)


def server_gpus(cfg: Config, environ: dict[str, str] | None = None) -> list[str]:
    """The devices the server's dp x tp ranks take, as ``CUDA_VISIBLE_DEVICES`` names them
    (an index or a UUID), one per rank: rank r of DP worker d is CUDA ordinal ``base_gpu_id
    + (d*tp + r)*gpu_id_step`` of the visible list.  Two ranks may name one device (a
    ``CUDA_VISIBLE_DEVICES`` listing it twice, with ``SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS``:
    several workers on one GPU).  Raises ConfigError when the visible list is too short."""
    sg = cfg.sglang
    extra = list(sg.extra_args)
    base = int(_option(extra, "--base-gpu-id") or 0)
    step = int(_option(extra, "--gpu-id-step") or 1)
    n = dp_size(cfg) * tp_size(cfg)
    ordinals = [base + i * step for i in range(n)]
    env = {**(environ if environ is not None else os.environ), **sg.extra_env}
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() == "":
        return [str(o) for o in ordinals]
    names = [v.strip() for v in visible.split(",") if v.strip()]
    if ordinals[-1] >= len(names):
        where = _allocation_hint(env)
        raise ConfigError(
            f"the server takes dp x tp = {n} GPU ranks (sglang.dp_size {dp_size(cfg)} x "
            f"tp_size {tp_size(cfg)}, CUDA ordinals {ordinals[0]}..{ordinals[-1]}), but "
            f"CUDA_VISIBLE_DEVICES={visible!r} lists {len(names)}{where}"
        )
    return [names[o] for o in ordinals]


def _allocation_hint(env: dict[str, str]) -> str:
    if env.get("SLURM_JOB_ID"):
        return (
            f" (SLURM job {env['SLURM_JOB_ID']}'s allocation): give extract_chunk gpu = "
            "dp x tp in profiles/slurm/config.yaml (docs/slurm.md)"
        )
    return "; list more devices, or lower sglang.dp_size / tp_size"


def _pgid_members(pgid: int) -> list[tuple[int, str, str]]:
    """(pid, comm, cmdline) of the live members of a process group."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] in ("Z", "X"):
                continue
            comm = (entry / "comm").read_text().strip()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        out.append((int(entry.name), comm, cmd.strip()))
    return out


def workers_alive(state: dict) -> tuple[int, int] | None:
    """(alive, expected) DP worker processes of a live server, or None when not tracked."""
    expected = (state.get("spec") or {}).get("extra", {}).get("workers")
    pgid = int(state.get("pgid") or state.get("pid") or 0)
    if not expected or pgid <= 0:
        return None
    alive = sum(
        1
        for _, comm, cmd in _pgid_members(pgid)
        if cmd.startswith(SGLANG_WORKER_TITLE) or comm.startswith(REFERENCE_WORKER_COMM)
    )
    return alive, int(expected)


def lost_workers(state: dict) -> str | None:
    """Why a server is not whole (a DP worker gone), or None."""
    counted = workers_alive(state)
    if counted is None or counted[0] >= counted[1]:
        return None
    return (
        f"{counted[1] - counted[0]} of its {counted[1]} data-parallel worker processes are "
        "gone (SGLang keeps answering /health, and the requests routed to a dead worker "
        "never finish)"
    )
