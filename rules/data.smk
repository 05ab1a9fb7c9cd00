rule merge_and_shuffle:
    input:
        shards=input_shards(),
        model_config=model_config_file(),
    output:
        train=run_path("merged/train.jsonl"),
        stats=run_path("merged/stats.json"),
        rejects=run_path("merged/rejects.jsonl"),
    log:
        run_path("logs/merge_and_shuffle.log"),
    benchmark:
        run_path("benchmarks/merge_and_shuffle.tsv")
    params:
        max_seq_len=config["max_seq_len"],
        overlength=config["merge"]["overlength"],
        seed=config["seed"],
        max_reject_fraction=config["merge"]["max_reject_fraction"],
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/merge_and_shuffle.py"


rule split_chunks:
    input:
        train=run_path("merged/train.jsonl"),
    output:
        chunks=expand(run_path("chunks/chunk_{chunk}.jsonl"), chunk=CHUNK_IDS),
        index=run_path("chunks/index.json"),
    log:
        run_path("logs/split_chunks.log"),
    benchmark:
        run_path("benchmarks/split_chunks.tsv")
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/split_chunks.py"


rule delete_stale_states:
    input:
        index=run_path("chunks/index.json"),
    output:
        report=run_path("state/stale_deleted.json"),
    log:
        run_path("logs/delete_stale_states.log"),
    benchmark:
        run_path("benchmarks/delete_stale_states.tsv")
    params:
        keep_runs=config["stale"]["keep_runs"],
        dry_run=config["stale"]["dry_run"],
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
