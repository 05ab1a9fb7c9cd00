"""Config loading, the typed config, derived values and the run fingerprint.

The fingerprint is computed from the config alone (not from files on disk) so Snakemake
can place every output under ``<output_root>/<fingerprint>/`` at parse time, before the
demo model exists.  It covers everything that changes the numbers written.

The code reads the config typed (:func:`typed`: ``cfg.server.host``, the dataclasses
generated from hsextract.settings into hsextract.config_types); the raw dict stays where
the config enters (Snakemake's ``config``, :func:`load_config`, the validation here) and
where a digest is taken of it (:func:`fingerprint_payload`, :func:`launch_settings`):
those hash the dict as written, so a run made before the typed config stays current.
Every function here takes either.
"""

from __future__ import annotations

import copy
import getpass
import hashlib
import json
import os
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from hsextract.config_types import Config
from hsextract.convention import CAPTURE_CONVENTION, default_aux_layers, prenorm_layer
from hsextract.errors import ConfigError
from hsextract.settings import GROUPS, SETTINGS, class_name

#: A config as the workflow hands it over (a validated dict) or as the code reads it.
AnyConfig = Config | dict

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


def typed(cfg: AnyConfig) -> Config:
    """The config as typed objects, each declared default filled where a key is absent
    (a config the schema validated has them all already); a Config is returned as is.

    Lists become tuples (the objects are frozen).  Keys the declarations do not name are
    left out: the schema refuses them where a config enters, and a config recorded by an
    older release (a manifest's) may hold one.  ``raw`` keeps the dict for the digests.
    """
    if isinstance(cfg, Config):
        return cfg
    try:
        return _build("", cfg, raw=cfg)
    except TypeError as exc:  # a required key is missing: the dataclass names it
        raise ConfigError(f"the config is incomplete: {exc}") from None


def _build(prefix: str, values: dict, **extra: Any) -> Any:
    from dataclasses import fields

    from hsextract import config_types

    cls = getattr(config_types, class_name(prefix))
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in values or f.name in extra:
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = values[f.name]
        if key in GROUPS:
            value = _build(key, value or {})
        elif isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, dict):
            value = dict(value)
        kwargs[f.name] = value
    return cls(**kwargs, **extra)


def as_raw(cfg: AnyConfig) -> dict:
    """The dict a config was built from: what the digests are taken of."""
    return cfg.raw if isinstance(cfg, Config) else cfg


def validate(cfg: dict) -> dict:
    """Validate (and fill defaults) with the same schema Snakemake's ``validate`` uses."""
    from snakemake.utils import validate as sm_validate

    coerce_to_schema(cfg)
    sm_validate(cfg, str(SCHEMA_PATH), set_default=True)
    check_semantics(cfg)
    return cfg


def coerce_to_schema(cfg: dict) -> dict:
    """Give strings the types the schema asks for, in place.

    ``snakemake --config aux_layers=[1,3,5]`` parses the list with YAML's base loader,
    so its items arrive as strings; the same holds inside any list or mapping given on
    the command line.  Only strings that spell a value of the schema's type are changed.
    """
    with open(SCHEMA_PATH) as f:
        schema = yaml.safe_load(f)
    _coerce(cfg, schema)
    return cfg


