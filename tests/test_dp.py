"""Data-parallel replicas (``sglang.dp_size``): the launch command, the GPUs it takes, the
budgets that follow it, and the reference engine run the way SGLang's DP controller runs
(N worker processes behind one port): the same bytes as one worker, aborts that reach the
worker holding the rid, a dead worker noticed by ``ensure()``.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from fixtures_demo import make_workdir, run_dir_of, run_snakemake
from test_gpu import FakeNvml, clean

from hsextract import dp, server
from hsextract.client import Client, model_geometry
from hsextract.config import Config, launch_settings, load_config, typed
from hsextract.errors import ConfigError
from hsextract.gpu import GpuGateError, gate
from hsextract.procs import pid_alive
from hsextract.sglang import versions
from hsextract.sglang.flags import check_argv, declared_flags
from hsextract.sglang.launch import build_launch, validate_sglang_config

ROOT = Path(__file__).resolve().parents[1]
QWEN = ROOT / "configs" / "qwen3-8b-8xh200.yaml"


def _qwen(version: str, **overrides) -> Config:
    cfg = load_config(QWEN)
    cfg["sglang"]["version"] = version
    cfg["aux_layers"] = [2, 18, 33]  # hooks read them from config.json, absent here
    for key, value in overrides.items():
        node = cfg
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return typed(cfg)


# -- the launch command ----------------------------------------------------------------


def test_dp_size_is_emitted_and_declared_by_every_release(release: str, release_pkg: Path):
    cfg = _qwen(release)
    argv, _ = build_launch(cfg, dump_dir="/dev/shm/hs", port=31000)
    assert argv[argv.index("--dp-size") + 1] == "8"
    assert argv[argv.index("--tp-size") + 1] == "1"
    seen = check_argv(argv, declared_flags(release_pkg, versions.get(release)), release)
    assert "--dp-size" in seen
    # dp 1 leaves the command as it was before dp_size existed.
    one, _ = build_launch(_qwen(release, **{"sglang.dp_size": 1}), dump_dir="/d", port=1)
    assert "--dp-size" not in one


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--dp-size", "2"], "set sglang.dp_size instead"),
        (["--data-parallel-size=2"], "set sglang.dp_size instead"),
        (["--enable-dp-attention"], "DP attention rank 0 does not hold every request"),
        (["--gpu-id-step", "0"], "SGLang asserts gpu_id_step >= 1"),
    ],
)
def test_dp_flags_outside_dp_size_are_refused(extra: list[str], needle: str):
    cfg = _qwen("0.5.14", **{"sglang.extra_args": extra})
    with pytest.raises(ConfigError, match=needle):
        validate_sglang_config(cfg, versions.get("0.5.14"))


def test_dp_size_one_keeps_the_launch_settings_digest():
    """Servers and launch records from before dp_size existed are not replaced by it."""
    cfg = _qwen("0.5.14", **{"sglang.dp_size": 1})
    assert "dp_size" not in launch_settings(cfg)["sglang"]
    assert launch_settings(_qwen("0.5.14"))["sglang"]["dp_size"] == 8


# -- GPUs ------------------------------------------------------------------------------


def test_server_gpus_follow_sglangs_rank_numbering():
    # data_parallel_controller.py: DP worker d, TP rank t -> base + (d*tp + t) * step.
    cfg = _qwen("0.5.14", **{"sglang.dp_size": 2, "sglang.tp_size": 4})
    assert dp.server_gpus(cfg, {}) == [str(i) for i in range(8)]
    steps = ["--base-gpu-id", "1", "--gpu-id-step", "2"]
    cfg = _qwen("0.5.14", **{"sglang.dp_size": 2, "sglang.tp_size": 1, "sglang.extra_args": steps})
    assert dp.server_gpus(cfg, {}) == ["1", "3"]
    # Under CUDA_VISIBLE_DEVICES the ordinals index its list: one GPU named twice holds
    # two DP workers (with SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS).
    env = {"CUDA_VISIBLE_DEVICES": "0,0"}
    cfg = _qwen("0.5.14", **{"sglang.dp_size": 2, "sglang.tp_size": 1, "sglang.extra_env": env})
    assert dp.server_gpus(cfg, {}) == ["0", "0"]


def test_an_allocation_with_fewer_gpus_than_dp_x_tp_is_refused_naming_the_profile():
    cfg = _qwen("0.5.14")  # dp 8 x tp 1
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_JOB_ID": "77"}
    with pytest.raises(ConfigError) as err:
        dp.server_gpus(cfg, env)
    msg = str(err.value)
    assert "dp x tp = 8 GPU ranks" in msg and "lists 4" in msg
    assert "SLURM job 77" in msg and "profiles/slurm/config.yaml" in msg


def test_the_gate_covers_every_gpu_the_server_takes():
    with pytest.raises(GpuGateError) as err:
        need = [str(i) for i in range(8)]
        gate(200, 0, require_nvml=True, required=need, nvml=FakeNvml([clean(4)]))
    assert "takes 8 GPU ranks" in str(err.value) and "['4', '5', '6', '7']" in str(err.value)
    report = gate(200, 0, require_nvml=True, required=["0", "0"], nvml=FakeNvml([clean(1)]))
    assert report["ok"] and report["server_gpus"] == ["0", "0"]


# -- budgets ---------------------------------------------------------------------------


def test_in_flight_and_shm_budget_are_per_replica():
    cfg = _qwen("0.5.14")
    assert dp.requests_in_flight(cfg) == cfg.client.requests_in_flight * 8
    assert dp.shm_budget_bytes(cfg) == int(cfg.dump.shm_budget_gb * 2**30) * 8
    one = _qwen("0.5.14", **{"sglang.dp_size": 1})
    assert dp.requests_in_flight(one) == cfg.client.requests_in_flight


def test_the_client_keeps_a_connection_per_request_in_flight():
    """requests keeps 10 connections per host and drops the rest after use: at 16 in flight
    per replica every request past the tenth opened a new connection (the live race's
    chunk logs: "Connection pool is full, discarding connection")."""
    import torch

    from hsextract.client import Geometry

    cfg = _qwen("0.5.14")  # dp 8 x 16 in flight
    geo = Geometry(hidden_size=4096, num_layers=36, aux_layers=[2, 18, 33], dtype=torch.bfloat16)
    state = {"url": "http://127.0.0.1:9", "spec": {"dump_dir": "/nonexistent"}}
    client = Client(cfg, geo, lambda: state)
    pool = client.session.get_adapter("http://127.0.0.1:9").poolmanager.connection_pool_kw
    assert pool["maxsize"] == dp.requests_in_flight(cfg) == 128


# -- the reference engine with DP workers ----------------------------------------------


def _engine(demo_run, tmp_path: Path, name: str, dp_size: int, faults: dict | None = None):
    cfg = copy.deepcopy(load_config(demo_run["workdir"] / "config.yaml"))
    cfg["model"]["path"] = str(demo_run["workdir"] / cfg["model"]["path"])
    cfg["server"]["chunked_prefill_size"] = 64
    cfg["sglang"]["dp_size"] = dp_size
    cfg["dump"]["dir"] = str(tmp_path / f"dump-{name}")
    cfg = typed(cfg)
    spec = server.build_spec(cfg, run_dir=tmp_path, log_path=tmp_path / f"{name}.log")
    saved = os.environ.get("HSEXTRACT_FAULTS")
    if faults:
        os.environ["HSEXTRACT_FAULTS"] = json.dumps(faults)
    try:
        state = server.start(spec, owner=os.getpid())
    finally:
        if saved is None:
            os.environ.pop("HSEXTRACT_FAULTS", None)
        else:
            os.environ["HSEXTRACT_FAULTS"] = saved
    return cfg, state


def _info(state: dict) -> dict:
    return requests.get(f"{state['url']}/get_server_info", timeout=10).json()


RECORDS = [[(7 * j + 3 * i) % 500 for i in range(40 + 37 * j)] for j in range(8)]


def test_dp2_engine_serves_on_both_workers_the_bytes_of_one(demo_run, tmp_path):
    cfg1, one = _engine(demo_run, tmp_path, "dp1", 1)
    try:
        cfg2, two = _engine(demo_run, tmp_path, "dp2", 2)
        try:
            assert dp.workers_alive(two) == (2, 2) and dp.workers_alive(one) is None
            c1 = Client(cfg1, model_geometry(cfg1), lambda: one)
            c2 = Client(cfg2, model_geometry(cfg2), lambda: two)
            with ThreadPoolExecutor(8) as pool:
                got2 = list(pool.map(lambda j: c2.extract(f"r{j}", str(j), RECORDS[j]), range(8)))
            got1 = [c1.extract(f"r{j}", str(j), ids) for j, ids in enumerate(RECORDS)]
            for a, b in zip(got1, got2, strict=True):
                for x, y in zip(a, b, strict=True):
                    assert x.dtype == y.dtype and x.shape == y.shape
                    assert x.numpy().tobytes() == y.numpy().tobytes()  # bitwise
            info = _info(two)
            assert info["dp_size"] == 2 and sum(info["dp_served"]) == 8
            assert min(info["dp_served"]) >= 1, info  # round robin: both served
        finally:
            server.stop(two)
    finally:
        server.stop(one)


def test_abort_reaches_the_worker_holding_the_rid(demo_run, tmp_path):
    """SGLang's controller sends an abort to every worker (the dispatcher's fallback);
    the one holding the rid stops it part-way, the answer is finish_reason abort.

    Held on an event: the doomed request's first pass waits at a gate until the abort has
    been answered, so the abort always lands mid-request, however slow the machine.
    """
    gate, log = tmp_path / "open", tmp_path / "faults.jsonl"
    hold = {
        "log": str(log),
        "extend": [{"rid": "slow-", "nth": [1], "do": "wait", "gate": str(gate)}],
    }
    cfg, state = _engine(demo_run, tmp_path, "abort", 2, faults=hold)
    try:
        ids = [i % 500 for i in range(512)]  # 8 passes of 64
        with ThreadPoolExecutor(2) as pool:
            # One request per worker (round robin), the second the one to abort.
            url = f"{state['url']}/generate"
            other = pool.submit(
                requests.post, url, json={"input_ids": ids[:50], "rid": "plain"}, timeout=120
            )
            doomed = pool.submit(
                requests.post, url, json={"input_ids": ids, "rid": "slow-x"}, timeout=120
            )
            try:
                deadline = time.monotonic() + 120
                while not (log.exists() and log.read_text().strip()):  # its first pass ran
                    assert time.monotonic() < deadline, "the request to abort never started"
                    time.sleep(0.05)
                requests.post(f"{state['url']}/abort_request", json={"rid": "slow-x"}, timeout=10)
            finally:
                gate.touch()
            answer = doomed.result().json()
            assert other.result().json()["meta_info"]["finish_reason"]["type"] == "length"
        assert answer["meta_info"]["finish_reason"]["type"] == "abort"
        info = _info(state)
        (abort,) = [a for a in info["aborted"] if a["rid"] == "slow-x"]
        assert 0 < abort["prefilled"] < 512
        assert info["dp_served"] == [1, 0] or info["dp_served"] == [0, 1]
    finally:
        gate.touch()
        server.stop(state)


def test_ensure_replaces_a_server_that_lost_a_dp_worker(demo_run, tmp_path):
    cfg, state = _engine(demo_run, tmp_path, "lost", 2)
    new = None
    try:
        spec = server.ServerSpec(**state["spec"])
        (tmp_path / "state").mkdir()
        server.write_json(server.live_path(tmp_path / "state"), state)
        assert server.is_serving(state, spec)
        victim = next(
            pid for pid, comm, _ in dp._pgid_members(state["pgid"]) if comm == "hsref::dp1"
        )
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while dp.workers_alive(state) != (1, 2):
            assert time.monotonic() < deadline, dp.workers_alive(state)
            time.sleep(0.05)
        # SGLang (and the reference front) still answer /health: only the count tells.
        assert server.health(state["url"])
        assert "1 of its 2 data-parallel worker processes are gone" in dp.lost_workers(state)
        assert not server.is_serving(state, spec)
        new = server.ensure(spec, tmp_path / "state")
        assert new["pid"] != state["pid"] and dp.workers_alive(new) == (2, 2)
        assert not pid_alive(state["pid"])
    finally:
        server.stop(state)
        if new is not None:
            server.stop(new)


# -- the workflow ----------------------------------------------------------------------


@pytest.mark.workflow
def test_workflow_with_dp2_writes_the_bytes_of_dp1(demo_run, tmp_path):
    """The client needs no change: pieces of both workers land in the one dump dir under
    their rids, and every chunk equals the dp 1 run's byte for byte."""
    workdir = make_workdir(tmp_path / "w", **{"sglang.dp_size": 2})
    run_snakemake(workdir, "-j2", "extract_all")
    rd = run_dir_of(workdir)
    assert rd.name == demo_run["run_dir"].name  # dp is not in the fingerprint
    got = json.loads((rd / "manifest.json").read_text())
    want = {c["path"]: c["sha256"] for c in demo_run["manifest"]["chunks"]}
    assert {c["path"]: c["sha256"] for c in got["chunks"]} == want
    sidecar = json.loads((rd / "hidden" / "chunk_00000.json").read_text())
    assert "--dp-size" in sidecar["server"]["argv"]
    log = (rd / "logs" / "server.log").read_text()
    assert "DP worker 0 up" in log and "DP worker 1 up" in log
