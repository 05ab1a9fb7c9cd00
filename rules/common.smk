import functools
import hashlib
import json
import os
import sys
from pathlib import Path

from hsextract.commands import record as record_sources
from hsextract.commands import set_current, sources_of
from hsextract.config import (
    check_output_root,
    demo_data_settings_file,
    dump_dir,
    fingerprint,
    load_config,
    run_dir,
    settings_digest,
    typed,
    where_set,
)
from hsextract.config import demo_shards as config_demo_shards
from hsextract.config import input_shards as config_input_shards
from hsextract.dp import server_gpu_count
from hsextract.errors import ConfigError, one_sentence
from hsextract.export.common import ExportError, refuse_deleted_after_ack
from hsextract.server import (
    OWNER_ENV,
    OWNER_SCOPE_ENV,
    OWNER_START_ENV,
    forget_finished_jobs,
    host_key,
    inherited_owner,
    remove_dump_dir_if_empty,
    stop_live,
)
from hsextract.procs import start_time
from hsextract.sizing import chunk_count, chunk_sizing, sizing_report
from hsextract.smk import runs_jobs
from hsextract.stages import stage_settings
from hsextract.stale import claim_run, preview
from hsextract.summary import clear_failed_merge
from hsextract.window import WORKFLOW_JOBS_ENV

# The one way a config is read (hsextract.config.load_config, the CLI's too): the
# --configfile files or ./config.yaml, then --config (dotted keys allowed; its values
# arrive as strings and are given the schema's types), validated against
# schemas/config.schema.yaml with its defaults filled.  Replaced in place: the scripts get
# this dict as snakemake.config.
# A config the library refuses is its one sentence here too, not a traceback through
# config.py (hsextract.errors.one_sentence).
with one_sentence():
    _loaded = load_config(workflow.overwrite_configfiles, dict(workflow.config_settings.config))
    config.clear()
    config.update(_loaded)
    # Which --configfile (or --config) set max_seq_len: the merge names it when it cuts many.
    MAX_SEQ_LEN_FROM = where_set(
        "max_seq_len", workflow.overwrite_configfiles, dict(workflow.config_settings.config)
    )
    # The rules read the config typed (CFG.server.host); the dict stays Snakemake's, for the
    # scripts (steps.py types it again) and for what is hashed of it as written.
    CFG = typed(config)

    RUN = run_dir(CFG)


    def refuse_unwritable_output_root(write=True):
        """An output_root that cannot be written ends the run before any job in one sentence,
        not in a traceback from the first write (the run claim's) or Snakemake's output scan."""
        try:
            check_output_root(CFG.output_root, write=write)
        except ConfigError as exc:
            print(f"hsextract: error: {exc}", file=sys.stderr)
            raise SystemExit(1)


    # One workflow per run dir at a time, whatever its working directory (Snakemake's own lock
    # is per directory): a second one is refused here, before it or a job touches anything
    # (stale.claim_run).  The main process only, when it may run jobs: its jobs (a nested
    # Snakemake, or one on a SLURM node) work under its hold, and a dry run touches nothing
    # (only a path that runs through a file is refused for it).
    # The hold is released, and its file removed, when this process exits.
    if inherited_owner() is None and workflow.is_main_process:
        if runs_jobs():
            refuse_unwritable_output_root(write=True)
            claim_run(RUN, os.getpid())
            # Held: a failed merge's rejects file whose inputs were since restored goes
            # (a restore from a backup keeps the old time: nothing reruns to remove it).
            clear_failed_merge(CFG, RUN)
        else:
            refuse_unwritable_output_root(write=False)
    # Every command a message suggests carries this config's sources (hsextract.commands): the
    # jobs inherit them in the environment; onstart records them in the run dir for readers
    # holding only the run (verify, a trainer's ManifestDataset).
    SOURCES = sources_of(workflow.overwrite_configfiles, dict(workflow.config_settings.config), RUN)
    set_current(SOURCES, export=True)
    # What one server takes: a chunk job's GPUs (its group's allocation under SLURM asks this).
    SERVER_GPUS = server_gpu_count(CFG)
    FINGERPRINT = fingerprint(CFG)
    CHUNK_SIZING = chunk_sizing(CFG)  # n_chunks: auto (None for a number)
    CHUNK_IDS = [f"{i:05d}" for i in range(chunk_count(CFG))]
    MODEL_DIR = Path(CFG.model.path)

