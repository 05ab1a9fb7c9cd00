"""Data-parallel replicas on the live SGLang 0.5.14 (marker ``sglang_live``), on one GPU.

``bash h200/run.sh --group 4`` and ``--group 5``.  Two DP workers on the one H200: 0.5.14
refuses ``--gpu-id-step 0`` (server_args.py ``check_server_args``: ``gpu_id_step must be
positive``), so the GPU is listed twice, ``CUDA_VISIBLE_DEVICES=0,0``, with
``SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1``: worker d then gets entry d of that list as its
only visible device (utils/common.py ``maybe_reindex_device_id``), i.e. GPU 0 for both;
CUDA itself rejects the doubled list, so ``one_gpu_dp/sitecustomize.py`` de-duplicates it
inside the server's processes.
``mem_fraction_static`` is halved (0.25 each).  Caveat, from 0.5.14's source: each worker
sizes its KV pool as free memory minus ``(1 - mem_fraction_static)`` x the free memory it
saw before loading (model_runner_kv_cache_mixin.py ``_profile_available_bytes``); two
workers that measure before either allocates reserve the same slack, and the second may
find no room.  A start that fails so is reported with SGLang's words, not hidden.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from livekit import LIVE_ENV, live_config, out_dir, snakemake
from test_sglang_live import _fidelity, _no_sglang_left, _report, _run_dir, _verify, live  # noqa: F401

pytestmark = pytest.mark.sglang_live

ONE_GPU_DP2 = {
    "sglang.dp_size": 2,
    "sglang.mem_fraction_static": 0.25,  # live_config's 0.5, halved
    "sglang.extra_env": {
        **LIVE_ENV,
        "CUDA_VISIBLE_DEVICES": "0,0",
        "SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS": "1",
        "HSEXTRACT_LIVE_ONE_GPU_DP": "1",  # one_gpu_dp/sitecustomize.py: CUDA rejects "0,0"
    },
    "client.sending_jobs": 2,
}


@pytest.fixture(autouse=True)
def _one_gpu_shim(monkeypatch):
    """The server's processes find one_gpu_dp/sitecustomize.py first on their path (the
    launch appends the launching process's PYTHONPATH to its own)."""
    shim = str(Path(__file__).parent / "one_gpu_dp")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")]))
    )


def _server_log(rd: Path) -> str:
    path = rd / "logs" / "server.log"
    return path.read_text(errors="replace") if path.exists() else "(no server log)"


def _dp_ranks_prefilling(log: str) -> dict[str, int]:
    """Prefill log lines per DP rank (0.5.14 prefixes a DP worker's lines with ' DP<r>')."""
    counts: dict[str, int] = {}
    for m in re.finditer(r"\bDP(\d+)\b[^\n]*Prefill batch", log):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


@pytest.mark.parametrize(
    ("model", "capture"), [("dsv3", "patch"), ("dsv3", "hooks"), ("qwen3", "hooks")]
)
def test_dp2_on_one_gpu_end_to_end(live, model: str, capture: str):  # noqa: F811 - fixture
    """The workflow with two DP workers on GPU 0: every record within the fidelity bound,
    both DP ranks prefilling, the argv carrying --dp-size 2, no server left."""
    wd = live.root / f"dp2-{model}-{capture}"
    wd.mkdir()
    live_config(wd, getattr(live, model), live.inputs, capture=capture, **ONE_GPU_DP2)
    res = snakemake(wd, "-j4", "extract_all")
    os.chdir(wd)
    rd = _run_dir(wd)
    log = _server_log(rd)
    name = f"dp2 {model} {capture}"
    _report(f"{name}: workflow", res.stdout[-4000:] + res.stderr[-8000:])
    if res.returncode != 0:
        _report(f"{name}: server.log", log[-20000:])
    assert res.returncode == 0, (
        "dp 2 on one GPU did not run"
        + (
            " (SGLang's KV sizing: both workers reserved the same slack, see module doc)"
            if "leave no GPU memory for the KV cache" in log or "Not enough memory" in log
            else ""
        )
        + f": {res.stderr[-3000:]}"
    )
    srv = json.loads((rd / "state" / "server.json").read_text())
    argv = srv["spec"]["argv"]
    assert argv[argv.index("--dp-size") + 1] == "2"
    ranks = _dp_ranks_prefilling(log)
    sidecars = [json.loads(p.read_text()) for p in sorted((rd / "hidden").glob("chunk_*.json"))]
    _report(f"{name}: DP ranks prefilling", {"prefill_lines_per_dp_rank": ranks})
    assert set(ranks) == {"0", "1"}, ranks
    chunks = sorted((rd / "hidden").glob("chunk_*.safetensors"))
    _report(f"{name}: fidelity", _fidelity(live, getattr(live, model), chunks, name))
    assert sum(s["records"] for s in sidecars) == len(live.records)
    assert _verify(rd).returncode == 0
    # The workflow has returned, its stop sent: wait for the processes to be gone (the event).
    assert not _no_sglang_left(live.root, 120)


def test_dp_worker_killed_mid_chunk_on_live_sglang(live):  # noqa: F811 - fixture
    """SIGKILL one DP scheduler (``sglang::scheduler_DP1``) while a chunk is in flight:
    SGLang keeps serving /health with the other; hsextract's ensure() counts the workers,
    replaces the server, and the run completes; nothing is left."""
    from hsextract.config import dump_dir, read_config
    from hsextract.dp import SGLANG_WORKER_TITLE, _pgid_members
    from hsextract.server import live_path

    wd = live.root / "dp2-kill"
    wd.mkdir()
    live_config(
        wd,
        live.dsv3,
        live.inputs,
        **ONE_GPU_DP2,
        **{"client.request_timeout_s": 30, "client.retries": 4, "client.backoff_s": 3.0},
    )
    os.chdir(wd)
    cfg = read_config("config.yaml")
    rd = _run_dir(wd)
    proc = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "-s", str(Path(__file__).parents[2] / "Snakefile"),
         "--directory", str(wd), "--scheduler", "greedy", "-j2", "extract_all"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    killed = None
    try:
        ddir = dump_dir(cfg)
        deadline = time.monotonic() + 400
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            live_state = live_path(rd / "state")
            if live_state.exists() and ddir.exists() and any(ddir.glob("chunk_*")):
                state = json.loads(live_state.read_text())
                for pid, _, cmd in _pgid_members(int(state["pgid"])):
                    if cmd.startswith(f"{SGLANG_WORKER_TITLE}_DP1"):
                        os.kill(pid, signal.SIGKILL)
                        killed = (pid, cmd)
            time.sleep(0.005)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    chunk_logs = "\n".join(
        f.read_text()[-3000:] for f in sorted((rd / "logs").glob("extract_chunk_*.log"))
    )
    _report("dp2 kill: workflow", out[-6000:] + "\n--- chunk logs\n" + chunk_logs[-12000:])
    _report("dp2 kill: server.log", _server_log(rd)[-12000:])
    assert killed is not None, "never caught a chunk mid-extraction with DP1 alive"
    assert proc.returncode == 0, out[-6000:]
    assert "data-parallel worker processes are gone" in chunk_logs, chunk_logs[-4000:]
    assert _verify(rd).returncode == 0
    # The workflow has returned, its stop sent: wait for the processes to be gone (the event).
    assert not _no_sglang_left(live.root, 120)
    out_dir()
