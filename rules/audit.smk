# The audit (src/hsextract/audit.py, docs/audit.md): a seeded sample of the run's records
# recomputed with HF transformers' forward of model.path and compared, tensor by tensor,
# with what the chunk files hold.  Part of extract_all unless audit.records is 0.
#
# Its output is state/audit.json alone: a failed audit must delete nothing, and Snakemake
# removes a failed job's outputs -- so the manifest and the chunks are inputs, and the
# "unaudited" mark (state/audit.failed.json) is written by the job, not declared.
# After every later pass (stream.epochs_mode regenerate): an audit on the GPUs stops the
# server, which those passes still use.

# extract_all and report_figures ask for it through audit_target (rules/common.smk).


rule audit:
    input:
        manifest=run_path("manifest.json"),
        passes=pass_receipts(),
    output:
        audit=run_path("state/audit.json"),
    log:
        run_path("logs/audit.log"),
    benchmark:
        run_path("benchmarks/audit.tsv")
    # The GPUs the server used, freed for the audit's forward (0 for the reference engine).
    resources:
        gpu=SERVER_GPUS,
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/audit.py"
