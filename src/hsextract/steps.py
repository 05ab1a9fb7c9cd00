"""One function per workflow stage: map a Snakemake job's files to the library calls.

Kept here, not in the rules, so each stage is importable, typed and testable; the scripts
under ``scripts/`` are two lines that hand their ``snakemake`` object to these.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from hsextract.config import (
    RUN_MARKER,
    dump_dir,
    fingerprint,
    public_config,
    read_model_config,
    run_dir,
)
from hsextract.server import write_json

log = logging.getLogger("hsextract")


def _mark_run_dir(cfg: dict) -> Path:
    rd = run_dir(cfg)
    rd.mkdir(parents=True, exist_ok=True)
    marker = rd / RUN_MARKER
    if not marker.exists():
        write_json(marker, {"fingerprint": fingerprint(cfg), "config": public_config(cfg)})
    return rd


def demo_data(sm: Any) -> None:
    from hsextract.demo import build_demo_data

    build_demo_data(
        [Path(p) for p in sm.output.shards], sm.params.demo, sm.params.max_seq_len, sm.params.seed
    )


def demo_model(sm: Any) -> None:
    from hsextract.demo import build_demo_model

    build_demo_model(
        Path(sm.output.config).parent, sm.params.demo, sm.params.max_seq_len, sm.params.seed
    )


def merge_and_shuffle(sm: Any) -> None:
    from hsextract.records import merge_and_shuffle as merge

    _mark_run_dir(sm.config)
    vocab = read_model_config(sm.config).get("vocab_size")
    stats = merge(
        list(sm.input.shards),
        Path(sm.output.train).parent,
        max_seq_len=sm.params.max_seq_len,
        overlength=sm.params.overlength,
        seed=sm.params.seed,
        vocab_size=int(vocab) if vocab else None,
        max_reject_fraction=sm.params.max_reject_fraction,
    )
    log.info(
        "merged: %s", json.dumps({k: v for k, v in stats.items() if not isinstance(v, dict | list)})
    )


def split_chunks(sm: Any) -> None:
    from hsextract.records import split_chunks as split

    split(Path(sm.input.train), [Path(p) for p in sm.output.chunks], Path(sm.output.index))


def delete_stale_states(sm: Any) -> None:
    from hsextract.stale import delete_stale

    cfg = sm.config
    delete_stale(
        Path(cfg["output_root"]),
        fingerprint(cfg),
        dump_root=dump_dir(cfg).parent,
        keep_runs=sm.params.keep_runs,
        dry_run=sm.params.dry_run,
        report_out=Path(sm.output.report),
    )


def preflight_budget(sm: Any) -> None:
    from hsextract.budget import preflight
    from hsextract.client import model_geometry

    cfg = sm.config
    index = json.loads(Path(sm.input.index).read_text())
    chunks = index["chunks"] if isinstance(index, dict) else index
    geo = model_geometry(cfg)
    report = preflight(
        total_tokens=sum(int(c["tokens"]) for c in chunks),
        max_len=max((int(c.get("max_len", 0)) for c in chunks), default=0),
        hidden_size=geo.hidden_size,
        n_aux=len(geo.aux_layers),
        dtype=cfg["model"]["dtype"],
        output_root=Path(cfg["output_root"]),
        dump_dir=dump_dir(cfg),
        requests_in_flight=cfg["client"]["requests_in_flight"],
        shm_budget_bytes=int(float(cfg["dump"]["shm_budget_gb"]) * 2**30),
    )
    write_json(Path(sm.output.report), report)


def apply_patch(sm: Any) -> None:
    """SGLang: patch the configured env's sglang.  Reference: verify the patch on a copy."""
    from hsextract import patching

    cfg = sm.config
    if cfg["engine"] == "sglang" and cfg.get("capture", "patch") == "patch":
        report = _as_dict(patching.apply(_installed_sglang_root(cfg)))
    elif cfg["engine"] == "sglang":
        report = {
            "action": "none",
            "reason": "capture: hooks needs no patch; sglang left untouched",
        }
    else:
        report = _verify_patch_on_pinned_copy()
    write_json(Path(sm.output.state), report)


