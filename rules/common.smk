import glob
import os
from pathlib import Path

from snakemake.utils import validate

from hsextract.config import check_semantics, dump_dir, fingerprint, run_dir
from hsextract.server import OWNER_ENV, pid_alive, remove_dump_dir_if_empty, stop_live

validate(config, schema="../schemas/config.schema.yaml", set_default=True)
check_semantics(config)

RUN = run_dir(config)
FINGERPRINT = fingerprint(config)
CHUNK_IDS = [f"{i:05d}" for i in range(config["n_chunks"])]
MODEL_DIR = Path(config["model"]["path"])

# Servers started by this workflow are owned by this process: the watchdog stops them
# when it exits.  Jobs inherit the variable; a nested Snakemake keeps its parent's owner.
if not pid_alive(os.environ.get(OWNER_ENV)):
    os.environ[OWNER_ENV] = str(os.getpid())


def run_path(*parts):
    return str(RUN.joinpath(*parts))


def demo_shards():
    return [f"{config['output_root']}/demo/data/shard_{i:02d}.jsonl" for i in range(config["demo"]["n_shards"])]


def input_shards(wildcards=None):
    """The demo's shards, or every file the configured globs match (sorted, deduplicated)."""
    if config["demo"]["enabled"]:
        return demo_shards()
    found = []
    for pattern in config["inputs"]:
        matches = sorted(glob.glob(pattern))
        if not matches:
            raise ValueError(f"inputs: {pattern!r} matches no file; fix `inputs` in the config")
        found.extend(m for m in matches if m not in found)
    return found


def model_config_file():
    return str(MODEL_DIR / "config.json")


def stop_servers():
    if stop_live(RUN / "state"):
        print(f"hsextract: stopped the extraction server of {RUN}")
    remove_dump_dir_if_empty(dump_dir(config))
