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
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hsextract.config import (
    RUN_MARKER,
    Config,
    dump_dir,
    fingerprint,
    public_config,
    read_model_config,
    run_dir,
    typed,
)
from hsextract.procs import pid_alive
from hsextract.server import write_json

log = logging.getLogger("hsextract")


def _mark_run_dir(cfg: Config) -> Path:
    rd = run_dir(cfg)
    rd.mkdir(parents=True, exist_ok=True)
    marker = rd / RUN_MARKER
    if not marker.exists():
        write_json(marker, {"fingerprint": fingerprint(cfg), "config": public_config(cfg)})
    return rd


def write_settings(path: Path, values: dict) -> None:
    """The settings file a stage's outputs were made with (its name is their digest, see
    rules/common.smk); earlier ones of the same stage go."""
    path = Path(path)
    stage = path.name.rsplit("-", 1)[0]
    for old in path.parent.glob(f"{stage}-*.json"):
        if old != path and not old.is_symlink():
            old.unlink(missing_ok=True)
    write_json(path, values)


def demo_data(sm: Any) -> None:
    from hsextract.demo import build_demo_data
    from hsextract.records import input_identity

    build_demo_data([Path(p) for p in sm.output.shards], sm.params.demo, sm.params.max_seq_len)
    # The shards as made: one changed in place later, whatever its mtime, reruns the merge
    # (records.identity_as_made).
    made = {"demo": sm.params.demo, "max_seq_len": sm.params.max_seq_len}
    shards = input_identity(sm.output.shards, content=True)
    write_settings(Path(sm.output.settings), {**made, "shards": shards})


def demo_model(sm: Any) -> None:
    from hsextract.demo import build_demo_model

    build_demo_model(Path(sm.output.config).parent, sm.params.demo)
    write_settings(Path(sm.output.settings), {"demo": sm.params.demo})


def merge_and_shuffle(sm: Any) -> None:
    from hsextract.records import merge_and_shuffle as merge

    cfg = typed(sm.config)
    _mark_run_dir(cfg)
    vocab = read_model_config(cfg).get("vocab_size")
    stats = merge(
        list(sm.input.shards),
        Path(sm.output.train).parent,
        max_seq_len=sm.params.settings["max_seq_len"],
        overlength=sm.params.settings["overlength"],
        seed=sm.params.settings["seed"],
        vocab_size=int(vocab) if vocab else None,
        # Not a param: it decides whether the merge fails, not what it writes.
        max_reject_fraction=cfg.merge.max_reject_fraction,
        # Beside the published files, where a person looks (the outputs are staged).
        failed_rejects=Path(sm.params.failed_rejects),
    )
    log.info(
        "merged: %s", json.dumps({k: v for k, v in stats.items() if not isinstance(v, dict | list)})
    )
    if stats["rejected"]:
        _warn_rejects(stats, Path(sm.output.rejects))
    _warn_overlength(stats, cfg.merge.warn_overlength_fraction, sm.params.max_seq_len_from)
    write_settings(Path(sm.output.settings), sm.params.settings)


def publish_merge(sm: Any) -> None:
    """The merge's staged outputs under the names every reader uses (records.publish)."""
    from hsextract.records import publish

    names = ("train", "stats", "rejects")
    publish([Path(sm.input[n]) for n in names], [Path(sm.output[n]) for n in names])


def overlength_warning(stats: dict, bound: float, source: str) -> str | None:
    """The sentence for more than ``bound`` of the records cut or dropped at max_seq_len,
    naming where max_seq_len came from; None within it.

    Said on the terminal, not only in the merge's log: a max_seq_len from another config
    file (the demo's 512 under a user's file) cut 20 of 30 records without a word there.
    """
    params = stats["params"]
    cut, dropped = stats["truncated"], stats["dropped_over_length"]
    n, total = cut + dropped, stats["records_in"]
    if not total or n / total <= bound:
        return None
    what = "truncated to it" if not dropped else "dropped"
    if cut and dropped:
        what = f"truncated ({cut}) or dropped ({dropped})"
    return (
        f"{n} of {total} records ({n / total:.1%}) were longer than max_seq_len "
        f"{params['max_seq_len']} (from {source}) and {what}, more than "
        f"merge.warn_overlength_fraction={bound}: if that max_seq_len is not meant for this "
        "data, set it in your config and rerun (the merge reruns, and the server's context "
        "length follows it)"
    )


