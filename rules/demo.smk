# The embedded default builds its own inputs and model; real configs set demo.enabled false.
# Each names its settings in an output (see settings_file in common.smk): a change of one
# rebuilds what it changes and nothing else.
if CFG.demo.enabled:

    rule demo_data:
        localrule: True
        output:
            shards=demo_shards(),
            settings=DEMO_DATA_SETTINGS_FILE,
        log:
            f"{CFG.output_root}/demo/logs/demo_data.log",
        benchmark:
            f"{CFG.output_root}/demo/benchmarks/demo_data.tsv"
        params:
            demo=DEMO_DATA_SETTINGS["demo"],
            max_seq_len=CFG.max_seq_len,
        conda:
            "../envs/hsextract.yaml"
        script:
            "../scripts/demo_data.py"

    rule demo_model:
        localrule: True
        output:
            config=model_config_file(),
            weights=str(MODEL_DIR / "model.safetensors"),
            settings=DEMO_MODEL_SETTINGS_FILE,
        log:
            f"{CFG.output_root}/demo/logs/demo_model.log",
        benchmark:
            f"{CFG.output_root}/demo/benchmarks/demo_model.tsv"
        params:
            demo=DEMO_MODEL_SETTINGS["demo"],
        conda:
            "../envs/hsextract.yaml"
        script:
            "../scripts/demo_model.py"
