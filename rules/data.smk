# The merge writes to merged/.next/ and publish_merge links its files to merged/: Snakemake
# deletes a job's outputs before it runs and a failed job's after, so a merge failing on a
# bad input took the finished run's train.jsonl and stats.json with it (issue 38).  Only
# the staged files are the merge's; the published ones change once a merge succeeded.
rule merge_and_shuffle:
    input:
        shards=MERGE_INPUTS,
        model_config=model_config_file(),
    output:
        train=run_path("merged/.next/train.jsonl"),
        stats=run_path("merged/.next/stats.json"),
        rejects=run_path("merged/.next/rejects.jsonl"),
        settings=settings_file("merged", "settings", MERGE_SETTINGS),
    log:
        run_path("logs/merge_and_shuffle.log"),
    benchmark:
        run_path("benchmarks/merge_and_shuffle.tsv")
    params:
        settings=MERGE_SETTINGS,
        failed_rejects=run_path("merged/rejects-failed.jsonl"),
        # Named when max_seq_len cuts many records (merge.warn_overlength_fraction).
        max_seq_len_from=MAX_SEQ_LEN_FROM,
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/merge_and_shuffle.py"


rule publish_merge:
    input:
        train=run_path("merged/.next/train.jsonl"),
        stats=run_path("merged/.next/stats.json"),
        rejects=run_path("merged/.next/rejects.jsonl"),
    output:
        train=run_path("merged/train.jsonl"),
        stats=run_path("merged/stats.json"),
        rejects=run_path("merged/rejects.jsonl"),
    log:
        run_path("logs/publish_merge.log"),
    benchmark:
        run_path("benchmarks/publish_merge.tsv")
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/publish_merge.py"


rule split_chunks:
    input:
        train=run_path("merged/train.jsonl"),
    output:
        index=run_path("chunks/split.json"),
        chunks=expand(run_path("chunks/chunk_{chunk}.jsonl"), chunk=CHUNK_IDS),
        settings=settings_file("chunks", "settings", SPLIT_SETTINGS),
    log:
        run_path("logs/split_chunks.log"),
    benchmark:
        run_path("benchmarks/split_chunks.tsv")
    params:
        settings=SPLIT_SETTINGS,
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/split_chunks.py"


# The index every later stage reads comes from this one-output rule, not straight from
# split_chunks: Snakemake's per-job bookkeeping scans all outputs of each job a job depends
# on, so n_chunks extract jobs depending on a job with n_chunks outputs made `-n` quadratic
# (10k chunks: 84 s vs 12 s for a bare workflow; bench/plan.py).  The chunk files stay
# split_chunks' outputs (a missing one reruns it); extract jobs reach them via the index.
rule chunk_index:
    input:
        split=run_path("chunks/split.json"),
    output:
        index=run_path("chunks/index.json"),
    log:
        run_path("logs/chunk_index.log"),
    benchmark:
        run_path("benchmarks/chunk_index.tsv")
    conda:
        "../envs/hsextract.yaml"
    # :q shell-quotes each path: an output_root with a space, a quote or a `$` must name
    # the run's own files, never a word of it that is someone else's file.
    shell:
        "cp {input.split:q} {output.index:q} 2> {log:q}"


# Its settings name an output (settings_file in common.smk): setting stale.delete_finished
# or another stale.* key reruns it, as the plan printed at startup says.
rule delete_stale_states:
    input:
        index=run_path("chunks/index.json"),
    output:
        report=run_path("state/stale_deleted.json"),
        settings=stale_settings_file(),
    log:
        run_path("logs/delete_stale_states.log"),
    benchmark:
        run_path("benchmarks/delete_stale_states.tsv")
    params:
        settings=STALE_SETTINGS,
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/delete_stale_states.py"


rule preflight_budget:
    input:
        index=run_path("chunks/index.json"),
        stale=run_path("state/stale_deleted.json"),
        model_config=model_config_file(),
    output:
        report=run_path("state/preflight.json"),
    log:
        run_path("logs/preflight_budget.log"),
    benchmark:
        run_path("benchmarks/preflight_budget.tsv")
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/preflight_budget.py"