def _warn_overlength(stats: dict, bound: float, source: str) -> None:
    msg = overlength_warning(stats, bound, source)
    if msg is not None:
        log.warning("%s", msg)
        sys.__stderr__.write(f"hsextract [merge_and_shuffle]: {msg}\n")


def _warn_rejects(stats: dict, rejects_path: Path) -> None:
    """Rejects within merge.max_reject_fraction still reach the terminal, with the first
    few lines' file, line and reason: a silently smaller dataset is a surprise later."""
    from itertools import islice

    from hsextract.records import reject_examples

    with open(rejects_path) as f:
        first = [json.loads(line) for line in islice(f, 20)]
    # Named as published (merged/rejects.jsonl, publish_merge's), where the user looks:
    # the staged copy under merged/.next/ is replaced by the next merge.
    published = rejects_path.parent.parent / rejects_path.name
    msg = (
        f"{stats['rejected']} of {stats['records_in']} records rejected, within "
        f"merge.max_reject_fraction: {reject_examples(first, total=stats['rejected'])}; all in "
        f"{published}"
    )
    log.warning("%s", msg)
    sys.__stderr__.write(f"hsextract [merge_and_shuffle]: {msg}\n")


def split_chunks(sm: Any) -> None:
    from hsextract.records import split_chunks as split

    split(Path(sm.input.train), [Path(p) for p in sm.output.chunks], Path(sm.output.index))
    write_settings(Path(sm.output.settings), sm.params.settings)


def delete_stale_states(sm: Any) -> None:
    from hsextract.server import owner_pid
    from hsextract.stale import delete_stale

    cfg, settings = typed(sm.config), sm.params.settings
    report = delete_stale(
        Path(cfg.output_root),
        run_dir(cfg),
        dump_root=dump_dir(cfg).parent,
        keep_runs=settings["keep_runs"],
        dry_run=settings["dry_run"],
        delete_finished=settings["delete_finished"],
        report_out=Path(sm.output.report),
        owner_pid=owner_pid(),
    )
    for item in report["removed"]:
        log.info("removed %s (%s, %d bytes)", item["path"], item["kind"], item["bytes"])
    for item in report["kept"]:
        log.info("kept %s: %s", item["path"], item["why"])
    write_settings(Path(sm.output.settings), settings)


def preflight_budget(sm: Any) -> None:
    from hsextract import dp
    from hsextract.budget import preflight
    from hsextract.client import model_geometry
    from hsextract.plan import chunk_states
    from hsextract.records import read_index
    from hsextract.window import for_run

    cfg = typed(sm.config)
    chunks = read_index(Path(sm.input.index))["chunks"]
    # Only what will be written counts: a rerun of one chunk of a 5 TB run needs one
    # chunk's space, not the run's.
    # No hashing here: plan_chunks re-hashes a chunk written to since its extraction.
    states = chunk_states(run_dir(cfg), Path(sm.input.index), fingerprint(cfg), rehash=False)
    todo = [c for c, s in zip(chunks, states, strict=True) if not s.current]
    geo = model_geometry(cfg)
    max_len = max((int(c.get("max_len", 0)) for c in todo), default=0)
    report = preflight(
        total_tokens=sum(int(c["tokens"]) for c in todo),
        max_len=max_len,
        hidden_size=geo.hidden_size,
        n_aux=len(geo.aux_layers),
        dtype=cfg.model.dtype,
        output_root=Path(cfg.output_root),
        dump_dir=dump_dir(cfg),
        # Both per DP replica; of the longest records, as many as the token window holds.
        requests_in_flight=for_run(cfg).worst_case_requests(max_len) * dp.dp_size(cfg),
        shm_budget_bytes=dp.shm_budget_bytes(cfg),
        chunked_prefill_size=cfg.server.chunked_prefill_size,
        # Under a disk budget the stream frees what the trainer acked: the disk must hold
        # the budget and one chunk past it, not the run (budget.preflight).
        stream_budget_bytes=_stream_budget_bytes(cfg),
        largest_chunk_tokens=max((int(c["tokens"]) for c in todo), default=0),
    )
    report["chunks_to_extract"] = len(todo)
    write_json(Path(sm.output.report), report)


