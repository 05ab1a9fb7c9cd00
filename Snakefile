# hsextract: raw tokenized shards -> verified per-chunk hidden states.
#   snakemake -j1 extract_all     everything
#   snakemake -n extract_all      the plan (no model loaded, no GPU touched)
#   snakemake -j1 <chunk file>    redo one chunk
from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/data.smk"
include: "rules/server.smk"
include: "rules/extract.smk"


localrules:
    extract_all,
    chunk_index,
    plan_chunks,


# The chunk files are listed here, not only through the manifest (which reads their
# sidecars): Snakemake does not regenerate a missing intermediate whose consumers are up
# to date, and a deleted chunk must be planned again by `snakemake -n extract_all`.
# Each list only once per rule: every listed file costs planning time per chunk.  The
# settings files are here for the same reason: a changed setting is a missing file, which
# only a target's inputs make Snakemake regenerate.
rule extract_all:
    input:
        hidden=expand(run_path("hidden/chunk_{chunk}.safetensors"), chunk=CHUNK_IDS),
        manifest=run_path("manifest.json"),
        settings=settings_files(),
    default_target: True


onstart:
    hold_run()


onsuccess:
    stop_servers()


onerror:
    stop_servers()