# Servers started by this workflow are owned by this process: the watchdog stops them
# when it exits.  Jobs inherit the variables; a nested Snakemake keeps its parent's owner,
# but not across hosts or SLURM jobs (server.host_key): there the Snakemake running the
# job (for a group, the one running all its chunks) owns the node's server.  The start
# time pins the process itself: a job orphaned by a killed Snakemake refuses to start a
# server (server.owner_pid), even once the pid is reused.
MAIN = inherited_owner() is None
if MAIN:
    os.environ[OWNER_ENV] = str(os.getpid())
    os.environ[OWNER_START_ENV] = str(start_time(os.getpid()))
    os.environ[OWNER_SCOPE_ENV] = host_key()

# How many jobs this workflow runs at once (-j: cores, or nodes under a cluster executor):
# the chunk jobs send within it (client.sending_jobs auto, hsextract.window), and the log
# line below says where it caps the count.  In the environment, not a param: a param that
# moved with -j would rerun every finished chunk.  A dry run runs nothing (its cores are 1
# whatever -j says); a nested Snakemake keeps its parent's.
if MAIN and workflow.is_main_process and runs_jobs():
    _jobs = workflow.nodes or workflow._cores
    if _jobs:
        os.environ[WORKFLOW_JOBS_ENV] = str(int(_jobs))


def per_node_servers(wildcards=None):
    """True when chunk jobs run on other machines (``--executor slurm``, any remote
    executor): then the head node checks no GPU and starts no server (gpu_gate and
    launch_server record that); each node allocation gates its GPUs and starts its own
    server when its first chunk job calls ensure().  Known once the executor is, so a
    params function, evaluated when the jobs are built."""
    plugin = workflow.executor_plugin
    return bool(plugin is not None and plugin.common_settings.non_local_exec)


def run_path(*parts):
    return str(RUN.joinpath(*parts))


def demo_shards():
    return config_demo_shards(CFG)


def input_shards(wildcards=None):
    return config_input_shards(CFG)


@functools.cache
def changed_note(run):
    """Once per process (extract_all and plan_chunks both ask): a stat of every chunk file
    and sidecar, and the same name however often the DAG is re-evaluated."""
    from hsextract.plan import changed_note as note

    return note(run)


def chunk_outputs():
    """extract_chunk's outputs: the chunk file and its sidecar; under a disk budget
    (stream.budget_gb) the sidecar alone, the chunk's receipt (hsextract.stream.receipts):
    the stream deletes an acknowledged chunk file, and the chunk is done, not missing."""
    out = {"hidden": run_path("hidden/chunk_{chunk}.safetensors")}
    if CFG.stream.budget_gb is not None:
        out = {}
    return {**out, "sidecar": run_path("hidden/chunk_{chunk}.json")}


def receipt_forced(output, rule):
    """Under a budget, whether the command line forces this chunk's receipt (a redo asked
    for): otherwise a chunk announced before an interruption gets its receipt back instead
    of a second extraction (hsextract.stream.producer.restore)."""
    if CFG.stream.budget_gb is None:
        return False
    from hsextract.stream.receipts import forced_by_user

    return forced_by_user(workflow.dag_settings, output.sidecar, rule)


def chunk_targets():
    """extract_all's chunk files: the chunk files, or under a disk budget the receipts
    (a payload lost before its ack is found by the plan: plan.changed_note), and with
    stream.epochs_mode regenerate every later pass's receipts (pass_receipts)."""
    if CFG.stream.budget_gb is None:
        return expand(run_path("hidden/chunk_{chunk}.safetensors"), chunk=CHUNK_IDS)
    return expand(run_path("hidden/chunk_{chunk}.json"), chunk=CHUNK_IDS) + pass_receipts()


def receipts_of_pass(p):
    where = "hidden" if p == 1 else f"hidden/pass{p}"
    return expand(run_path(f"{where}/chunk_{{chunk}}.json"), chunk=CHUNK_IDS)


def pass_receipts():
    """The receipts of passes 2..stream.passes under epochs_mode regenerate (each pass
    re-extracts every chunk: rule extract_chunk_pass); none otherwise."""
    s = CFG.stream
    if s.budget_gb is None or s.epochs_mode != "regenerate":
        return []
    return [f for p in range(2, s.passes + 1) for f in receipts_of_pass(p)]