def _stream_budget_bytes(cfg: Config) -> int | None:
    """stream.budget_gb in bytes, as the gate counts them; None offline (the stream
    package is then not imported)."""
    if cfg.stream.budget_gb is None:
        return None
    from hsextract.stream.gate import settings_of

    ss = settings_of(cfg)
    return None if ss is None else ss.budget_bytes


def apply_patch(sm: Any) -> None:
    """SGLang: patch the configured env's sglang.  Reference: verify the patches on copies."""
    from hsextract.sglang import patching

    cfg = typed(sm.config)
    if cfg.engine == "sglang":
        from hsextract.sglang.launch import release

        rel = release(cfg)
        root = _installed_sglang_root(cfg)
        installed = patching.installed_version(root)
        if installed != rel.version:
            raise patching.PatchError(
                f"sglang.version says {rel.version}, {root} is sglang {installed}; fix "
                "sglang.version (or leave it null to use what is installed)"
            )
        if cfg.capture == "patch":
            report = _as_dict(patching.apply(root))
        else:
            report = {
                "action": "none",
                "version": rel.version,
                "path": str(root),
                "reason": f"capture: hooks ({rel.hooks}) needs no patch; sglang left untouched",
            }
    else:
        report = _verify_patches_on_pinned_copies()
    write_json(Path(sm.output.state), report)


def _verify_patches_on_pinned_copies() -> dict:
    """Every supported release's patch applied, verified and reverted on a temporary copy
    of that release's source: the demo proves the patches still fit."""
    import shutil

    from hsextract.sglang import patching, versions

    out: dict[str, Any] = {
        "engine": "reference",
        "note": "the reference engine calls hsextract.capture directly; no installed "
        "package was touched. Each patch was applied to a temporary copy of its release's "
        "sglang source to prove it still applies and verifies.",
        "action": "verified-on-copy",
        "versions": {},
    }
    for version in versions.known():
        try:
            src = patching.ensure_pinned_source(version)
        except Exception as exc:  # offline laptop: say so, do not fail the demo
            out["versions"][version] = {"action": "skipped", "reason": f"unavailable: {exc}"}
            out["action"] = "partly-skipped"
            continue
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "sglang"
            shutil.copytree(src / "sglang" / "srt" / "models", root / "srt" / "models")
            for f in (src / "sglang").glob("*.py"):  # _version.py names the release
                shutil.copy2(f, root / f.name)
            out["versions"][version] = {
                "apply": _as_dict(patching.apply(root)),
                "verify": _as_dict(patching.verify(root)),
                "revert": _as_dict(patching.revert(root)),
            }
    return out


def _as_dict(result: Any) -> dict:
    import dataclasses

    out = dataclasses.asdict(result) if dataclasses.is_dataclass(result) else dict(result)
    return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}


def _installed_sglang_root(cfg: Config) -> Path:
    """The sglang package dir of the env named in config (never ours: it is the user's)."""
    from hsextract.sglang.launch import installed_root

    return installed_root(cfg.sglang.python)


