"""The production path against a live SGLang (the installed release: 0.5.14, 0.5.15.post1,
0.5.16 or 0.5.17 on the H200, whichever ``h200/build.sh`` packed): marker ``sglang_live``.

Run there by ``h200/run.sh`` (see h200/README.md); deselected everywhere else (pyproject's
addopts), never skipped.  What a test shows goes to ``$OUT`` as well as into its asserts.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fixtures_demo import planned_jobs, processes_under
from livekit import (
    LIVE_EXTRA_ARGS,
    build_tiny_dsv3,
    build_tiny_llama,
    build_tiny_qwen3,
    compare_run,
    deterministic_chunk,
    gpu_used_mib,
    hf_states,
    installed_release,
    live_config,
    out_dir,
    snakemake,
    table_text,
    write_records,
)

from hsextract.config import load_config, read_config, typed
from hsextract.sglang import patching

pytestmark = pytest.mark.sglang_live

LAYERS = [2, 4, 5]  # SGLang's EAGLE-3 default for the 8-layer tiny models
MAX_LEN = 512


def _lengths(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(20, 400, (n,), generator=g).tolist()
    return [1, MAX_LEN, MAX_LEN + 7, 2, *body][:n]


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> SimpleNamespace:
    """Models built here, records, and HF's states of every record in float32 and bf16."""
    root = tmp_path_factory.mktemp("live")
    dsv3 = build_tiny_dsv3(root / "tiny-dsv3")
    qwen3 = build_tiny_qwen3(root / "tiny-qwen3")
    data = root / "data"
    data.mkdir()
    recs = write_records(data / "shard_00.jsonl", _lengths(20, 1), 4096, 1)
    recs += write_records(data / "shard_01.jsonl", _lengths(16, 2)[4:], 4096, 2)
    clipped = [
        {**r, "input_ids": r["input_ids"][:MAX_LEN], "loss_mask": r["loss_mask"][:MAX_LEN]}
        for r in recs
    ]
    refs = {
        (m.name, dt): hf_states(m, dt, clipped)
        for m in (dsv3, qwen3)
        for dt in (torch.float32, torch.bfloat16)
    }
    return SimpleNamespace(
        root=root,
        dsv3=dsv3,
        qwen3=qwen3,
        inputs=[str(data / "shard_*.jsonl")],
        records={r["id"]: r for r in clipped},
        refs=refs,
    )


def _report(name: str, data: dict | str) -> None:
    """A section of $OUT/report.txt (the device returns at most 8 files)."""
    text = data if isinstance(data, str) else json.dumps(data, indent=2, default=str)
    with open(out_dir() / "report.txt", "a") as f:
        f.write(f"\n===== {name}\n{text}\n")
    print(f"--- {name}\n{text[:6000]}", flush=True)


def _fidelity(live, model: Path, chunks: list[Path], title: str, prenorm: bool = False) -> str:
    sg, hf16, seen = compare_run(
        chunks,
        live.refs[(model.name, torch.float32)],
        live.refs[(model.name, torch.bfloat16)],
        live.records,
        LAYERS,
    )
    assert seen == len(live.records)
    assert ("prenorm" in sg.rows) == prenorm, f"{title}: prenorm state present: {not prenorm}"
    text = table_text(f"{title} ({seen} records)", sg, hf16)
    for layer, s in sg.as_dict().items():
        b = hf16.as_dict()[layer]
        # No further off from HF float32 than HF's own bf16 forward is, within 2x.
        assert s["rel_rms"] <= 2 * b["rel_rms"] + 1e-6, f"{title} {layer}: {s} vs {b}\n{text}"
        assert s["max_abs"] <= 2 * b["max_abs"] + 1e-6, f"{title} {layer}: {s} vs {b}\n{text}"
    return text


def _run_dir(workdir: Path) -> Path:
    """The run dir as a fresh process computes it (what the workflow's own processes see:
    nothing cached from an earlier test's config in this one)."""
    out = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "run-dir", "--configfile", "config.yaml"],
        cwd=workdir, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return workdir / out.stdout.strip()


