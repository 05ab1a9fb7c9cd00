rule apply_patch:
    input:
        preflight=run_path("state/preflight.json"),
    output:
        state=run_path("state/patch.json"),
    log:
        run_path("logs/apply_patch.log"),
    benchmark:
        run_path("benchmarks/apply_patch.tsv")
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/apply_patch.py"


rule gpu_gate:
    input:
        patch=run_path("state/patch.json"),
    output:
        state=run_path("state/gpu_gate.json"),
    log:
        run_path("logs/gpu_gate.log"),
    benchmark:
        run_path("benchmarks/gpu_gate.tsv")
    params:
        per_node=per_node_servers,
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/gpu_gate.py"


# The server outlives this job: chunk jobs take server.json through ancient() and
# ensure() a server with the config's settings is alive, starting one if it is gone.
# It starts only when some chunk needs extracting (see steps.launch_server).  The launch
# settings name one of its outputs, so a changed chunked-prefill size or SGLang flag
# reruns it and the next server uses it; finished chunks are kept (the plan decides).
# On a cluster (per_node, common.smk) it runs on the head node and only records the spec:
# every node allocation starts its own server (docs/slurm.md).
rule launch_server:
    input:
        gate=run_path("state/gpu_gate.json"),
        index=run_path("chunks/index.json"),
        model_config=model_config_file(),
    output:
        state=run_path("state/server.json"),
        settings=settings_file("state", "launch", LAUNCH_SETTINGS),
    log:
        run_path("logs/launch_server.log"),
    benchmark:
        run_path("benchmarks/launch_server.tsv")
    params:
        settings=LAUNCH_SETTINGS,
        per_node=per_node_servers,
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/launch_server.py"