def gpu_gate(sm: Any) -> None:
    from hsextract.dp import server_gpus
    from hsextract.gpu import gate

    cfg = typed(sm.config)
    if getattr(sm.params, "per_node", False):
        # The head node of a cluster run has no GPU of the run: each node allocation
        # gates its own before its server starts (ensure() runs _gate_for's check).
        report = {
            "ok": True,
            "per_node": True,
            "gpus": [],
            "message": "chunk jobs run on cluster nodes: each node allocation checks its "
            "GPUs before it starts its server",
        }
        write_json(Path(sm.output.state), report)
        return
    sglang = cfg.engine == "sglang"
    report = gate(
        cfg.gpu.max_used_mib,
        cfg.gpu.wait_s,
        require_nvml=sglang,
        required=server_gpus(cfg) if sglang else None,  # dp x tp
    )
    if not sglang:
        report["engine_device"] = cfg.server.device
    write_json(Path(sm.output.state), report)


def _gate_for(cfg: Config):
    """What must hold on this node before an SGLang server starts here: its GPUs are
    clean, and with ``capture: patch`` the SGLang it will run is patched.  On a cluster the
    head node patched the env it sees; a node whose env is another one (node-local) fails
    here in seconds, not after a model load that would dump nothing."""
    if cfg.engine != "sglang":
        return None
    from hsextract.dp import server_gpus
    from hsextract.gpu import gate

    def check() -> None:
        gate(
            cfg.gpu.max_used_mib,
            cfg.gpu.wait_s,
            require_nvml=True,
            required=server_gpus(cfg),  # dp x tp; in an allocation, its GPUs
        )
        if cfg.capture == "patch":
            _verify_patch_here(cfg)

    return check


def _verify_patch_here(cfg: Config) -> None:
    import socket

    from hsextract.sglang import patching

    root = _installed_sglang_root(cfg)
    try:
        patching.verify(root)
    except patching.PatchError as exc:
        raise patching.PatchError(
            f"on {socket.gethostname()}: {exc}. This node's SGLang ({root}) is not the "
            "patched one: share one env on the cluster's filesystem (the head node "
            f"patches it), run `hsextract patch apply --sglang-root {root}` on every node, "
            "or use capture: hooks"
        ) from exc


def _export_api_key(cfg: Config) -> None:
    if cfg.server.api_key:
        os.environ["HSEXTRACT_API_KEY"] = cfg.server.api_key


def ensure_server(cfg: Config, *, wait: bool = True, detached: bool = False) -> dict:
    """This host's live server for the config's run and settings, started if need be.

    With ``wait`` (chunk jobs), once it is healthy, waiting for one still loading; without
    (``launch_server``), as soon as it is started (``server.ensure``).  ``detached``
    (``hsextract server start``): one started now runs until ``hsextract server stop``.
    """
    from hsextract import server

    rd = run_dir(cfg)
    _export_api_key(cfg)
    spec = server.build_spec(cfg, run_dir=rd, log_path=_server_log(rd))
    gate = _gate_for(cfg)
    if os.environ.get("SLURM_JOB_ID"):
        gate = _with_node_cleanup(gate, Path(spec.dump_dir), rd / "state")
    return server.ensure(
        spec,
        rd / "state",
        gate=gate,
        probes=cfg.server.health_probes,
        interval_s=cfg.server.probe_interval_s,
        wait=wait,
        detached=detached,
    )


def _with_node_cleanup(gate, dump: Path, state_dir: Path):
    """Before an allocation's server starts: clear what a cancelled allocation of this run
    left in this node's dump dir (its in-flight pieces, up to dump.shm_budget_gb of RAM).

    Stale deletion runs on the head node and never sees a compute node's /dev/shm; the
    next allocation of the run on the node does it here, under ensure()'s lock.  Not while
    another server of this run on this host is alive (a shared node, or several slurmd on
    one host): the pieces may be its own.
    """
    import socket

    from hsextract import server, stale

    def check() -> None:
        if gate is not None:
            gate()
        ours = server.live_path(state_dir)
        if ours.exists():
            return  # a relaunch mid-chunk: the pieces of our finished requests are needed
        for path in Path(state_dir).glob(f"server.{socket.gethostname()}*.live.json"):
            other = server.read_json(path)
            if other and pid_alive(other.get("pid")):
                return
        if not dump.is_dir() or dump.is_symlink() or dump.stat().st_uid != os.getuid():
            return
        # Request dirs only: the dot entries are the marker (and its temp file while
        # another allocation on this host starts its server now, not yet live), the
        # ledger, which heals itself, and the tombstones.  A server that is not live has
        # no client, so no request dir here is in use.  Only what the capture protocol
        # writes goes: a user's file in an adopted dump.dir stays.
        stale.clear_requests(dump)

    return check