def audit_target():
    """state/audit.json when the audit is on (audit.records > 0), else nothing
    (rules/audit.smk)."""
    return [run_path("state/audit.json")] if CFG.audit.records > 0 else []


def chunk_pass_inputs(wildcards):
    """extract_chunk_pass's inputs: a chunk job's, and every receipt of the pass before
    (ancient: they order the passes, they never make a chunk out of date)."""
    p = int(wildcards.p)
    if p < 2 or CFG.stream.budget_gb is None or CFG.stream.epochs_mode != "regenerate":
        raise ValueError(
            f"hidden/pass{p}/ is pass {p} of stream.epochs_mode regenerate, which this config "
            "does not run (set stream.budget_gb, epochs_mode: regenerate, passes >= 2)"
        )
    return {
        **chunk_inputs(wildcards, pass_=p),
        "before": [ancient(f) for f in receipts_of_pass(p - 1)],
    }


def chunk_inputs(wildcards, pass_=1):
    """A chunk job's inputs once plan_chunks has run (Snakemake re-evaluates it then).

    The plan is the trigger: newer than the chunk's output if the plan lists the chunk,
    ancient() otherwise, so only chunks whose records changed are redone.  A later pass's
    job (extract_chunk_pass) is redone when the plan lists its pass-1 chunk (records
    changed) or its own (plan.plan_key: its payload lost before its ack).
    """
    from hsextract.plan import plan_key, to_extract

    plan = checkpoints.plan_chunks.get().output.plan
    name, listed = f"chunk_{wildcards.chunk}", to_extract(plan)
    redo = name in listed or plan_key(name, pass_) in listed
    return {
        "plan": plan if redo else ancient(plan),
        "index": ancient(run_path("chunks/index.json")),
        "merged": ancient(run_path("merged/train.jsonl")),
        "server": ancient(run_path("state/server.json")),
    }


# What each stage's outputs depend on beyond its input files (stages.stage_settings), named
# in one of its outputs (and asked for by extract_all): a changed setting is a missing
# output, so the stage reruns -- from file names alone, with or without Snakemake's
# metadata (.snakemake/, which the params trigger needs and which a copied run dir, or one
# whose .snakemake was removed to clear a lock, does not have).
MERGE_INPUTS = input_shards()
STAGE_SETTINGS = stage_settings(CFG)
MERGE_SETTINGS = STAGE_SETTINGS["merge"]
SPLIT_SETTINGS = STAGE_SETTINGS["split"]
LAUNCH_SETTINGS = STAGE_SETTINGS["launch"]
STALE_SETTINGS = STAGE_SETTINGS["stale"]
if CFG.demo.enabled:
    DEMO_DATA_SETTINGS = STAGE_SETTINGS["demo_data"]
    DEMO_MODEL_SETTINGS = STAGE_SETTINGS["demo_model"]
    DEMO_DATA_SETTINGS_FILE = demo_data_settings_file(CFG, DEMO_DATA_SETTINGS)
    DEMO_MODEL_SETTINGS_FILE = str(
        MODEL_DIR / f"settings-{settings_digest(DEMO_MODEL_SETTINGS)}.json"
    )


def settings_file(where, stage, values):
    return run_path(where, f"{stage}-{settings_digest(values)}.json")


def stale_settings_file():
    return settings_file("state", "stale", STALE_SETTINGS)


def settings_files():
    """Every stage's settings file: extract_all asks for them (see the Snakefile)."""
    files = [
        settings_file("merged", "settings", MERGE_SETTINGS),
        settings_file("chunks", "settings", SPLIT_SETTINGS),
        settings_file("state", "launch", LAUNCH_SETTINGS),
        stale_settings_file(),
    ]
    if CFG.demo.enabled:
        files += [DEMO_DATA_SETTINGS_FILE, DEMO_MODEL_SETTINGS_FILE]
    return files


def model_config_file():
    return str(MODEL_DIR / "config.json")


def show_stale_plan():
    """What delete_stale_states would remove and keep, printed at planning (also for -n)."""
    lines = preview(
        Path(CFG.output_root),
        RUN,
        dump_root=dump_dir(CFG).parent,
        keep_runs=CFG.stale.keep_runs,
        delete_finished=CFG.stale.delete_finished,
    )
    if lines:
        mode = " (stale.dry_run: reported only)" if CFG.stale.dry_run else ""
        print(f"hsextract: stale states under {CFG.output_root}{mode}:", file=sys.stderr)
        print("\n".join(lines), file=sys.stderr)
        if any(line.startswith("  remove") for line in lines) and stale_deletion_done():
            # Snakemake reruns it when its settings or the chunk index change, not because
            # a run became deletable since (its server stopped, its lock was released).
            print(
                "hsextract: delete_stale_states already ran with these settings, so nothing "
                "above is removed unless it reruns (a changed stale.* setting or chunk index "
                "does that); to remove it now, add --forcerun delete_stale_states to this "
                "command",
                file=sys.stderr,
            )


