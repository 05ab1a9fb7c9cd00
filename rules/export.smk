# Exports of a finished run into the formats trainers read (README, "Exports").
#
# SpecForge's offline format (src/hsextract/export/specforge.py): one job per chunk, so a
# re-extracted chunk is re-exported alone.  Its inputs are the chunk file, its sidecar and
# the index (each file is named by the record's train.jsonl line, which the index pins:
# a new train.jsonl re-exports every chunk), and the settings file, named by the
# compression setting like every stage's (common.smk), so changing it redoes every chunk.
from hsextract.export.specforge import settings_file as specforge_settings_file

SPECFORGE_GZIP = CFG.export.specforge.gzip
SPECFORGE_SETTINGS = str(specforge_settings_file(RUN / "export" / "specforge", SPECFORGE_GZIP))


localrules:
    export_specforge,
    export_specforge_settings,
    export_specforge_summary,


rule export_specforge_settings:
    output:
        settings=SPECFORGE_SETTINGS,
    log:
        run_path("logs/export_specforge_settings.log"),
    benchmark:
        run_path("benchmarks/export_specforge_settings.tsv")
    params:
        gzip=SPECFORGE_GZIP,
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/export_specforge_settings.py"


rule export_specforge_chunk:
    input:
        hidden=export_chunk_files,
        sidecar=run_path("hidden/chunk_{chunk}.json"),
        index=run_path("chunks/index.json"),
        settings=SPECFORGE_SETTINGS,
    output:
        done=run_path("export/specforge/done/chunk_{chunk}.json"),
    log:
        run_path("logs/export_specforge_chunk_{chunk}.log"),
    benchmark:
        run_path("benchmarks/export_specforge_chunk_{chunk}.tsv")
    wildcard_constraints:
        chunk=r"\d{5}",
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/export_specforge_chunk.py"


# Checks every chunk's files against the manifest and removes what no chunk lists (a
# shorter train.jsonl, fewer chunks, the other compression): SpecForge reads every .ckpt.
rule export_specforge_summary:
    input:
        done=expand(run_path("export/specforge/done/chunk_{chunk}.json"), chunk=CHUNK_IDS),
        manifest=run_path("manifest.json"),
    output:
        summary=run_path("export/specforge/export.json"),
    log:
        run_path("logs/export_specforge_summary.log"),
    benchmark:
        run_path("benchmarks/export_specforge_summary.tsv")
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/export_specforge_summary.py"


# Lists what extract_all lists, for the reasons the Snakefile gives: a deleted chunk or
# marker, or a changed setting, is then planned again from this target alone.
rule export_specforge:
    input:
        summary=run_path("export/specforge/export.json"),
        done=expand(run_path("export/specforge/done/chunk_{chunk}.json"), chunk=CHUNK_IDS),
        hidden=export_chunk_files,
        settings=[*settings_files(), SPECFORGE_SETTINGS],


# vLLM speculators' format (src/hsextract/export/speculators.py): hs_{idx}.safetensors per
# record, one job per chunk, and the Arrow dataset, built from train.jsonl alone so that a
# re-extracted chunk leaves it be.  Its last hidden-state slot is the pre-norm final state:
# without prenorm_final the plan fails (speculators_prenorm, common.smk) before anything
# is extracted.
localrules:
    export_speculators,
    export_speculators_dataset,
    export_speculators_summary,


rule export_speculators_dataset:
    input:
        train=run_path("merged/train.jsonl"),
    output:
        done=run_path("export/speculators/done/dataset.json"),
    log:
        run_path("logs/export_speculators_dataset.log"),
    benchmark:
        run_path("benchmarks/export_speculators_dataset.tsv")
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/export_speculators_dataset.py"


rule export_speculators_chunk:
    input:
        hidden=speculators_prenorm,
        index=run_path("chunks/index.json"),
    output:
        done=run_path("export/speculators/done/chunk_{chunk}.json"),
    log:
        run_path("logs/export_speculators_chunk_{chunk}.log"),
    benchmark:
        run_path("benchmarks/export_speculators_chunk_{chunk}.tsv")
    wildcard_constraints:
        chunk=r"\d{5}",
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/export_speculators_chunk.py"


rule export_speculators_summary:
    input:
        done=expand(run_path("export/speculators/done/chunk_{chunk}.json"), chunk=CHUNK_IDS),
        dataset=run_path("export/speculators/done/dataset.json"),
        manifest=run_path("manifest.json"),
    output:
        summary=run_path("export/speculators/export.json"),
    log:
        run_path("logs/export_speculators_summary.log"),
    benchmark:
        run_path("benchmarks/export_speculators_summary.tsv")
    conda:
        "../envs/hsextract.yaml"
    script:
        "../scripts/export_speculators_summary.py"


rule export_speculators:
    input:
        summary=run_path("export/speculators/export.json"),
        done=expand(run_path("export/speculators/done/chunk_{chunk}.json"), chunk=CHUNK_IDS),
        hidden=export_chunk_files,
        settings=settings_files(),
