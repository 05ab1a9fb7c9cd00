"""Config loading, derived values and the run fingerprint.

The fingerprint is computed from the config alone (not from files on disk) so Snakemake
can place every output under ``<output_root>/<fingerprint>/`` at parse time, before the
demo model exists.  It covers everything that changes the numbers written.
"""

from __future__ import annotations

import copy
import getpass
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import yaml

from hsextract.convention import CAPTURE_CONVENTION, default_aux_layers
from hsextract.errors import ConfigError

#: Bump when the capture convention or file layout changes what a run writes.
FORMAT_VERSION = "1"
#: Marks a directory as created by this pipeline; stale deletion only ever removes those.
RUN_MARKER = ".hsextract-run"

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"


def load_config(path: str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> dict:
    """Read a YAML config, apply dotted overrides, validate against the schema."""
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    for key, value in (overrides or {}).items():
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    validate(cfg)
    return cfg


def validate(cfg: dict) -> dict:
    """Validate (and fill defaults) with the same schema Snakemake's ``validate`` uses."""
    from snakemake.utils import validate as sm_validate

    sm_validate(cfg, str(SCHEMA_PATH), set_default=True)
    check_semantics(cfg)
    return cfg


def check_semantics(cfg: dict) -> None:
    """Cross-key rules a JSON schema cannot express."""
    server = cfg.get("server", {})
    host = server.get("host", "127.0.0.1")
    if not is_loopback(host):
        if not server.get("allow_remote"):
            raise ConfigError(
                f"server.host={host!r} is not loopback; set server.allow_remote: true "
                "and server.api_key to expose the extraction server"
            )
        if not server.get("api_key"):
            raise ConfigError(f"server.host={host!r} is not loopback: server.api_key is required")
    cps = server.get("chunked_prefill_size", -1)
    if cps not in (-1,) and cps < 1:
        raise ConfigError(f"server.chunked_prefill_size must be -1 (off) or >= 1, got {cps}")
    if cfg.get("aux_layers") is not None and len(set(cfg["aux_layers"])) != len(cfg["aux_layers"]):
        raise ConfigError(f"aux_layers has duplicates: {cfg['aux_layers']}")


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def resolve_aux_layers(cfg: dict, num_layers: int) -> list[int]:
    layers = cfg.get("aux_layers")
    layers = default_aux_layers(num_layers) if layers is None else list(layers)
    for layer in layers:
        if not 0 <= layer < num_layers:
            raise ConfigError(f"aux_layers {layers}: layer {layer} outside [0, {num_layers})")
    return layers


def read_model_config(cfg: dict) -> dict:
    """The model's HF config.json (its text part for multimodal checkpoints)."""
    data = json.loads((Path(cfg["model"]["path"]) / "config.json").read_text())
    return data.get("text_config", data)


def model_identity(cfg: dict) -> dict:
    """What names the model's weights: the path, a revision tag, and the demo recipe.

    The path as configured, not resolved: a copied or moved project keeps its run dirs.
    """
    ident: dict[str, Any] = {
        "path": os.path.normpath(cfg["model"]["path"]),
        "revision": cfg["model"].get("revision"),
        "dtype": cfg["model"]["dtype"],
    }
    if cfg.get("demo", {}).get("enabled"):
        ident["demo"] = {k: v for k, v in cfg["demo"].items() if k not in ("n_records", "n_shards")}
        ident["seed"] = cfg["seed"]
    return ident


def fingerprint(cfg: dict) -> str:
    """A short hash of everything that changes the numbers in the output files."""
    from hsextract import __version__

    payload = {
        "model": model_identity(cfg),
        "aux_layers": cfg.get("aux_layers"),
        "max_seq_len": cfg["max_seq_len"],
        "convention": CAPTURE_CONVENTION,
        "format_version": FORMAT_VERSION,
        "engine": cfg["engine"],
        "engine_version": __version__,
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def run_dir(cfg: dict) -> Path:
    return Path(cfg["output_root"]) / fingerprint(cfg)


def dump_dir(cfg: dict) -> Path:
    """Per-user, per-run dump dir on /dev/shm unless configured; never shared between users.

    The output root's hash is in the name too: two checkouts of the same config on one
    host must not share (or stale-delete) each other's in-flight pieces.
    """
    configured = cfg.get("dump", {}).get("dir")
    if configured:
        return Path(configured)
    root = hashlib.sha256(str(Path(cfg["output_root"]).resolve()).encode()).hexdigest()[:6]
    name = f"hsextract-{getpass.getuser()}-{os.getuid()}-{fingerprint(cfg)}-{root}"
    return Path("/dev/shm") / name


def public_config(cfg: dict) -> dict:
    """The config with secrets masked, for state files and logs."""
    out = copy.deepcopy(cfg)
    if out.get("server", {}).get("api_key"):
        out["server"]["api_key"] = "***"
    return out