def _verify_patch_on_pinned_copy() -> dict:
    import shutil

    from hsextract import patching

    base = {
        "engine": "reference",
        "note": "the reference engine calls hsextract.capture directly; no installed "
        "package was touched. The patch was applied to a temporary copy of the pinned "
        "sglang source to prove it still applies and verifies.",
    }
    try:
        src = patching.ensure_pinned_source()
    except Exception as exc:  # offline laptop: say so, do not fail the demo
        return {**base, "action": "skipped", "reason": f"pinned sglang source unavailable: {exc}"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "sglang"
        shutil.copytree(src / "sglang" / "srt" / "models", root / "srt" / "models")
        for f in (src / "sglang").glob("*.py"):  # _version.py names the release
            shutil.copy2(f, root / f.name)
        steps = {
            "apply": _as_dict(patching.apply(root)),
            "verify": _as_dict(patching.verify(root)),
            "revert": _as_dict(patching.revert(root)),
        }
    return {**base, "action": "verified-on-copy", **steps}


def _as_dict(result: Any) -> dict:
    import dataclasses

    out = dataclasses.asdict(result) if dataclasses.is_dataclass(result) else dict(result)
    return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}


def _installed_sglang_root(cfg: dict) -> Path:
    """The sglang package dir of the env named in config (never ours: it is the user's)."""
    import subprocess

    from hsextract.errors import HsextractError

    python = cfg.get("sglang", {}).get("python", "python3")
    # find_spec, not import: importing sglang would initialise CUDA libraries for nothing.
    code = (
        "import importlib.util as u; s = u.find_spec('sglang'); "
        "print(s.submodule_search_locations[0])"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise HsextractError(
            f"cannot import sglang with {python} (sglang.python): {proc.stderr.strip()[-300:]}"
        )
    return Path(proc.stdout.strip())


def gpu_gate(sm: Any) -> None:
    from hsextract.gpu import gate

    cfg = sm.config
    report = gate(
        cfg["gpu"]["max_used_mib"], cfg["gpu"]["wait_s"], require_nvml=cfg["engine"] == "sglang"
    )
    if cfg["engine"] == "reference":
        report["engine_device"] = cfg["server"]["device"]
    write_json(Path(sm.output.state), report)


def _gate_for(cfg: dict):
    if cfg["engine"] != "sglang":
        return None
    from hsextract.gpu import gate

    return lambda: gate(cfg["gpu"]["max_used_mib"], cfg["gpu"]["wait_s"], require_nvml=True)


def _export_api_key(cfg: dict) -> None:
    key = cfg["server"].get("api_key")
    if key:
        os.environ["HSEXTRACT_API_KEY"] = key


def launch_server(sm: Any) -> None:
    from hsextract import server

    cfg = sm.config
    rd = _mark_run_dir(cfg)
    _export_api_key(cfg)
    state_dir = Path(sm.output.state).parent
    server.stop_live(state_dir)  # a server of an earlier launch of this run: replace it
    spec = server.build_spec(cfg, run_dir=rd, log_path=rd / "logs" / "server.log")
    state = server.start(spec)
    server.write_json(server.live_path(state_dir), state)
    log.info("server healthy at %s (pid %s)", state["url"], state["pid"])
    server.write_json(Path(sm.output.state), state)


def extract_chunk(sm: Any) -> None:
    from hsextract import server
    from hsextract.client import extract_chunk as extract

    cfg = sm.config
    _export_api_key(cfg)
    server_json = Path(sm.input.server)

    def ensure() -> dict:
        return server.ensure(server_json, gate=_gate_for(cfg))

    sidecar = extract(
        cfg,
        chunk_path=Path(sm.params.chunk),
        index_path=Path(sm.input.index),
        merged_path=Path(sm.input.merged),
        out_path=Path(sm.output.hidden),
        sidecar_path=Path(sm.output.sidecar),
        ensure=ensure,
    )
    log.info("chunk done: %s", json.dumps(sidecar))
    # The log holds the progress bar; the terminal gets one line per finished chunk.
    sys.__stderr__.write(
        f"hsextract [{sidecar['chunk']}]: {sidecar['records']} records, {sidecar['tokens']} "
        f"tokens in {sidecar['seconds']:.1f}s ({sidecar['tokens_per_s']:.0f} tok/s)\n"
    )


def manifest(sm: Any) -> None:
    from hsextract.manifest import build_manifest

    build_manifest(
        [Path(p) for p in sm.input.sidecars],
        stats=Path(sm.input.stats),
        out=Path(sm.output.manifest),
        cfg=sm.config,
    )
