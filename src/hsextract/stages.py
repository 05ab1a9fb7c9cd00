"""What each stage's outputs depend on beyond its input files.

Apart from hsextract.config because it needs the records' identity and the chunk count
(hsextract.records, hsextract.sizing), which themselves read the config: kept in config, it
made the config import its own readers.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hsextract.config import demo_data_settings_file, input_shards, launch_settings
from hsextract.config_types import Config
from hsextract.sizing import chunk_count


def stage_settings(cfg: Config) -> dict[str, dict[str, Any]]:
    """What each stage's outputs depend on beyond its input files, by stage (merge, split,
    launch, stale, and with the demo demo_data and demo_model): rules/common.smk names each
    in a settings file, and tests/test_settings.py checks every key's kind against them.

    The merge's shards are stat'ed (one each): a shard changed and then given an older
    mtime (cp -p, rsync -a, tar x), which Snakemake's newer-than trigger never sees, is a
    new name, so the merge reruns.  The demo's shards are compared with what demo_data
    recorded making them (records.identity_as_made).
    """
    from hsextract.records import ASSIGNMENT, identity_as_made, input_identity

    demo = asdict(cfg.demo)
    out: dict[str, dict[str, Any]] = {}
    if cfg.demo.enabled:
        out["demo_data"] = {
            "demo": {k: demo[k] for k in ("seed", "n_records", "n_shards", "vocab_size")},
            "max_seq_len": cfg.max_seq_len,
        }
        out["demo_model"] = {
            "demo": {k: demo[k] for k in ("seed", "num_hidden_layers", "hidden_size", "vocab_size")}
        }
        made_file = Path(demo_data_settings_file(cfg, out["demo_data"]))
        made = json.loads(made_file.read_text()).get("shards") if made_file.exists() else None
        inputs: list = identity_as_made(input_shards(cfg), made)
    else:
        inputs = input_identity(input_shards(cfg))
    out["merge"] = {
        "max_seq_len": cfg.max_seq_len,
        "overlength": cfg.merge.overlength,
        "seed": cfg.seed,
        "inputs": inputs,
    }
    out["split"] = {"n_chunks": chunk_count(cfg), "assignment": ASSIGNMENT}
    out["launch"] = launch_settings(cfg)
    # A changed stale.* setting reruns delete_stale_states, so that stale.delete_finished:
    # true deletes what the plan printed at startup says it will.
    out["stale"] = asdict(cfg.stale)
    return out
