# The embedded default builds its own inputs and model; real configs set demo.enabled false.
if config["demo"]["enabled"]:

    rule demo_data:
        output:
            shards=demo_shards(),
        log:
            f"{config['output_root']}/demo/logs/demo_data.log",
        benchmark:
            f"{config['output_root']}/demo/benchmarks/demo_data.tsv"
        params:
            demo=config["demo"],
            seed=config["seed"],
            max_seq_len=config["max_seq_len"],
        conda:
            "../envs/hsextract.yaml"
        script:
            "../scripts/demo_data.py"

    rule demo_model:
        output:
            config=model_config_file(),
            weights=str(MODEL_DIR / "model.safetensors"),
        log:
            f"{config['output_root']}/demo/logs/demo_model.log",
        benchmark:
            f"{config['output_root']}/demo/benchmarks/demo_model.tsv"
        params:
            demo=config["demo"],
            seed=config["seed"],
            max_seq_len=config["max_seq_len"],
        conda:
            "../envs/hsextract.yaml"
        script:
            "../scripts/demo_model.py"