def stale_deletion_done():
    """Whether delete_stale_states' outputs for the current settings exist and are newer
    than its input (Snakemake will not rerun it on its own)."""
    files = [Path(run_path("state/stale_deleted.json")), Path(stale_settings_file())]
    index = Path(run_path("chunks/index.json"))
    try:
        oldest = min(f.stat().st_mtime for f in files)
        return not index.exists() or index.stat().st_mtime <= oldest
    except FileNotFoundError:
        return False


if MAIN and workflow.is_main_process:
    show_stale_plan()
    for line in sizing_report(CFG, CHUNK_SIZING):
        print(f"hsextract: {line}", file=sys.stderr)


def stop_servers():
    if stop_live(RUN / "state", keep_failed=True):
        print(f"hsextract: stopped the extraction server of {RUN}")
    forget_finished_jobs(RUN / "state")  # servers of SLURM jobs died with their job
    remove_dump_dir_if_empty(dump_dir(CFG))


@functools.cache
def deleted_after_ack_refusal():
    """Why no export may plan (chunk files the stream deleted after the trainer's ack:
    an export would re-extract them), or None; once per process, not once per chunk."""
    try:
        refuse_deleted_after_ack(RUN)
    except ExportError as exc:
        return str(exc)
    return None


def export_chunk_files(wildcards):
    """The chunk files an export reads (one per chunk job, or all for its target); the
    plan ends here with deleted_after_ack_refusal's sentence, so a dry run says it
    rather than planning a re-extraction or failing on a missing input (no rule makes a
    chunk file under a budget)."""
    why = deleted_after_ack_refusal() or unextracted_under_budget_refusal()
    if why is not None:  # one sentence, as refuse_unwritable_output_root ends a plan
        print(f"hsextract: error: {why}", file=sys.stderr)
        raise SystemExit(1)
    if "chunk" in wildcards.keys():
        return run_path("hidden/chunk_{chunk}.safetensors".format(**wildcards))
    return expand(run_path("hidden/chunk_{chunk}.safetensors"), chunk=CHUNK_IDS)


def unextracted_under_budget_refusal():
    """Why no export may plan under a disk budget with chunk files not yet written, or
    None: no rule writes a chunk file there (a chunk job's output is its receipt), so
    Snakemake stopped with a MissingInputException (issue 58)."""
    if CFG.stream.budget_gb is None:
        return None
    missing = [c for c in CHUNK_IDS if not Path(run_path(f"hidden/chunk_{c}.safetensors")).exists()]
    if not missing:
        return None
    from hsextract.commands import snakemake_command

    shown = ", ".join(f"chunk_{c}" for c in missing[:3]) + (", ..." if len(missing) > 3 else "")
    return (
        f"{RUN}: {len(missing)} of {len(CHUNK_IDS)} chunk file(s) ({shown}) are not on disk, "
        "and under stream.budget_gb no rule writes them for an export (the stream hands "
        "each chunk to the trainer and deletes it once acknowledged): read the run as a "
        "stream (hsextract.stream), or set stream.budget_gb: null and run "
        f"`{snakemake_command('extract_all')}` (the disk must then hold the whole run) "
        "before exporting"
    )


def speculators_prenorm(wildcards):
    """export_speculators_chunk's chunk file, or a plan-time error without prenorm_final."""
    if not CFG.prenorm_final:
        # One sentence and the command, as export_chunk_files ends a plan: a ValueError
        # here stopped inside Snakemake's InputFunctionException block, with no command.
        from hsextract.commands import snakemake_command

        print(
            "hsextract: error: export_speculators needs the pre-norm final state, which this "
            "run did not capture: set prenorm_final: true in your config (a new run dir; "
            f"this one is kept), then run `{snakemake_command('export_speculators')}` "
            "(it extracts that run first)",
            file=sys.stderr,
        )
        raise SystemExit(1)
    return export_chunk_files(wildcards)
