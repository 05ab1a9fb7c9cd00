"""The GPU gate with a fake NVML module injected at the module boundary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hsextract import gpu
from hsextract.gpu import GpuGateError, gate

MIB = 1 << 20


class FakeNvml:
    """The few pynvml calls the gate makes; ``states`` is consumed one snapshot per poll."""

    def __init__(self, states: list[list[dict[str, Any]]], *, init_error: Exception | None = None):
        self.states = states
        self.polls = 0
        self.init_error = init_error
        self.shutdown = False

    def _now(self) -> list[dict[str, Any]]:
        return self.states[min(self.polls, len(self.states) - 1)]

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        self.polls += 1  # one count per snapshot
        return len(self.states[min(self.polls - 1, len(self.states) - 1)])

    def nvmlDeviceGetHandleByIndex(self, i: int) -> dict[str, Any]:
        return self.states[min(self.polls - 1, len(self.states) - 1)][i]

    def nvmlDeviceGetMemoryInfo(self, h: dict[str, Any]) -> Any:
        return SimpleNamespace(used=h["used_mib"] * MIB, total=143771 * MIB)

    def nvmlDeviceGetName(self, h: dict[str, Any]) -> bytes:
        return b"NVIDIA H200"  # older pynvml returns bytes

    def nvmlDeviceGetComputeRunningProcesses(self, h: dict[str, Any]) -> list[Any]:
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=mib * MIB) for pid, mib in h.get("procs", [])
        ]

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        return {4242: "python3 zombie_server.py", 4243: "python3 -m sglang.launch_server"}[pid]


def clean(n: int = 8) -> list[dict[str, Any]]:
    return [{"used_mib": 3} for _ in range(n)]


def busy() -> list[dict[str, Any]]:
    s = clean()
    s[0] = {"used_mib": 80_000, "procs": [(4242, 79_000)]}
    s[5] = {"used_mib": 1_024, "procs": [(4243, 1_000), (999_999_999, 10)]}
    return s


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_clean_gpus_pass_with_a_report() -> None:
    nv = FakeNvml([clean()])
    report = gate(200, 0, require_nvml=True, nvml=nv)
    assert report["ok"] and report["nvml"] and len(report["gpus"]) == 8
    assert report["gpus"][3] == {
        "index": 3, "name": "NVIDIA H200", "used_mib": 3, "total_mib": 143771, "processes": []
    }  # fmt: skip
    assert nv.shutdown


def test_busy_gpus_fail_naming_index_mib_pid_and_name() -> None:
    nv = FakeNvml([busy()])
    with pytest.raises(GpuGateError) as e:
        gate(200, 0, require_nvml=True, nvml=nv)
    msg = str(e.value)
    assert "GPU 0 (NVIDIA H200): 80000 MiB used; held by PID 4242 (python3 zombie_server.py)" in msg
    assert "GPU 5" in msg and "PID 4243 (python3 -m sglang.launch_server)" in msg
    assert "PID 999999999 (?)" in msg  # a name NVML cannot give and /proc does not have
    assert "GPU 1 " not in msg and "kill" in msg
    assert nv.shutdown


def test_process_without_memory_over_threshold_still_blocks() -> None:
    s = clean()
    s[2] = {"used_mib": 5, "procs": [(4242, 2)]}
    with pytest.raises(GpuGateError, match="GPU 2 .* PID 4242"):
        gate(200, 0, require_nvml=True, nvml=FakeNvml([s]))


def test_wait_until_clean_succeeds() -> None:
    clock = Clock()
    nv = FakeNvml([busy(), busy(), clean()])
    report = gate(200, 60, require_nvml=True, nvml=nv, poll_s=2, sleep=clock.sleep, clock=clock)
    assert report["ok"] and nv.polls == 3 and report["waited_s"] == pytest.approx(4.0)


def test_wait_times_out_with_the_holders() -> None:
    clock = Clock()
    nv = FakeNvml([busy()])
    with pytest.raises(GpuGateError, match=r"(?s)PID 4242 .*waited 10 s"):
        gate(200, 10, require_nvml=True, nvml=nv, poll_s=3, sleep=clock.sleep, clock=clock)
    assert clock.t == pytest.approx(10.0) and nv.polls == 5  # t = 0, 3, 6, 9, 10


def test_no_nvml_is_an_error_for_sglang() -> None:
    nv = FakeNvml([], init_error=RuntimeError("NVML Shared Library Not Found"))
    with pytest.raises(
        GpuGateError, match="NVML unavailable: NVML Shared Library Not Found.*engine sglang"
    ):
        gate(200, 0, require_nvml=True, nvml=nv)


def test_no_nvml_reports_cpu_for_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "_load_nvml", lambda: None)  # pynvml not installed
    report = gate(200, 0, require_nvml=False)
    assert report["ok"] and not report["nvml"] and report["gpus"] == []
    assert "no NVIDIA device, engine runs on CPU" in report["message"]
    with pytest.raises(GpuGateError, match="not installed"):
        gate(200, 0, require_nvml=True)


def test_cli_writes_the_report(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gpu, "_load_nvml", lambda: FakeNvml([clean(2)]))
    parser = argparse.ArgumentParser()
    gpu.register_cli(parser.add_subparsers())
    out = tmp_path / "state" / "gpu_gate.json"
    args = parser.parse_args(
        ["gpu-gate", "--max-used-mib", "100", "--require-nvml", "--out", str(out)]
    )
    assert args.func(args) == 0
    assert [g["used_mib"] for g in json.loads(out.read_text())["gpus"]] == [3, 3]
    monkeypatch.setattr(gpu, "_load_nvml", lambda: FakeNvml([busy()]))
    assert args.func(args) == 1
