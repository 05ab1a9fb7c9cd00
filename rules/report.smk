# Figures for `snakemake --report report.html`, from files the run already wrote (no
# tensor is read): part of extract_all so a finished run always has them.
rule report_figures:
    input:
        manifest=run_path("manifest.json"),
        stats=run_path("merged/stats.json"),
        gate=run_path("state/gpu_gate.json"),
        patch=run_path("state/patch.json"),
        server=run_path("state/server.json"),
        # epochs_mode regenerate: the report counts re-extracted chunks matching pass 1's.
        passes=pass_receipts(),
        # After the audit, whose table the run page shows (none with audit.records: 0).
        audit=audit_target(),
    output:
        lengths=report(run_path("report/lengths.png"), caption="../report/lengths.rst", category="1. Data"),
        rejects=report(run_path("report/rejects.png"), caption="../report/rejects.rst", category="1. Data"),
        chunks=report(run_path("report/chunks.png"), caption="../report/chunks.rst", category="2. Extraction"),
        activations=report(
            run_path("report/activations.png"), caption="../report/activations.rst", category="3. Activations"
        ),
        run=report(run_path("report/run.html"), caption="../report/run.rst", category="4. Run"),
    log:
        run_path("logs/report_figures.log"),
    benchmark:
        run_path("benchmarks/report_figures.tsv")
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/report_figures.py"