def _coerce(value: Any, schema: dict) -> Any:
    types = schema.get("type", [])
    types = types if isinstance(types, list) else [types]
    if isinstance(value, str):
        if "integer" in types and re.fullmatch(r"[+-]?\d+", value):
            return int(value)
        if "number" in types:
            try:
                return float(value)
            except ValueError:
                pass
        if "boolean" in types and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if "null" in types and value in ("null", "~"):
            return None
        return value
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for k, v in value.items():
            sub = props.get(k, extra if isinstance(extra, dict) else {})
            value[k] = _coerce(v, sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value[:] = [_coerce(v, schema["items"]) for v in value]
    return value


def _default(key: str) -> Any:
    """A key's declared default, for validation code reading a dict that may lack it."""
    return SETTINGS[key].default


def check_semantics(cfg: dict) -> None:
    """Cross-key rules a JSON schema cannot express (on the dict: it may be partial)."""
    server = cfg.get("server", {})
    host = server.get("host", _default("server.host"))
    if not is_loopback(host):
        if not server.get("allow_remote"):
            raise ConfigError(
                f"server.host={host!r} is not loopback; set server.allow_remote: true "
                "and server.api_key to expose the extraction server"
            )
        if not server.get("api_key"):
            raise ConfigError(f"server.host={host!r} is not loopback: server.api_key is required")
    cps = server.get("chunked_prefill_size", _default("server.chunked_prefill_size"))
    if cps not in (-1,) and cps < 1:
        raise ConfigError(f"server.chunked_prefill_size must be -1 (off) or >= 1, got {cps}")
    if cfg.get("aux_layers") is not None and len(set(cfg["aux_layers"])) != len(cfg["aux_layers"]):
        raise ConfigError(f"aux_layers has duplicates: {cfg['aux_layers']}")
    check_demo(cfg)
    check_dump_dir(cfg)


def demo_inputs(cfg: dict) -> str:
    """The glob of the shards the demo generates (rules/common.smk, ``demo_shards``)."""
    return os.path.normpath(f"{cfg['output_root']}/demo/data/shard_*.jsonl")


def check_demo(cfg: dict) -> None:
    """The demo and a user's own data or model never mix, and neither is dropped silently.

    ``demo.enabled`` extracts the shards it generates with the random-weight model it
    builds at ``model.path``.  Other ``inputs`` beside it would be ignored (a new user's
    ``--config inputs=[...]`` extracted the demo's data without a word), and what is at
    ``model.path`` would be overwritten; both are refused, saying what to set.
    Without the demo, ``inputs`` is required.  ``inputs`` naming the demo's own shards is
    accepted: configs written before this check had that value.  ``model.path`` must be
    new, empty or the demo's own (``demo.demo_model_refusal``): the demo never writes over
    or removes files it did not create.
    """
    inputs = cfg.get("inputs") or []
    if not (cfg.get("demo") or {}).get("enabled"):
        if not inputs:
            raise ConfigError(
                "inputs is not set: list the JSON-lines shards to extract (paths or globs), "
                'e.g. inputs: ["/data/shards/*.jsonl"]; or set demo.enabled: true to run '
                "the embedded demo"
            )
        return
    if inputs and [os.path.normpath(p) for p in inputs] != [demo_inputs(cfg)]:
        raise ConfigError(
            f"inputs {inputs} would be ignored: demo.enabled is true, and the demo extracts "
            f"the shards it generates ({demo_inputs(cfg)}) with a random-weight model. "
            "To extract your data, set demo.enabled: false and model.path (and model.dtype) "
            "to the model it was tokenized for: in a config file (start from "
            "configs/deepseek-v3-8xh200.yaml) or on Snakemake's command line: --config "
            "'demo={enabled: false}' 'model={path: /path/to/model, dtype: bfloat16}'. To "
            "run the demo, leave inputs unset"
        )
    from hsextract.demo import demo_model_refusal

    why = demo_model_refusal(Path(cfg["model"]["path"]))
    if why:
        raise ConfigError(why)


#: Directories every user of a host shares: never a dump dir themselves (a child is fine).
SHARED_DIRS = ("/dev/shm", "/tmp", "/var/tmp", "/run", "/dev")


def unsafe_dir(path: Path, *, shared: bool = True, mount: bool = True) -> str | None:
    """Why ``path`` may not be a directory hsextract empties or removes, or None.

    Resolved first (``..``, symlinks): ``/``, ``$HOME`` or any directory above it, with
    ``shared`` the host's shared directories (:data:`SHARED_DIRS`), with ``mount`` a mount
    point (a filesystem root: /dev/shm itself, a RAM disk, a scratch volume).
    """
    resolved = Path(os.path.realpath(os.path.abspath(path)))
    home = Path(os.path.realpath(os.path.expanduser("~")))
    if resolved == Path(resolved.anchor):
        return "it resolves to '/'"
    if resolved == home or resolved in home.parents:
        return f"it is $HOME ({home})" if resolved == home else f"it holds $HOME ({home})"
    if shared and resolved in {Path(os.path.realpath(d)) for d in SHARED_DIRS}:
        return f"{resolved} is shared by every user of this host"
    if mount and resolved.is_dir() and os.path.ismount(resolved):
        return f"{resolved} is a filesystem root (mount point)"
    return None


def marker_temp(name: str) -> bool:
    """The temporary name ``server.write_json`` gives the marker while it writes it."""
    return bool(re.fullmatch(re.escape(f".{RUN_MARKER}.") + r"\d+(\.\d+)?\.tmp", name))


def dump_dir_refusal(path: Path) -> str | None:
    """Why ``path`` may not be used as a dump dir, or None (absent, empty, or marked ours).

    The dump dir is emptied by stale deletion and removed when the server stops, so it
    must be hsextract's own: a new dir, an empty one (adopted: mode 0700, marker written),
    or one that already carries the marker.  Anything else holds someone's files.
    """
    shown = str(path)
    why = unsafe_dir(path)
    if why:
        return (
            f"dump.dir {shown} is refused: {why}. hsextract empties and removes its dump dir; "
            "set dump.dir to a new subdirectory (e.g. "
            f"{os.path.join(os.path.realpath(path), 'hsextract-dump')}), or to null for "
            "/dev/shm/hsextract-<user>-<uid>-<fingerprint>-<tag>"
        )
    if path.is_symlink() or not path.is_dir():
        return None  # absent (created as ours) or not a dir: prepare_dump_dir says which
    marker = path / RUN_MARKER
    if marker.is_file() and not marker.is_symlink():
        return None
    try:
        names = sorted(e.name for e in os.scandir(path) if not marker_temp(e.name))
    except PermissionError:
        return None  # not ours: prepare_dump_dir names the owner
    if not names:
        return None
    return (
        f"dump.dir {shown} is not empty and was not created by hsextract (no {RUN_MARKER} "
        f"marker): it holds {name_list(names)}. hsextract empties its dump dir, so it never "
        "adopts one holding files it did not write: set dump.dir to a new or empty "
        "directory (or null for the default under /dev/shm)"
    )


def name_list(names: list[str], most: int = 5) -> str:
    """The first few names of a refused directory's contents, for its message."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def check_dump_dir(cfg: dict) -> None:
    """A configured dump.dir that would hold someone's files is refused at planning."""
    configured = (cfg.get("dump") or {}).get("dir")
    if configured:
        why = dump_dir_refusal(Path(configured))
        if why:
            raise ConfigError(why)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def resolve_aux_layers(cfg: AnyConfig, num_layers: int) -> list[int]:
    layers = typed(cfg).aux_layers
    layers = default_aux_layers(num_layers) if layers is None else list(layers)
    for layer in layers:
        if not 0 <= layer < num_layers:
            raise ConfigError(f"aux_layers {layers}: layer {layer} outside [0, {num_layers})")
    return layers


def captured_layers(cfg: AnyConfig, num_layers: int) -> list[int]:
    """What a dump holds as aux, in order: the EAGLE-3 layers, then with ``prenorm_final``
    the stream before the final norm (index L, :func:`convention.prenorm_layer`)."""
    layers = resolve_aux_layers(cfg, num_layers)
    return [*layers, prenorm_layer(num_layers)] if typed(cfg).prenorm_final else layers


def server_aux_layers(cfg: AnyConfig) -> list[int] | None:
    """The aux layers a server must be told, or None to let it use the EAGLE-3 default
    (no model config is read then: the default is computed where the model is loaded)."""
    c = typed(cfg)
    if c.prenorm_final:
        return captured_layers(c, int(read_model_config(c)["num_hidden_layers"]))
    return None if c.aux_layers is None else list(c.aux_layers)


def read_model_config(cfg: AnyConfig) -> dict:
    """The model's HF config.json (its text part for multimodal checkpoints)."""
    data = json.loads((Path(typed(cfg).model.path) / "config.json").read_text())
    return data.get("text_config", data)


def model_identity(cfg: AnyConfig) -> dict:
    """What names the model's weights: the path, a revision tag, and the demo recipe.

    The path as configured, not resolved: a copied or moved project keeps its run dirs.
    The dict as written (:func:`as_raw`), as for the whole fingerprint.
    """
    cfg = as_raw(cfg)
    ident: dict[str, Any] = {
        "path": os.path.normpath(cfg["model"]["path"]),
        "revision": cfg["model"].get("revision"),
        "dtype": cfg["model"]["dtype"],
    }
    demo = cfg.get("demo", {})
    if demo.get("enabled"):
        # The recipe of the seeded random weights (not the data: n_records, n_shards).
        ident["demo"] = {
            k: demo.get(k) for k in ("seed", "num_hidden_layers", "hidden_size", "vocab_size")
        }
    return ident


def fingerprint_payload(cfg: AnyConfig) -> dict:
    """Everything that changes the numbers a record's hidden states hold: the run dir's name.

    Deliberately not here (README, "What each setting changes"): the records themselves
    (inputs, merge policy, max_seq_len, n_chunks: each chunk's content digest tracks
    them, so only chunks whose records changed are re-extracted), how the server runs
    (chunked prefill, batching, SGLang flags: the launch spec, recorded per chunk), and
    the hsextract version (an upgrade alone must not orphan a multi-TB run).

    Taken of the dict as written, not of the typed config: keys absent from an old run's
    config (``storage``, ``prenorm_final``) must stay absent from its payload.
    """
    cfg = as_raw(cfg)
    payload = {
        "model": model_identity(cfg),
        "aux_layers": cfg.get("aux_layers"),
        "convention": CAPTURE_CONVENTION,
        "format_version": FORMAT_VERSION,
        "engine": cfg["engine"],
    }
    # The codec changes the bytes (fp8 the numbers too), so a run with another one is
    # another run dir; "none" is the v1 layout and leaves the fingerprint as it was, so a
    # run from before codecs existed stays valid.
    codec = storage_codec(cfg)
    if codec != "none":
        payload["storage_codec"] = codec
    if cfg.get("prenorm_final"):  # absent when off: runs from before it keep their dir
        payload["prenorm_final"] = True
    return payload


def storage_codec(cfg: AnyConfig) -> str:
    """The chunk codec: a config without ``storage``, as written before codecs, is none (not
    the declared default, lossless, which the schema fills in every config validated now)."""
    return str((as_raw(cfg).get("storage") or {}).get("codec", "none"))


def fingerprint(cfg: AnyConfig) -> str:
    """A short hash of :func:`fingerprint_payload`."""
    blob = json.dumps(fingerprint_payload(cfg), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def launch_settings(cfg: AnyConfig) -> dict[str, Any]:
    """What the extraction server is started with, beyond what the fingerprint names.

    A change takes effect at the next launch (``launch_server`` reruns on it, and
    ``ensure()`` replaces a live server started with other settings); finished chunks
    are kept, and each chunk's sidecar records the settings that produced it.  No
    secrets: the API key only as set or not (the client's key is checked by /health).
    The dict as written (:func:`as_raw`): its digest names a settings file of every run.
    """
    cfg = as_raw(cfg)
    server = cfg["server"]
    out: dict[str, Any] = {
        "engine": cfg["engine"],
        "model_path": cfg["model"]["path"],
        "dtype": cfg["model"]["dtype"],
        "aux_layers": cfg.get("aux_layers"),
        "max_seq_len": cfg["max_seq_len"],  # the context length follows it
        "host": server["host"],
        "port": server["port"],
        "api_key": bool(server.get("api_key")),
        "chunked_prefill_size": server["chunked_prefill_size"],
        "max_running_requests": server["max_running_requests"],
        # As configured: the default's path moves with the project, which is no reason
        # to replace a server (the client reads pieces where the live server writes them).
        "dump_dir": (cfg.get("dump") or {}).get("dir"),
    }
    if cfg.get("prenorm_final"):  # only when on: a digest from before it stays the same
        out["prenorm_final"] = True
    # dp_size only when > 1: a digest from before it existed stays the same.
    dp = int((cfg.get("sglang") or {}).get("dp_size", 1))
    if cfg["engine"] == "reference":
        out["device"] = server["device"]
        out["batch_invariant"] = server["batch_invariant"]
        if dp > 1:
            out["dp_size"] = dp
    else:
        out["capture"] = cfg.get("capture", "patch")
        out["sglang"] = {
            k: v for k, v in (cfg.get("sglang") or {}).items() if not (k == "dp_size" and v == 1)
        }
    return out


def settings_digest(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[
        :12
    ]


def run_dir(cfg: AnyConfig) -> Path:
    return Path(typed(cfg).output_root) / fingerprint(cfg)


def dump_dir(cfg: AnyConfig) -> Path:
    """Per-user, per-run dump dir on /dev/shm unless configured; never shared between users.

    The output root's hash is in the name too: two checkouts of the same config on one
    host must not share (or stale-delete) each other's in-flight pieces.
    """
    configured = typed(cfg).dump.dir
    if configured:
        return Path(configured)
    name = f"hsextract-{getpass.getuser()}-{os.getuid()}-{fingerprint(cfg)}-{output_root_tag(cfg)}"
    return Path("/dev/shm") / name


def output_root_tag(cfg: AnyConfig) -> str:
    """A short hash of the resolved output root: two checkouts never share a dump dir."""
    return hashlib.sha256(str(Path(typed(cfg).output_root).resolve()).encode()).hexdigest()[:6]


def public_config(cfg: AnyConfig) -> dict:
    """The config as written, secrets masked, for state files and logs."""
    out = copy.deepcopy(as_raw(cfg))
    if out.get("server", {}).get("api_key"):
        out["server"]["api_key"] = "***"
    return out


def demo_shards(cfg: AnyConfig) -> list[str]:
    """The demo's shard paths (demo_data writes them)."""
    c = typed(cfg)
    return [f"{c.output_root}/demo/data/shard_{i:02d}.jsonl" for i in range(c.demo.n_shards)]


def input_shards(cfg: AnyConfig) -> list[str]:
    """The demo's shards, or every file the configured paths and globs match: the
    library's one expansion (records.resolve_inputs: `**` recursive, sorted, each file
    once), so the workflow merges exactly the shards `hsextract plan` and the merge see."""
    from hsextract.records import resolve_inputs

    c = typed(cfg)
    if c.demo.enabled:
        return demo_shards(c)
    return [str(p) for p in resolve_inputs(list(c.inputs or []))]


def stage_settings(cfg: AnyConfig) -> dict[str, dict[str, Any]]:
    """What each stage's outputs depend on beyond its input files, by stage (merge, split,
    launch, stale, and with the demo demo_data and demo_model): rules/common.smk names each
    in a settings file, and tests/test_settings.py checks every key's kind against them.

    The merge's shards are stat'ed (one each): a shard changed and then given an older
    mtime (cp -p, rsync -a, tar x), which Snakemake's newer-than trigger never sees, is a
    new name, so the merge reruns.  The demo's shards are compared with what demo_data
    recorded making them (records.identity_as_made).
    """
    from hsextract.records import ASSIGNMENT, identity_as_made, input_identity

    c = typed(cfg)
    demo = asdict(c.demo)
    out: dict[str, dict[str, Any]] = {}
    if c.demo.enabled:
        out["demo_data"] = {
            "demo": {k: demo[k] for k in ("seed", "n_records", "n_shards", "vocab_size")},
            "max_seq_len": c.max_seq_len,
        }
        out["demo_model"] = {
            "demo": {k: demo[k] for k in ("seed", "num_hidden_layers", "hidden_size", "vocab_size")}
        }
        made_file = Path(demo_data_settings_file(c, out["demo_data"]))
        made = json.loads(made_file.read_text()).get("shards") if made_file.exists() else None
        inputs: list = identity_as_made(input_shards(c), made)
    else:
        inputs = input_identity(input_shards(c))
    out["merge"] = {
        "max_seq_len": c.max_seq_len,
        "overlength": c.merge.overlength,
        "seed": c.seed,
        "inputs": inputs,
    }
    out["split"] = {"n_chunks": c.n_chunks, "assignment": ASSIGNMENT}
    out["launch"] = launch_settings(c)
    # A changed stale.* setting reruns delete_stale_states, so that stale.delete_finished:
    # true deletes what the plan printed at startup says it will.
    out["stale"] = asdict(c.stale)
    return out


def demo_data_settings_file(cfg: AnyConfig, values: dict[str, Any]) -> str:
    return f"{typed(cfg).output_root}/demo/data/settings-{settings_digest(values)}.json"
