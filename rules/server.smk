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
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/gpu_gate.py"


# The server outlives this job: chunk jobs take server.json through ancient() and
# ensure() it is alive, relaunching from this record if it is gone.
rule launch_server:
    input:
        gate=run_path("state/gpu_gate.json"),
        model_config=model_config_file(),
    output:
        state=run_path("state/server.json"),
    log:
        run_path("logs/launch_server.log"),
    benchmark:
        run_path("benchmarks/launch_server.tsv")
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/launch_server.py"