def _server_log(rd: Path) -> Path:
    """logs/server.log; one per allocation inside a SLURM job (logs/servers/<host>.job<N>.log):
    64 nodes appending to one file on a shared filesystem would interleave their lines."""
    from hsextract import server

    if os.environ.get("SLURM_JOB_ID"):
        return rd / "logs" / "servers" / f"{server.host_key()}.log"
    return rd / "logs" / "server.log"


def check_sglang_command(cfg: Config, argv: list[str]) -> dict:
    """Every option of the launch command, checked against the installed release's own
    declarations before anything starts (a wrong flag otherwise costs an 8-GPU start)."""
    from hsextract.sglang import flags
    from hsextract.sglang.launch import release

    rel = release(cfg)
    root = _installed_sglang_root(cfg)
    seen = flags.check_argv(argv, flags.declared_flags(root, rel), rel.version)
    log.info("sglang %s at %s declares all %d options of the command", rel.version, root, len(seen))
    return {"version": rel.version, "sglang_root": str(root), "options_checked": seen}


def launch_server(sm: Any) -> None:
    """Record the launch spec; start the server only if some chunk needs extracting.

    It does not wait for the server to load: the plan and the chunk jobs start meanwhile,
    and each chunk job's ``ensure()`` waits for it to answer /health (a load that fails
    is reported there, with the server log's last lines).  The GPU gate, the command check
    and the dump dir run here, before it starts.

    A data change whose chunks are all current (records whose extra keys changed, say)
    re-plans without starting an 8-GPU server; a chunk job that needs one later starts it
    through ``ensure()``.  A live server of this run with other settings is replaced.
    """
    from hsextract import server
    from hsextract.plan import chunk_states

    cfg = typed(sm.config)
    rd = _mark_run_dir(cfg)
    _export_api_key(cfg)
    spec = server.build_spec(cfg, run_dir=rd, log_path=rd / "logs" / "server.log")
    checked = check_sglang_command(cfg, spec.argv) if cfg.engine == "sglang" else {}
    # No hashing here: plan_chunks re-hashes a chunk written to since its extraction.
    states = chunk_states(rd, Path(sm.input.index), fingerprint(cfg), rehash=False)
    todo = [s.chunk for s in states if not s.current]
    if todo and getattr(sm.params, "per_node", False):
        state = {
            "started": False,
            "reason": "chunk jobs run on cluster nodes: each node allocation starts its own "
            "server (its first chunk job, through ensure())",
            "spec": asdict(spec),
        }
        log.info("cluster run: the head node starts no server; each node allocation does")
    elif todo:
        state = ensure_server(cfg, wait=False)
        log.info(
            "server %s at %s (pid %s)%s",
            "healthy" if state.get("healthy_at") else "starting",
            state["url"],
            state["pid"],
            "" if state.get("healthy_at") else ": chunk jobs wait for it to answer /health",
        )
    else:
        state = {"started": False, "reason": "every chunk is current", "spec": asdict(spec)}
        log.info("every chunk is current: the server is not started")
    state = {**state, "chunks_to_extract": len(todo), "command_check": checked}
    server.write_json(Path(sm.output.state), state)
    write_settings(Path(sm.output.settings), sm.params.settings)


