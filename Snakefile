# hsextract: raw tokenized shards -> verified per-chunk hidden states.
#   snakemake -j1 extract_all     everything
#   snakemake -n extract_all      the plan (no model loaded, no GPU touched)
#   snakemake -j1 <chunk file>    redo one chunk
import time

from snakemake.utils import min_version

min_version("9.0")


# No `configfile:` directive: Snakemake would merge it *under* every --configfile.  The
# config is the --configfile files, or with none ./config.yaml (the embedded demo in the
# project dir), then --config -- read in rules/common.smk as every hsextract command reads
# it (hsextract.config.load_config), so a run is the same from any directory.


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/data.smk"
include: "rules/server.smk"
include: "rules/extract.smk"
include: "rules/audit.smk"
include: "rules/report.smk"
include: "rules/export.smk"


# On a cluster (profiles/slurm) every stage but extract_chunk runs on the head node:
# they read and write the shared run dir and need no GPU (the demo's rules: demo.smk).
localrules:
    extract_all,
    merge_and_shuffle,
    publish_merge,
    split_chunks,
    chunk_index,
    delete_stale_states,
    preflight_budget,
    apply_patch,
    gpu_gate,
    launch_server,
    plan_chunks,
    note_changed_chunks,
    manifest,
    report_figures,  # reads state files only; a CPU allocation for it is a queue wait


# The chunk files are listed here, not only through the manifest (which reads their
# sidecars): Snakemake does not regenerate a missing intermediate whose consumers are up
# to date, and a deleted chunk must be planned again by `snakemake -n extract_all`.  Under
# a disk budget the stream deletes acknowledged chunk files, so the chunk jobs' outputs,
# listed here, are their receipts, the sidecars (chunk_targets in common.smk).
# Each list only once per rule: every listed file costs planning time per chunk.  The
# settings files are here for the same reason: a changed setting is a missing file, which
# only a target's inputs make Snakemake regenerate.
rule extract_all:
    input:
        hidden=chunk_targets(),
        manifest=run_path("manifest.json"),
        # What the exports and the chunk jobs read besides the chunks: the merge's published
        # files (a failed merge leaves them as they were, rules/data.smk); one removed is a
        # missing input here, so it is published again -- not "Nothing to be done" over a
        # run the export then calls broken.
        merged=[run_path("merged/train.jsonl"), run_path("merged/stats.json")],
        index=run_path("chunks/index.json"),
        settings=settings_files(),
        # Names the chunk files written to since their extraction (plan.changed_note): a new
        # name is missing here, so the plan reruns and redoes those whose bytes changed.
        changed=lambda wildcards: changed_note(RUN),
        # Plain paths, not the rule reference itself: a `rules.X.output` input makes Snakemake
        # hash this rule's whole input list once per input (rules.py, expand_input), which
        # made `snakemake -n` quadratic: 355 s vs 38 s bare at 51,200 chunks (bench/README).
        report=[str(f) for f in rules.report_figures.output],
        # The audit's outcome (audit.records: 0 turns it off): rules/audit.smk.
        audit=audit_target(),
    default_target: True


# Snakemake 9 drops a Ctrl-C that lands while it prints a log line (the run then goes on
# and exits 0); this makes it take effect (hsextract.interrupt.keep_ctrl_c).
from hsextract.interrupt import keep_ctrl_c

keep_ctrl_c()


onstart:
    record_sources(RUN, SOURCES)


# When this workflow started: its end summarises the run only if it wrote the manifest.
WORKFLOW_STARTED = time.time()


onsuccess:
    stop_servers()
    from hsextract.summary import run_summary

    for line in run_summary(RUN, since=WORKFLOW_STARTED):
        print(line)


onerror:
    stop_servers()