def _verify(rd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hsextract.cli", "verify", str(rd / "manifest.json")]
    return subprocess.run(cmd, capture_output=True, text=True)


def _sglang_processes(root: Path) -> list[str]:
    """SGLang processes (the server, its scheduler workers) these tests started under
    ``root``, with their command lines."""
    return [
        f"{pid} {cmd}"
        for pid, cmd in processes_under(root).items()
        if "sglang.launch_server" in cmd or "sglang::" in cmd
    ]


def _no_sglang_left(root: Path, timeout: float = 60) -> list[str]:
    """Poll until no SGLang process of ours is left (the watchdog or onsuccess stops the
    server, its workers exit after it); what is left at the deadline."""
    deadline = time.monotonic() + timeout
    while (left := _sglang_processes(root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _end_everything_under(wd: Path) -> list[str]:
    """Stop what a workflow run in ``wd`` may have left (a test cut short by an assert or a
    timeout): its live server through the run dir's record, then any process still
    working under ``wd`` (the workflow, its jobs, watchdogs), TERM then KILL.  Returns what
    was found running, for the report."""
    from hsextract import server

    for state_dir in wd.glob("results/*/state"):
        try:
            server.stop_live(state_dir)
        except Exception as exc:  # noqa: BLE001 - cleanup goes on; the record says why
            print(f"stop_live({state_dir}): {exc}", flush=True)
    left = processes_under(wd)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        while any(Path(f"/proc/{p}").exists() for p in left) and time.monotonic() < deadline:
            time.sleep(0.2)
    return [f"{pid} {cmd}" for pid, cmd in left.items()]


def _workflow_end_to_end(live, name: str, capture: str, *, rerun: bool) -> dict:
    """``snakemake -j1 extract_all`` on the tiny DeepSeek-V3 with ``capture``, every stage
    real, against the installed SGLang release (``livekit.installed_release``: what the
    workflow's own ``launch.release`` picks, ``sglang.version`` being null): patched (or,
    for hooks, left untouched) and both checksums verified, the GPU gated through NVML,
    the launch command checked against that release's declared options, SGLang started,
    chunks extracted and equal to HF's forward, the manifest verified, no server left.
    With ``rerun``, one chunk deleted and redone (exactly one job).  Everything the run
    starts is stopped in a ``finally``.  Returns what the report shows."""
    rel = installed_release()
    wd = live.root / name
    wd.mkdir()
    try:
        return _run_end_to_end(live, wd, rel, name, capture, rerun=rerun)
    finally:
        found = _end_everything_under(wd)
        if found:
            _report(f"{name}: ended after the test", "\n".join(found))


def _run_end_to_end(live, wd: Path, rel, name: str, capture: str, *, rerun: bool) -> dict:
    # Deterministic inference (batch-invariant kernels) for a bit-exact rerun, if the
    # release serves this model with it; else say so and run without.  Its chunked-prefill
    # alignment for the live attention backend is the release's declaration (0.5.14 -
    # 0.5.17: 4096 tokens for triton; hsextract refuses a smaller chunk: it would never
    # schedule a longer record), so these records go unchunked then.
    det = rerun and bool(os.environ.get("HSEXTRACT_LIVE_DET"))
    extra = ["--enable-deterministic-inference"] if det else []
    overrides: dict = {"capture": capture, "sglang.extra_args": LIVE_EXTRA_ARGS + extra}
    if det and (align := deterministic_chunk(rel)) is not None:
        overrides["server.chunked_prefill_size"] = align
    live_config(wd, live.dsv3, live.inputs, **overrides)
    t0 = time.monotonic()
    res = snakemake(wd, "-j1", "extract_all")
    deterministic = bool(extra) and res.returncode == 0
    launch_failed = "Error in rule launch_server" in res.stdout + res.stderr
    if extra and res.returncode != 0 and launch_failed:  # not served so: say so, go on
        _report(f"{name}_deterministic_failed.log", res.stdout[-8000:] + res.stderr[-12000:])
        for f in wd.glob("results/*/logs/server.log"):
            _report(f"{name}_deterministic_server.log", f.read_text()[-20000:])
        live_config(wd, live.dsv3, live.inputs, capture=capture)
        snakemake(wd, "--unlock")
        res = snakemake(wd, "-j1", "extract_all")
    _report(f"{name}.log", res.stdout[-6000:] + res.stderr[-10000:])
    assert res.returncode == 0, res.stderr[-6000:]
    os.chdir(wd)
    rd = _run_dir(wd)
    patch = json.loads((rd / "state" / "patch.json").read_text())
    gate = json.loads((rd / "state" / "gpu_gate.json").read_text())
    srv = json.loads((rd / "state" / "server.json").read_text())
    manifest = json.loads((rd / "manifest.json").read_text())
    shown = {
        "sglang": rel.version,
        "capture": capture,
        "seconds": round(time.monotonic() - t0, 1),
        "deterministic_inference": deterministic,
        "patch": patch,
        "gpu_gate": gate,
        "command_check": srv.get("command_check"),
        "server_version": srv.get("server_version"),
        "argv": srv["spec"]["argv"],
        "totals": manifest["totals"],
    }
    _report(f"{name}_state.json", shown)
    assert patch["version"] == rel.version, (patch, rel.version)
    if capture == "patch":
        # "already-patched" on a machine an earlier run left warm (its SGLang stays patched).
        spec = patching.load_spec(rel.version)
        assert patch["action"] in ("applied", "already-patched"), patch
        assert patch["pristine_sha256"] == spec.pristine_sha256
        assert patch["found_sha256"] == patch["patched_sha256"] == spec.patched_sha256
    else:  # hooks modify no file
        assert patch["action"] == "none", patch
    # The device tool lends an H200 or an H100 for the same call: either is the Hopper card.
    name = gate["gpus"][0]["name"]
    assert gate["nvml"] and len(gate["gpus"]) == 1 and ("H200" in name or "H100" in name)
    assert srv["command_check"]["version"] == rel.version
    assert "--cuda-graph-backend-prefill" in srv["command_check"]["options_checked"]
    assert manifest["totals"]["records"] == len(live.records)
    assert _verify(rd).returncode == 0, _verify(rd).stdout
    shown["audit"] = _audit_passed(rd, name)
    left = _no_sglang_left(live.root)
    assert not left, left
    assert gpu_used_mib() < 2000
    chunks = sorted((rd / "hidden").glob("chunk_*.safetensors"))
    cps = load_config(wd / "config.yaml")["server"]["chunked_prefill_size"]
    title = f"{name}: SGLang {rel.version}, {capture}, chunked prefill {cps}, 8 in flight"
    _report(f"fidelity_{name}.txt", _fidelity(live, live.dsv3, chunks, title))
    if not rerun:
        return shown

    # Rerun one chunk: exactly one extract job; bit-exact with deterministic inference.
    victim = chunks[1]
    before = victim.read_bytes()
    victim.unlink()
    plan = planned_jobs(snakemake(wd, "-n", "extract_all").stdout)
    # The audit follows the manifest (rules/audit.smk): a redone chunk is audited again.
    want = {"extract_chunk": 1, "manifest": 1, "audit": 1, "report_figures": 1, "extract_all": 1}
    assert plan == want, plan
    res = snakemake(wd, "-j1", "extract_all")
    assert res.returncode == 0, res.stderr[-6000:]
    after = victim.read_bytes()
    redone = re.findall(r"^(?:local)?rule extract_chunk:", res.stdout + res.stderr, re.M)
    shown["rerun"] = {
        "deterministic_inference": deterministic,
        "extract_jobs": len(redone),
        "bit_exact": after == before,
        "bytes": len(after),
    }
    _report(f"{name}_rerun_one_chunk.json", shown["rerun"])
    assert len(redone) == 1
    _fidelity(live, live.dsv3, sorted((rd / "hidden").glob("chunk_*.safetensors")), "rerun")
    if deterministic:
        assert after == before, "deterministic inference, yet the rerun chunk differs"
    left = _no_sglang_left(live.root)
    assert not left, left
    return shown


def _audit_passed(rd: Path, name: str) -> dict:
    """The run's own audit (state/audit.json, part of extract_all): passed, every captured
    tensor checked on the GPU the server freed; its figures go to the report."""
    audit = json.loads((rd / "state" / "audit.json").read_text())
    figures = {
        "verdict": audit["verdict"],
        "device": audit["device"],
        "records": len(audit["records"]),
        "tokens": audit["tokens"],
        "seconds": audit["seconds"],
        "forward_s": audit["forward_s"],
        "bound": audit["bound"],
        "layers": audit["layers"],
    }
    _report(f"{name}_audit.json", figures)
    assert audit["verdict"] == "pass", figures
    assert audit["device"].startswith("cuda"), figures
    assert not (rd / "state" / "audit.failed.json").exists()
    return figures


def _audited_workflow(live, model: Path, name: str, fault: str | None) -> dict:
    """``snakemake -j1 extract_all`` through hooks with the audit on (16 records); with
    ``fault`` (a chunk), that chunk's records stored one position late by the server's
    capture (``HSEXTRACT_FAULTS``, ``faults.captured_batch`` in hsextract.sglang.hooks).
    Without it the audit must pass; with it the audit must fail in one sentence naming a
    layer, deleting nothing.  Its figures go to the report."""
    wd = live.root / name
    wd.mkdir()
    try:
        live_config(wd, model, live.inputs, capture="hooks", **{"audit.records": 16})
        env = None
        if fault:
            spec = {"capture": [{"rid": fault, "do": "shift_positions"}],
                    "log": str(wd / "faults.jsonl")}  # fmt: skip
            env = {"HSEXTRACT_FAULTS": json.dumps(spec)}
        t0 = time.monotonic()
        res = snakemake(wd, "-j1", "extract_all", env=env)
        seconds = round(time.monotonic() - t0, 1)
        _report(f"{name}.log", res.stdout[-6000:] + res.stderr[-10000:])
        rd = _run_dir(wd)
        if not fault:
            assert res.returncode == 0, res.stderr[-6000:]
            return {"seconds": seconds, "audit": _audit_passed(rd, name)}
        fired = (wd / "faults.jsonl").read_text() if (wd / "faults.jsonl").exists() else ""
        assert "shift_positions" in fired, "the injected capture fault never fired"
        assert res.returncode != 0, "the audit passed a run whose capture was wrong"
        failed = json.loads((rd / "state" / "audit.failed.json").read_text())
        assert failed["verdict"] == "fail", failed
        sentence = failed["sentence"]
        assert "layer" in sentence or "final" in sentence, sentence
        assert sentence in res.stdout + res.stderr, "the failure sentence was not shown"
        assert not (rd / "state" / "audit.json").exists()
        chunks = sorted((rd / "hidden").glob("chunk_*.safetensors"))
        assert len(chunks) == 3 and (rd / "manifest.json").is_file()
        assert _verify(rd).returncode == 0, _verify(rd).stdout
        shown = {"seconds": seconds, "sentence": sentence, "layers": failed["layers"]}
        _report(f"{name}_audit_failed.json", shown)
        return shown
    finally:
        found = _end_everything_under(wd)
        if found:
            _report(f"{name}: ended after the test", "\n".join(found))


def test_the_audit_passes_a_live_llama_run_and_catches_an_injected_error(live):
    """A tiny Llama (non-uniform norm weights) through hooks: the workflow's audit passes,
    each captured layer's figures reported.  Then the same run with the server's capture
    made wrong at capture time (chunk_00001's records stored one position late; every
    other check passes them): the audit fails in one sentence naming a layer, and deletes
    nothing -- the chunks and the manifest stay, and verify still passes their sha256s."""
    llama = build_tiny_llama(live.root / "tiny-llama")
    _audited_workflow(live, llama, "audit-llama", None)
    _audited_workflow(live, llama, "audit-llama-shifted", "chunk_00001")
    left = _no_sglang_left(live.root)
    assert not left, left
    assert gpu_used_mib() < 2000


def test_the_audit_passes_a_live_qwen3_run(live):
    """The audit on the second architecture the live kit builds (a tiny Qwen3, through
    hooks; DeepSeek-V3 through the patch is group 1's, the Llama group 7's): it passes on
    the GPU the server freed, every captured layer's figures reported."""
    _audited_workflow(live, live.qwen3, "audit-qwen3", None)
    left = _no_sglang_left(live.root)
    assert not left, left
    assert gpu_used_mib() < 2000


def test_the_workflow_end_to_end_on_a_live_sglang(live):
    """snakemake -j1 extract_all through the patch, every stage real: the installed SGLang
    patched and both checksums verified, the GPU gated through NVML, SGLang started, chunks
    extracted and equal to HF's forward, the manifest verified, no server left; then one
    chunk redone (bit-exact with ``HSEXTRACT_LIVE_DET=1``)."""
    _workflow_end_to_end(live, "workflow", "patch", rerun=True)


def test_a_release_end_to_end_hooks_and_patch(live):
    """One SGLang release (the installed one) end to end, as issue 22 asks of each release
    the H200 can run (0.5.14 - 0.5.17): the workflow through hooks on a pristine install
    (SGLang left untouched), then through the patch, each run's every record against HF's
    forward, then one chunk deleted and redone (exactly one job)."""
    rel = installed_release()
    t0 = time.monotonic()
    hooks = _workflow_end_to_end(live, "release-hooks", "hooks", rerun=False)
    patch = _workflow_end_to_end(live, "release-patch", "patch", rerun=True)
    _report(
        f"release {rel.version} end to end",
        {
            "sglang": rel.version,
            "hooks design": rel.hooks,
            "sglang_kernel": rel.sglang_kernel,
            "hooks_seconds": hooks["seconds"],
            "patch_seconds": patch["seconds"],
            "patch_action": patch["patch"]["action"],
            "rerun": patch["rerun"],
            "seconds": round(time.monotonic() - t0, 1),
        },
    )


def _data_stage(live, workdir: Path, model: Path) -> tuple[dict, Path]:
    """Merge and split once (the CPU data stage, real rules); the chunk files to feed servers."""
    live_config(workdir, model, live.inputs)
    os.chdir(workdir)
    cfg = load_config("config.yaml")
    rd = _run_dir(workdir)
    res = snakemake(workdir, "-j1", str(rd / "chunks" / "index.json"))
    assert res.returncode == 0, res.stderr[-4000:]
    return cfg, rd


def _start_all(specs: dict) -> tuple[dict, dict, float]:
    """Start every server at once (each a separate process on the one GPU): their states,
    the exceptions of those that did not start (reported with their logs), seconds."""
    from hsextract import server

    states, errors = {}, {}

    def start(key):
        try:
            states[key] = server.start(specs[key], owner=os.getpid())
        except Exception as exc:
            errors[key] = exc

    t0 = time.monotonic()
    threads = [threading.Thread(target=start, args=(k,)) for k in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return states, errors, time.monotonic() - t0


def _extract_all(cfg: dict, rd: Path, out: Path, state: dict) -> list[Path]:
    """Every chunk of the run through the real client, against one running server."""
    from hsextract.client import extract_chunk

    outs = []
    for c in sorted((rd / "chunks").glob("chunk_*.jsonl")):
        f = out / f"{c.stem}.safetensors"
        extract_chunk(
            cfg, chunk_path=c, index_path=rd / "chunks" / "index.json",
            out_path=f, sidecar_path=f.with_suffix(".json"),
            ensure=lambda: state, progress=False,
        )  # fmt: skip
        outs.append(f)
    return outs


def test_fidelity_across_chunking_batching_capture_and_architectures(live):
    """Chunked prefill off / 64 / 257 x patch / hooks on DeepSeek-V3, hooks on Qwen3, each
    server queried with 1 and with 8 requests in flight: every record, every layer, against
    HF's forward of the same weights.  The servers share the GPU (a fixed KV pool each)
    and start at once."""
    from hsextract import server
    from hsextract.steps import _installed_sglang_root

    wd = live.root / "matrix"
    wd.mkdir()
    base, rd = _data_stage(live, wd, live.dsv3)
    patching.apply(_installed_sglang_root(base))  # "already patched" after the workflow test
    cells = [
        (m, cps, cap, "") for m in ("dsv3",) for cps in (-1, 64, 257) for cap in ("patch", "hooks")
    ]
    cells.append(("qwen3", 64, "hooks", ""))
    # prenorm_final (the last layer's output before the final norm), both capture modes.
    cells += [("dsv3", 64, "patch", "prenorm"), ("dsv3", 64, "hooks", "prenorm")]
    specs = {}
    for cell in cells:
        model, cps, cap, extra = cell
        name = "-".join(str(x) for x in cell if x != "")
        cfg = copy.deepcopy(base)
        cfg["model"]["path"] = str(getattr(live, model))
        cfg["capture"] = cap
        cfg["prenorm_final"] = extra == "prenorm"
        cfg["server"]["chunked_prefill_size"] = cps
        cfg["dump"]["dir"] = str(wd / f"dump-{name}")
        spec = server.build_spec(typed(cfg), run_dir=rd, log_path=wd / f"{name}.log")
        specs[cell] = (cfg, spec)

    states, errors, started_s = _start_all({c: spec for c, (_, spec) in specs.items()})
    results: dict = {}

    def run_cell(cell) -> None:
        """Both in-flight settings against one server; each result reported at once (the
        run may be stopped by its time limit: what ran must still be on record)."""
        model = getattr(live, cell[0])
        for in_flight in (1, 8):
            cfg = copy.deepcopy(specs[cell][0])
            cfg["client"]["requests_in_flight"] = in_flight
            t1 = time.monotonic()
            name = "-".join(str(x) for x in cell if x != "")
            outs = _extract_all(typed(cfg), rd, wd / f"{name}-{in_flight}", states[cell])
            seconds = round(time.monotonic() - t1, 2)
            title = (
                f"{cell[0]}, capture {cell[2]}, chunked prefill {cell[1]}, {in_flight} in flight"
                + (", prenorm_final" if cell[3] else "")
            )
            try:
                results[(cell, in_flight)] = _fidelity(live, model, outs, title, bool(cell[3]))
            except AssertionError as exc:
                results[(cell, in_flight)] = exc
            _report(f"fidelity {title} ({seconds} s)", str(results[(cell, in_flight)]))

    try:
        assert not errors, {c: str(e)[-3000:] for c, e in errors.items()}
        _report("fidelity matrix: servers healthy", f"{len(states)} servers in {started_s:.0f} s")
        # The servers are separate processes: drive them all at once.
        threads = [threading.Thread(target=run_cell, args=(c,)) for c in cells]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for st in states.values():
            server.stop(st)
        for cell in errors:
            log = Path(specs[cell][1].log_path).read_text()[-20000:]
            _report(f"server-{'-'.join(str(x) for x in cell if x != '')}.log", log)
    failed = {k: v for k, v in results.items() if not isinstance(v, str)}
    assert not failed, failed
    assert len(results) == 2 * len(cells)


def test_real_faults_a_killed_server_and_a_busy_gpu(live):
    """SIGKILL the SGLang server mid-chunk: ensure() relaunches it and the run completes.
    A process holding GPU memory: the gate refuses and names its PID."""
    wd = live.root / "faults"
    wd.mkdir()
    live_config(
        wd,
        live.dsv3,
        live.inputs,
        **{"client.retries": 4, "client.backoff_s": 3.0, "gpu.wait_s": 120},
    )
    os.chdir(wd)
    cfg = read_config("config.yaml")
    from hsextract.config import dump_dir
    from hsextract.server import live_path

    rd = _run_dir(wd)
    proc = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "-s", str(Path(__file__).parents[2] / "Snakefile"),
         "--directory", str(wd), "--scheduler", "greedy", "-j1", "extract_all"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    killed = None
    try:
        ddir = dump_dir(cfg)
        deadline = time.monotonic() + 400
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            live_state = live_path(rd / "state")
            # Mid-chunk: a request's pieces are in the dump dir.
            if live_state.exists() and ddir.exists() and any(ddir.glob("chunk_*")):
                state = json.loads(live_state.read_text())
                os.killpg(int(state["pgid"]), signal.SIGKILL)  # the server and its workers
                killed = state["pid"]
            time.sleep(0.005)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    server_log = (rd / "logs" / "server.log").read_text()
    chunk_logs = "\n".join(
        f.read_text()[-3000:] for f in sorted((rd / "logs").glob("extract_chunk_*.log"))
    )
    _report("fault_sigkill.log", out[-8000:] + "\n--- chunk logs\n" + chunk_logs[-12000:])
    assert killed is not None, "never caught a chunk mid-extraction"
    assert proc.returncode == 0, out[-6000:]
    assert "replacing the server" in chunk_logs or server_log.count("==== ") >= 2
    assert _verify(rd).returncode == 0, _verify(rd).stdout
    left = _no_sglang_left(live.root)
    assert not left, left

    # A process holding ~3 GiB of the GPU: the gate refuses and names it.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import torch, time; x = torch.empty(3 << 30, dtype=torch.uint8, "
         "device='cuda'); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        gate = subprocess.run(
            [sys.executable, "-m", "hsextract.cli", "gpu-gate", "--require-nvml",
             "--max-used-mib", "2000"], capture_output=True, text=True,
        )  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    _report("fault_busy_gpu.txt", gate.stdout + gate.stderr)
    assert gate.returncode == 1
    assert f"PID {holder.pid}" in gate.stderr and "MiB used" in gate.stderr