def note_changed_chunks(sm: Any) -> None:
    from hsextract.plan import note_changed

    found = note_changed(run_dir(typed(sm.config)), Path(sm.output.note))
    log.info("chunk files written to after their extraction: %s", found or "none")


def plan_chunks(sm: Any) -> None:
    from hsextract.plan import check_data_matches_config, make_plan, summary

    cfg = typed(sm.config)
    check_data_matches_config(cfg, Path(sm.input.index), Path(sm.input.stats))
    plan = make_plan(run_dir(cfg), Path(sm.input.index), fingerprint(cfg), Path(sm.output.plan))
    text = summary(plan)
    log.info("plan: %s", text)
    sys.__stderr__.write(f"hsextract [plan]: {text}\n")


def extract_chunk(sm: Any) -> None:
    from hsextract import server
    from hsextract.client import extract_chunk as extract
    from hsextract.procs import lower_priority

    cfg = typed(sm.config)
    # The job's process, before it starts its threads (they inherit it): the server first
    # for a core both want (client.nice; README, "The server first for the CPU").
    lower_priority(cfg.client.nice)
    # Where the chunk ran: on a cluster, the node and SLURM job whose server it used
    # (logs/servers/<this>.log); a cancelled allocation's chunks are found by it.
    log.info("chunk job on %s", server.host_key())
    recorded = (server.read_json(Path(sm.input.server)) or {}).get("spec")
    want = server.spec_settings(cfg)
    if recorded is not None and recorded.get("settings") != want:
        log.warning(
            "the server settings in the config differ from %s's; the chunk runs with the "
            "config's (ensure() replaces a live server started otherwise)",
            sm.input.server,
        )
    if _stream_restored(cfg, sm):  # announced before an interruption: nothing to extract
        return
    stream = _stream_gate(cfg, sm)  # train while extracting: wait for room before sending
    sidecar = extract(
        cfg,
        chunk_path=Path(sm.params.chunk),
        index_path=Path(sm.input.index),
        merged_path=Path(sm.input.merged),
        out_path=Path(sm.params.hidden),
        sidecar_path=Path(sm.output.sidecar),
        ensure=lambda: ensure_server(cfg),
    )
    log.info("chunk done: %s", json.dumps(sidecar))
    if stream is not None and _pass_of(sm) == 1:  # before the announce: an ack may delete it
        _audit_set_aside(cfg, sm, sidecar)
    if stream is not None:  # after the verified rename and the sidecar
        stream.announce(sidecar)
    # The log holds the progress bar; the terminal gets one line per finished chunk.
    sys.__stderr__.write(
        f"hsextract [{sidecar['chunk']}]: {sidecar['records']} records, {sidecar['tokens']} "
        f"tokens in {sidecar['seconds']:.1f}s ({sidecar['tokens_per_s']:.0f} tok/s)\n"
    )
    if _pass_of(sm) > 1:  # a later pass (epochs_mode regenerate): not the manifest's chunk
        return
    _follow_in_manifest(cfg, Path(sm.output.sidecar), Path(sm.input.index), sidecar["chunk"])


def _follow_in_manifest(cfg: Config, sidecar: Path, index: Path, name: str) -> None:
    """The manifest's entry follows the chunk just written (manifest.update_manifest_entry).

    Never fails the job: the chunk is good, and Snakemake would delete a failed job's
    outputs.  What kept the entry from following is said, with the command that rebuilds
    the manifest (readers name it too, for a manifest left stale).
    """
    from hsextract.errors import HsextractError
    from hsextract.manifest import update_manifest_entry

    manifest = run_dir(cfg) / "manifest.json"
    try:
        log.info("%s", update_manifest_entry(manifest, sidecar, index=index, cfg=cfg))
    except (HsextractError, OSError, ValueError, KeyError) as exc:
        from hsextract.commands import snakemake_command

        run_all = snakemake_command("extract_all", run_dir=Path(manifest).parent)
        msg = f"{manifest} not updated for {name} ({exc}); rebuild it with `{run_all}`"
        log.warning("%s", msg)
        sys.__stderr__.write(f"hsextract [{name}]: {msg}\n")


