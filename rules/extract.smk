# Upstream inputs through ancient(): a relaunched server or a re-stamped state file must
# never make finished chunks look out of date.  A changed chunk input is still caught:
# the client checks each chunk file's sha256 against chunks/index.json.
# The chunk's records file is a param, reached through the index (see chunk_index in
# data.smk): as an input, each lookup scans all n_chunks outputs of split_chunks, which
# made `snakemake -n` quadratic (bench/plan.py).  A missing one is rebuilt from
# train.jsonl at the line offsets the index records, so nothing else reruns.
rule extract_chunk:
    input:
        index=ancient(run_path("chunks/index.json")),
        merged=ancient(run_path("merged/train.jsonl")),
        server=ancient(run_path("state/server.json")),
    output:
        hidden=run_path("hidden/chunk_{chunk}.safetensors"),
        sidecar=run_path("hidden/chunk_{chunk}.json"),
    log:
        run_path("logs/extract_chunk_{chunk}.log"),
    benchmark:
        run_path("benchmarks/extract_chunk_{chunk}.tsv")
    params:
        chunk=run_path("chunks/chunk_{chunk}.jsonl"),
    wildcard_constraints:
        chunk=r"\d{5}",
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/extract_chunk.py"


rule manifest:
    input:
        sidecars=expand(run_path("hidden/chunk_{chunk}.json"), chunk=CHUNK_IDS),
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
