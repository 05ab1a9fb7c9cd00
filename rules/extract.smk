# Which chunks to (re-)extract is decided by plan_chunks, a checkpoint: only once the merge
# and split have run is it known whose records changed.  After it, each chunk job is
# re-evaluated with the plan as its trigger input (see chunk_inputs in common.smk): newer
# than its output when the chunk must be redone, ancient() when it is current.
#
# The checkpoint depends on every stage a chunk job depends on, so all of them have
# finished when the chunk jobs are re-evaluated.  That is not style: Snakemake 9 (dag.py,
# update_needrun) skips evaluating a job that lies downstream of a job still to run, and
# then does not schedule it if every edge on the way is an existing ancient() file, so a
# chunk whose records changed would silently be kept (tests/test_reruns.py checks this).
#
# A chunk file written to after its extraction (a flipped byte, a touch) changes nothing
# Snakemake compares, so `changed` names it: a stat of each chunk and sidecar gives the set
# of chunk files newer than their sidecar, and its digest the file's name (plan.changed_note).
# (extract_chunk lists the chunk before its sidecar: Snakemake touches a job's outputs in
# that order when it ends, so a chunk as its job left it is never newer than its sidecar.)
# A new set is a missing input, the plan reruns, re-hashes just those and lists the ones
# whose bytes changed.
checkpoint plan_chunks:
    input:
        index=run_path("chunks/index.json"),
        stats=run_path("merged/stats.json"),
        server=run_path("state/server.json"),
        changed=lambda wildcards: changed_note(RUN),
    output:
        plan=run_path("state/plan.json"),
    log:
        run_path("logs/plan_chunks.log"),
    benchmark:
        run_path("benchmarks/plan_chunks.tsv")
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/plan_chunks.py"


rule note_changed_chunks:
    output:
        note=run_path("state/changed/{digest}.json"),
    log:
        run_path("logs/note_changed_chunks/{digest}.log"),
    benchmark:
        run_path("benchmarks/note_changed_chunks/{digest}.tsv")
    wildcard_constraints:
        digest=r"[0-9a-f]{16}",
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/note_changed_chunks.py"


# Outputs (chunk_outputs in common.smk): the chunk file and its sidecar; under a disk
# budget (stream.budget_gb) the sidecar alone -- the receipt -- and the chunk file a param:
# the stream deletes it once the trainer acked it, which must not make the chunk missing,
# nor a job whose file was freed between its end and Snakemake's check of its outputs fail.
# Upstream inputs through ancient(): a relaunched server or a re-stamped state file never
# makes a finished chunk look out of date; the plan alone decides.  The chunk's records
# file is a param, reached through the index (see chunk_index in data.smk): as an input,
# each lookup scans all n_chunks outputs of split_chunks, which made `snakemake -n`
# quadratic (bench/plan.py).  A missing one is rebuilt from train.jsonl at the line
# offsets the index records, so nothing else reruns.
rule extract_chunk:
    input:
        unpack(chunk_inputs),
    output:
        **chunk_outputs(),
    log:
        run_path("logs/extract_chunk_{chunk}.log"),
    benchmark:
        run_path("benchmarks/extract_chunk_{chunk}.tsv")
    params:
        chunk=run_path("chunks/chunk_{chunk}.jsonl"),
        hidden=run_path("hidden/chunk_{chunk}.safetensors"),
        forced=lambda wildcards, output: receipt_forced(output, "extract_chunk"),
    # sglang.dp_size x tp_size (0 for the reference engine): under SLURM, --gpus per group.
    resources:
        gpu=SERVER_GPUS,
    wildcard_constraints:
        chunk=r"\d{5}",
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/extract_chunk.py"


# stream.epochs_mode regenerate (passes > 1, under a disk budget): pass p re-extracts every
# chunk into hidden/pass<p>/ -- its receipt the output, as above -- announced for pass p; the
# report counts the chunks whose sha256 matches pass 1's.  After every receipt of pass p-1
# (ancient: order only): a trainer reads the passes in turn, and a pass-p chunk admitted
# to the budget ahead of pass p-1's last would hold room the trainer needs first.
rule extract_chunk_pass:
    input:
        unpack(chunk_pass_inputs),
    output:
        sidecar=run_path("hidden/pass{p}/chunk_{chunk}.json"),
    log:
        run_path("logs/extract_chunk_pass{p}_{chunk}.log"),
    benchmark:
        run_path("benchmarks/extract_chunk_pass{p}_{chunk}.tsv")
    params:
        chunk=run_path("chunks/chunk_{chunk}.jsonl"),
        hidden=run_path("hidden/pass{p}/chunk_{chunk}.safetensors"),
        stream_pass=lambda wildcards: int(wildcards.p),
        forced=lambda wildcards, output: receipt_forced(output, "extract_chunk_pass"),
    resources:
        gpu=SERVER_GPUS,
    wildcard_constraints:
        chunk=r"\d{5}",
        p=r"[1-9]\d*",
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/extract_chunk.py"


rule manifest:
    input:
        sidecars=expand(run_path("hidden/chunk_{chunk}.json"), chunk=CHUNK_IDS),
        index=run_path("chunks/index.json"),
        stats=run_path("merged/stats.json"),
    output:
        manifest=run_path("manifest.json"),
    log:
        run_path("logs/manifest.log"),
    benchmark:
        run_path("benchmarks/manifest.tsv")
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/manifest.py"