def _stream_gate(cfg: Config, sm: Any):
    """With ``stream.budget_gb`` set, the chunk's gate (waited on now) and announcer
    (hsextract.stream.producer); None for an offline run, which never imports it."""
    if cfg.stream.budget_gb is None:
        return None
    from hsextract.stream.producer import ChunkStream

    return ChunkStream.open(
        cfg, hidden=Path(sm.params.hidden), index=Path(sm.input.index), pass_=_pass_of(sm)
    )


def _stream_restored(cfg: Config, sm: Any) -> bool:
    """Under a budget, a chunk announced before the workflow was interrupted gets its
    receipt back instead of a second extraction (stream.producer.restore), unless the user
    forced this receipt (``snakemake -f``: rules/extract.smk's ``forced`` param)."""
    if cfg.stream.budget_gb is None or getattr(sm.params, "forced", False):
        return False
    from hsextract.records import index_entry
    from hsextract.stream.gate import settings_of
    from hsextract.stream.producer import restore

    index = Path(sm.input.index)
    kept = restore(
        settings_of(cfg),
        run_dir=run_dir(cfg),
        hidden=Path(sm.params.hidden),
        sidecar_out=Path(sm.output.sidecar),
        content_digest=index_entry(Path(sm.params.chunk), index).get("content_digest"),
        pass_=_pass_of(sm),
    )
    if kept is None:
        return False
    sys.__stderr__.write(f"hsextract [{kept['chunk']}]: announced before: receipt restored\n")
    if _pass_of(sm) == 1:
        _follow_in_manifest(cfg, Path(sm.output.sidecar), index, kept["chunk"])
    return True


def _audit_set_aside(cfg: Config, sm: Any, sidecar: dict) -> None:
    """Under a disk budget, the audit's sampled records of this chunk are copied aside
    (hsextract.audit.set_aside): the stream may delete the chunk before the audit runs."""
    from hsextract.audit import set_aside

    kept = set_aside(
        cfg, run_dir(cfg), Path(sm.params.hidden), sidecar["sha256"], Path(sm.input.index)
    )
    if kept is not None:
        log.info("audit sample set aside: %s", kept)


def _pass_of(sm: Any) -> int:
    """The stream pass a chunk job extracts: 1, or p for rule extract_chunk_pass."""
    return int(getattr(sm.params, "stream_pass", 1))


def manifest(sm: Any) -> None:
    from hsextract.manifest import build_manifest

    build_manifest(
        [Path(p) for p in sm.input.sidecars],
        stats=Path(sm.input.stats),
        index=Path(sm.input.index),
        out=Path(sm.output.manifest),
        cfg=typed(sm.config),
    )


def report_figures(sm: Any) -> None:
    from hsextract.report import make_all

    make_all(
        manifest=Path(sm.input.manifest),
        stats=Path(sm.input.stats),
        gate=Path(sm.input.gate),
        patch=Path(sm.input.patch),
        server=Path(sm.input.server),
        out={
            k: Path(getattr(sm.output, k))
            for k in ("lengths", "rejects", "chunks", "activations", "run")
        },
    )


def audit(sm: Any) -> None:
    """The audit stage (hsextract.audit): a sample of the run against HF's forward of the
    model.  Refused or failed, it leaves the unaudited mark and deletes nothing."""
    from hsextract import audit as audit_

    cfg = typed(sm.config)
    rd = run_dir(cfg)

    def say(msg: str) -> None:
        log.info("%s", msg)
        sys.__stderr__.write(f"hsextract [audit]: {msg}\n")

    try:
        result = audit_.run(cfg, rd, Path(sm.output.audit), say=say)
    except audit_.AuditRefused as exc:
        audit_.mark_refused(rd, str(exc))
        raise
    say(audit_.status_line(cfg, rd))
    if result.get("warning"):
        say(result["warning"])
