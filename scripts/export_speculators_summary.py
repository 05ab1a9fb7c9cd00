import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../src")  # noqa: F821 - conda envs lack our install
from hsextract.export.speculators import step_summary  # noqa: E402
from hsextract.smk import run_step  # noqa: E402

run_step(snakemake, step_summary)  # noqa: F821 - injected by Snakemake
