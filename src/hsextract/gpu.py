"""GPU gate: refuse to start a server on GPUs that something else still holds.

The seed's run began with zombie python processes keeping CUDA contexts alive; a server
started next to them either OOMs or silently shares a GPU.  So before ``launch_server`` every
visible GPU must be under ``max_used_mib`` with no compute process, and when it is not the
message names each holder (GPU index, used MiB, PID, process name) and what to do.
NVML comes from nvidia-ml-py (``import pynvml``); tests pass a fake module as ``nvml``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from hsextract.commands import hsextract_command
from hsextract.errors import HsextractError


class GpuGateError(HsextractError):
    """GPUs are busy (or absent while required); the message names the holders."""


def _load_nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _process_name(nvml: Any, pid: int) -> str:
    # NVML's own name lookup fails for processes in other PID namespaces; /proc is the
    # fallback that works for the seed's case (a leftover python on the same host).
    try:
        return _text(nvml.nvmlSystemGetProcessName(pid))
    except Exception:
        pass
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip() or "?"
        )
    except OSError:
        return "?"


def snapshot(nvml: Any) -> list[dict[str, Any]]:
    """Per GPU: index, name, used MiB, total MiB and its compute processes."""
    gpus = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        procs = []
        for p in nvml.nvmlDeviceGetComputeRunningProcesses(h) or []:
            used = getattr(p, "usedGpuMemory", None)
            procs.append(
                {
                    "pid": int(p.pid),
                    "name": _process_name(nvml, int(p.pid)),
                    "used_mib": None if used is None else int(used) // (1 << 20),
                }
            )
        gpus.append(
            {
                "index": i,
                "name": _text(nvml.nvmlDeviceGetName(h)),
                "used_mib": int(mem.used) // (1 << 20),
                "total_mib": int(mem.total) // (1 << 20),
                "processes": procs,
            }
        )
    return gpus


def _busy(gpus: list[dict[str, Any]], max_used_mib: int) -> list[dict[str, Any]]:
    return [g for g in gpus if g["used_mib"] > max_used_mib or g["processes"]]


def _describe(busy: list[dict[str, Any]], max_used_mib: int) -> str:
    lines = []
    for g in busy:
        holders = (
            ", ".join(f"PID {p['pid']} ({p['name']})" for p in g["processes"])
            or "no process listed"
        )
        lines.append(
            f"  GPU {g['index']} ({g['name']}): {g['used_mib']} MiB used; held by {holders}"
        )
    return (
        f"GPU gate: {len(busy)} GPU(s) over {max_used_mib} MiB or with compute processes:\n"
        + "\n".join(lines)
        + "\nStop those processes (e.g. `kill <PID>`; a stale server: "
        + f"`{hsextract_command('server', 'stop')}`), "
        "or wait with --wait-s, or raise gpu.max_used_mib if the usage is expected."
    )


def _missing(gpus: list[dict[str, Any]], required: list[str], nvml: Any) -> list[str]:
    """The devices of ``required`` (CUDA_VISIBLE_DEVICES names: an index or a UUID) that
    NVML does not see."""
    uuids = set()
    for g in gpus:
        try:
            uuids.add(_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(g["index"]))))
        except Exception:
            pass
    seen = {str(g["index"]) for g in gpus} | uuids
    return sorted({d for d in required if d not in seen})


def gate(
    max_used_mib: int,
    wait_s: float,
    *,
    require_nvml: bool,
    required: list[str] | None = None,
    nvml: Any = None,
    poll_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Check every visible GPU; wait up to ``wait_s`` for them to become clean; report or raise.

    ``required``: the devices the server's ranks take (``hsextract.dp.server_gpus``: dp x
    tp of them); one NVML does not see fails at once, naming the count and the keys.
    """
    module = nvml if nvml is not None else _load_nvml()
    initialised = False
    if module is not None:
        try:
            module.nvmlInit()
            initialised = True
        except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded: no NVIDIA device
            reason = f"NVML unavailable: {e}"
    else:
        reason = "nvidia-ml-py (pynvml) is not installed"
    if not initialised:
        if require_nvml:
            raise GpuGateError(
                f"GPU gate: {reason}. engine sglang needs NVIDIA GPUs; install the driver / "
                "nvidia-ml-py, or use engine: reference to run on CPU."
            )
        return {
            "ok": True,
            "nvml": False,
            "gpus": [],
            "message": f"{reason}: no NVIDIA device, engine runs on CPU",
        }
    try:
        start = clock()
        deadline = start + max(0.0, wait_s)
        while True:
            gpus = snapshot(module)
            missing = _missing(gpus, required or [], module)
            if missing:
                raise GpuGateError(
                    f"GPU gate: the server takes {len(required or [])} GPU ranks (sglang."
                    f"dp_size x tp_size) on devices {sorted(set(required or []))}, but NVML "
                    f"sees {len(gpus)} GPU(s) here and not {missing}; lower sglang.dp_size "
                    "or tp_size, or run where the GPUs are"
                )
            busy = _busy(gpus, max_used_mib)
            if not busy:
                return {
                    "ok": True,
                    "nvml": True,
                    "max_used_mib": max_used_mib,
                    "waited_s": round(clock() - start, 3),
                    "gpus": gpus,
                    "server_gpus": required,
                    "message": f"{len(gpus)} GPU(s) clean (<= {max_used_mib} MiB, no processes)",
                }
            if clock() >= deadline:
                suffix = f" (waited {clock() - start:.0f} s)" if wait_s > 0 else ""
                raise GpuGateError(_describe(busy, max_used_mib) + suffix)
            sleep(min(poll_s, deadline - clock()))
    finally:
        try:
            module.nvmlShutdown()
        except Exception:
            pass


def _cmd_gate(args: argparse.Namespace) -> int:
    try:
        report = gate(args.max_used_mib, args.wait_s, require_nvml=args.require_nvml)
    except GpuGateError as e:
        print(str(e), file=sys.stderr)
        return 1
    print(report["message"])
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``hsextract gpu-gate [--max-used-mib N] [--wait-s S] [--require-nvml] [--out FILE]``."""
    p = subparsers.add_parser("gpu-gate", help="check every GPU is free before starting a server")
    p.add_argument("--max-used-mib", type=int, default=200)
    p.add_argument("--wait-s", type=float, default=0.0, help="wait this long for GPUs to clear")
    p.add_argument(
        "--require-nvml",
        action="store_true",
        help="fail without NVML (engine sglang); else report that the engine runs on CPU",
    )
    p.add_argument("--out", help="write the report (state/gpu_gate.json) here")
    p.set_defaults(func=_cmd_gate)
