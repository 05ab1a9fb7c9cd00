import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../src")  # noqa: F821 - conda envs lack our install
from hsextract.smk import run_step  # noqa: E402
from hsextract.steps import report_figures  # noqa: E402

run_step(snakemake, report_figures)  # noqa: F821 - injected by Snakemake
