import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../src")  # noqa: F821 - conda envs lack our install
from hsextract.smk import run_step  # noqa: E402
from hsextract.steps import audit  # noqa: E402

run_step(snakemake, audit)  # noqa: F821 - injected by Snakemake
