"""Config loading, the typed config, derived values and the run fingerprint.

The fingerprint is computed from the config alone (not from files on disk) so Snakemake
can place every output under ``<output_root>/<fingerprint>/`` at parse time, before the
demo model exists.  It covers everything that changes the numbers written.

The code reads the config typed (:func:`typed`: ``cfg.server.host``, the dataclasses
generated from hsextract.settings into hsextract.config_types); the raw dict stays where
the config enters (Snakemake's ``config``, :func:`load_config`, the validation here) and
where a digest is taken of it (``Config.raw``: :func:`fingerprint_payload`,
:func:`launch_settings`): those hash the dict as written, so a run made before the typed
config stays current.  Everything past the entry takes a :class:`Config`.
"""

from __future__ import annotations

import copy
import functools
import getpass
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from hsextract.commands import config_entry, recorded
from hsextract.config_types import Config
from hsextract.convention import CAPTURE_CONVENTION, default_aux_layers, prenorm_layer
from hsextract.errors import ConfigError, name_list
from hsextract.settings import GROUPS, SETTINGS, class_name

#: Bump when the capture convention or file layout changes what a run writes.
FORMAT_VERSION = "1"
#: Marks a directory as created by this pipeline; stale deletion only ever removes those.
RUN_MARKER = ".hsextract-run"

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"


#: The config a command reads when it is given no ``--configfile``: the working directory's
#: ``config.yaml`` (the project's own is the embedded demo).
DEFAULT_CONFIGFILE = "config.yaml"


def load_config(
    configfiles: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> dict:
    """The config every command reads -- the workflow (rules/common.smk) and each
    ``hsextract`` command alike, from whichever directory it is run.

    The ``--configfile`` files, merged in order (a later file's mappings merged into the
    earlier's, other values replaced), or with none the working directory's config.yaml;
    then the ``--config`` overrides (dotted keys: ``server.port=30000``); then validated.
    Never a file beneath another: the demo's config.yaml used to be merged under every
    ``--configfile`` when the working directory held one, so a user's run inherited the
    demo's ``model.revision`` and ``max_reject_fraction`` there and not elsewhere (another
    fingerprint), and ``--config 'demo={enabled: false}'`` kept its ``max_seq_len: 512``.
    """
    layers = [(str(f), read_config_file(f)) for f in config_files(configfiles)]
    extra = coerce_to_schema(nest(overrides or {}))  # --config's values are strings
    refuse_bad_overrides(extra)
    layers.append(("--config", extra))
    refuse_demo_leak(layers)
    cfg: dict = {}
    for _, layer in layers:
        merge_into(cfg, layer)
    validate(cfg)
    return cfg


def where_set(
    key: str,
    configfiles: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> str:
    """Where ``key`` (dotted) got its value, as :func:`load_config` reads the sources:
    ``--config``, else the last config file setting it, else the schema's default.

    For messages that name a value the user may not know they set: with ``--configfile
    config.yaml my.yaml`` the demo's ``max_seq_len: 512`` applied to the user's data.
    """
    parts = key.split(".")

    def has(node: Any) -> bool:
        for p in parts:
            if not isinstance(node, Mapping) or p not in node:
                return False
            node = node[p]
        return True

    if has(nest(overrides or {})):
        return "--config"
    for f in reversed(config_files(configfiles)):
        if has(read_config_file(f)):
            return f"config file {f}"
    return "the default"


def read_config(
    configfiles: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """:func:`load_config`, typed: what a command hands the library (the rules type
    Snakemake's dict once, in rules/common.smk and steps.py)."""
    return typed(load_config(configfiles, overrides))


def config_files(
    configfiles: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None,
) -> list[Path]:
    """The files a config is read from: those given, else ./config.yaml (named if absent)."""
    if isinstance(configfiles, str | os.PathLike):
        configfiles = [configfiles]
    if configfiles:
        return [Path(f) for f in configfiles]
    default = Path(DEFAULT_CONFIGFILE)
    if not default.is_file():
        raise ConfigError(
            f"no config: no --configfile was given and {Path.cwd()} holds no "
            f"{DEFAULT_CONFIGFILE}; pass --configfile FILE (start from one in the project's "
            "configs/), or run in the project directory for the embedded demo"
        )
    return [default]


def read_config_file(path: Path) -> dict:
    """One config file as a mapping, or a sentence naming it and what is wrong."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist (--configfile)") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"config file {path} cannot be read: {why}") from None
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} holds a {type(data).__name__}, not a mapping of settings "
            "(key: value lines, as in config.yaml)"
        )
    return data


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping.

    PyYAML keeps the last of two equal keys without a word, so a config that sets
    ``port`` twice (an edit pasted below the old line) ran with whichever came last; the
    YAML spec says keys are unique, so it is refused, naming the line of each.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` merges, and may be overridden below it
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                first = seen.setdefault(key, line)
            except TypeError:
                continue  # an unhashable key: the constructor below refuses it
            if first != line:
                raise yaml.constructor.ConstructorError(
                    problem=f"key {key!r} is set twice in one mapping (lines {first} and "
                    f"{line}), and YAML would silently keep the last: delete one of them",
                    problem_mark=key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def nest(overrides: Mapping[str, Any]) -> dict:
    """``{"server.port": 1}`` -> ``{"server": {"port": 1}}``; nested values kept."""
    out: dict = {}
    for key, value in overrides.items():
        parts = str(key).split(".")
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--config {key}: {'.'.join(parts[:-1])} is not a mapping")
            node = nxt
        merge_into(node, {parts[-1]: dict(value) if isinstance(value, Mapping) else value})
    return out


def merge_into(base: dict, top: Mapping[str, Any]) -> dict:
    """Mappings merged key by key, any other value replaced (Snakemake's update_config)."""
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            merge_into(base[key], value)
        else:
            base[key] = dict(value) if isinstance(value, Mapping) else value
    return base


def refuse_bad_overrides(overrides: dict) -> None:
    """A ``--config`` value the schema refuses is named as ``--config KEY=VALUE``.

    Checked before the merge: validated with the files, it was reported as a bad key of
    the config (the hsextract CLI even blamed ``./config.yaml`` for a value that did not
    parse), and the user looked for it in the wrong file.
    """
    import difflib
    import shlex

    import jsonschema

    def walk(value: Any, schema: dict, path: list[str]) -> None:
        props = schema.get("properties")
        if isinstance(value, dict) and props is not None:
            extra = schema.get("additionalProperties", True)
            for key, sub in value.items():
                if key in props:
                    walk(sub, props[key], [*path, str(key)])
                elif isinstance(extra, dict):
                    walk(sub, extra, [*path, str(key)])
                elif extra is False:
                    close = difflib.get_close_matches(str(key), sorted(props), n=1)
                    hint = f" (did you mean {close[0]}?)" if close else ""
                    where = ".".join(path)
                    raise ConfigError(
                        f"--config {shlex.quote(config_entry([*path, str(key)], sub))}: config "
                        f"key {'.'.join([*path, str(key)])}{hint} is not a setting; "
                        f"{where or 'the top level'} takes {', '.join(sorted(props))}"
                    )
            return
        entry = shlex.quote(config_entry(path, value))
        try:
            _refuse_fractional(value, schema, ".".join(path))
        except ConfigError as exc:
            raise ConfigError(f"--config {entry}: {exc}") from None
        leaf = {k: v for k, v in schema.items() if k != "required"}
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(leaf).iter_errors(value)
        )
        if error is not None:
            group = " (a group is written KEY='{sub: value}', e.g. server='{port: 0}')"
            raise ConfigError(
                f"--config {entry}: config key {'.'.join(path)} = "
                f"{json.dumps(value, default=str)} is refused: {error.message}; fix that "
                "--config value" + (group if schema.get("type") == "object" else "")
            )

    walk(overrides, _schema(), [])


def refuse_demo_leak(layers: list[tuple[str, dict]]) -> None:
    """A layer that turns the demo off on top of one that turns it on is refused, not merged:
    ``--configfile config.yaml my.yaml`` as much as ``--config 'demo={enabled: false}'``.

    The demo's config holds values chosen for its 48 tiny records (``max_seq_len: 512``,
    ``n_chunks: 4``, ``model.revision: demo-v1``, ``max_reject_fraction: 0.05``); a run of a
    user's data built on it kept them without a word (20 of 30 long records truncated).
    ``layers`` are (where it comes from, its mapping), in merge order.
    """
    demo_files = []
    for name, layer in layers:
        enabled = (layer.get("demo") or {}).get("enabled")
        if enabled:
            demo_files.append(name)
        elif enabled is False and demo_files:
            how = "--config turns" if name == "--config" else f"--configfile {name} turns"
            raise ConfigError(
                f"{how} the demo off on {', '.join(demo_files)}, the demo's config: its other "
                "values (max_seq_len, n_chunks, model.revision, merge.max_reject_fraction ...) "
                "are the demo's and would silently apply to your data. Write your own config "
                "file (start from configs/qwen3-8b-1xh200.yaml or "
                "configs/deepseek-v3-8xh200.yaml) and pass it with --configfile, alone"
            )


def typed(cfg: dict) -> Config:
    """The config as typed objects, each declared default filled where a key is absent
    (a config the schema validated has them all already).

    Called once, where a config enters: rules/common.smk and each rule's step
    (hsextract.steps: Snakemake hands scripts the dict), :func:`read_config` (the CLI,
    tests), a manifest's recorded config.  The library takes a :class:`Config` only, so a
    Config given here is refused: it was typed already, and a second conversion on every
    call was how one chunk's path typed its config nine times.

    Lists become tuples (the objects are frozen).  Keys the declarations do not name are
    left out: the schema refuses them where a config enters, and a config recorded by an
    older release (a manifest's) may hold one.  ``raw`` keeps the dict for the digests.
    """
    if not isinstance(cfg, dict):
        raise TypeError(f"typed() takes the config's dict, not {type(cfg).__name__}")
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


def validate(cfg: dict) -> dict:
    """Validate (and fill defaults) with the same schema Snakemake's ``validate`` uses; a
    refusal is one sentence naming the key (:func:`schema_refusal`), not the schema dump."""
    import jsonschema

    coerce_to_schema(cfg)
    refuse_fractional_integers(cfg)
    try:
        _defaulting_validator()(_schema()).validate(cfg)
    except jsonschema.ValidationError as exc:
        raise ConfigError(schema_refusal(cfg) or str(exc).splitlines()[0]) from None
    check_semantics(cfg)
    return cfg


def _defaulting_validator() -> Any:
    """Draft 2020-12 that fills each absent property's default as it validates: what
    ``snakemake.utils.validate(set_default=True)`` does (the recipe of jsonschema's FAQ),
    without importing Snakemake's CLI (seconds) into every ``hsextract`` command.  The
    defaults are copies: a list default filled into one config is never another's."""
    from jsonschema import Draft202012Validator, validators

    properties = Draft202012Validator.VALIDATORS["properties"]

    def set_defaults(validator: Any, props: dict, instance: Any, schema: dict) -> Any:
        if isinstance(instance, dict):
            for name, sub in props.items():
                if "default" in sub:
                    instance.setdefault(name, copy.deepcopy(sub["default"]))
        yield from properties(validator, props, instance, schema)

    return validators.extend(Draft202012Validator, {"properties": set_defaults})


@functools.cache
def _schema() -> dict:
    """The schema, read once a process (a config is checked against it five times on its
    way in: half a second each in pure-Python YAML); never modified by its readers."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(SCHEMA_PATH) as f:
        return yaml.load(f, Loader=loader)  # noqa: S506 - a safe loader


def schema_refusal(cfg: dict) -> str | None:
    """The schema's most relevant objection to ``cfg`` as a sentence naming the key."""
    import difflib

    import jsonschema

    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(_schema()).iter_errors(cfg)
    )
    if error is None:
        return None
    where = ".".join(str(p) for p in error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(allowed))
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, allowed, n=1)
            shown = f"{where}.{key}" if where else key
            hints.append(f"{shown} (did you mean {close[0]}?)" if close else shown)
        return (
            f"config key {', '.join(hints)} is not a setting; "
            f"{where or 'the top level'} takes {', '.join(allowed)} "
            "(docs/configuration.md)"
        )
    value = json.dumps(error.instance, default=str)
    if error.validator == "required":
        return f"config {where or 'top level'}: {error.message}"
    return (
        f"config key {where or '(top level)'} = {value} is refused: {error.message}; set it to "
        "a value it takes (docs/configuration.md)"
    )


def refuse_fractional_integers(cfg: dict) -> None:
    """``n_chunks: 4.0`` or ``seed: 0.0`` is refused at validation, naming the key.

    JSON Schema counts 4.0 as an integer, so it passed and then crashed a later stage
    (``range(4.0)``) -- or, for ``seed``, renamed the merge's settings file, rerunning it.
    """

    _refuse_fractional(cfg, _schema(), "")


def _refuse_fractional(value: Any, schema: dict, where: str) -> None:
    types = schema.get("type", [])
    types = types if isinstance(types, list) else [types]
    if isinstance(value, float) and "integer" in types and "number" not in types:
        whole = f" (write {int(value)})" if value.is_integer() else ""
        raise ConfigError(
            f"config key {where} = {value} must be a whole number written without a "
            f"decimal point{whole}"
        )
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for k, v in value.items():
            sub = props.get(k, extra if isinstance(extra, dict) else {})
            _refuse_fractional(v, sub, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            _refuse_fractional(v, schema["items"], f"{where}[{i}]")


def coerce_to_schema(cfg: dict) -> dict:
    """Give strings the types the schema asks for, in place.

    ``snakemake --config aux_layers=[1,3,5]`` parses the list with YAML's base loader,
    so its items arrive as strings; the same holds inside any list or mapping given on
    the command line.  Only strings that spell a value of the schema's type are changed.
    """
    _coerce(cfg, _schema())
    return cfg


def _coerce(value: Any, schema: dict) -> Any:
    types = schema.get("type", [])
    types = types if isinstance(types, list) else [types]
    if isinstance(value, str):
        if "integer" in types and re.fullmatch(r"[+-]?\d+", value):
            return int(value)
        if "integer" in types and re.fullmatch(r"[+-]?\d+\.\d*", value):
            return float(value)  # refused as a fraction, naming the key (write 2)
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
                f"server.host={host!r} is not loopback ({resolved_addresses(host)}); set "
                "server.allow_remote: true and server.api_key to expose the extraction server"
            )
        if not server.get("api_key"):
            raise ConfigError(f"server.host={host!r} is not loopback: server.api_key is required")
    cps = server.get("chunked_prefill_size", _default("server.chunked_prefill_size"))
    if cps not in (-1,) and cps < 1:
        raise ConfigError(f"server.chunked_prefill_size must be -1 (off) or >= 1, got {cps}")
    if cfg.get("aux_layers") is not None and len(set(cfg["aux_layers"])) != len(cfg["aux_layers"]):
        raise ConfigError(f"aux_layers has duplicates: {cfg['aux_layers']}")
    check_demo(cfg)
    check_inputs_outside_output_root(cfg)
    check_dump_dir(cfg)


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob as ``glob.glob(recursive=True)`` reads it (``**`` any depth, ``*`` and ``?``
    within a name, ``[...]`` a class), for matching paths that do not exist yet."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2 :]:
            j = pattern.index("]", i + 2)
            body = pattern[i + 1 : j]
            out.append("[^" + body[1:] + "]" if body.startswith("!") else "[" + body + "]")
            i = j + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _resolved_glob(pattern: str) -> str:
    """``pattern`` with the directories before its first wildcard resolved (symlinks,
    ``..``), as the filesystem names the files it matches."""
    parts = os.path.abspath(pattern).split("/")
    k = next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), len(parts))
    literal = os.path.realpath("/".join(parts[:k]) or "/")
    return "/".join([literal.rstrip("/"), *parts[k:]]) if k < len(parts) else literal


def check_inputs_outside_output_root(cfg: dict) -> None:
    """An ``inputs`` glob that matches what a run writes is refused before planning.

    With ``output_root`` under the inputs' directory (``inputs: [data/**/*.jsonl]``,
    ``output_root: data/results``) the merge's own train.jsonl or a chunk's records
    became an input of the next plan: a cyclic graph.  Decided on the paths a run writes
    (they need not exist yet), resolved from the working directory as both are, symlinks
    included (``inputs: link/**`` with ``link -> data`` and ``output_root: data/out``).
    """
    root = os.path.realpath(cfg.get("output_root") or ".")
    written = [
        f"{root}/0123456789ab/merged/train.jsonl",
        f"{root}/0123456789ab/merged/rejects.jsonl",
        f"{root}/0123456789ab/merged/.next/train.jsonl",  # the merge's, before publish_merge
        f"{root}/0123456789ab/chunks/chunk_00000.jsonl",
    ]  # (the demo's shards under output_root/demo are inputs, made by its own rule)
    for entry in cfg.get("inputs") or []:
        rx = _glob_regex(_resolved_glob(os.fspath(entry)))
        hit = next((w for w in written if rx.match(w)), None)
        if hit is not None:
            raise ConfigError(
                f"inputs entry {entry!r} matches files this run writes under output_root "
                f"{cfg.get('output_root')!r} (e.g. {os.path.relpath(hit)}): the merge would "
                "read its own output (a cyclic graph). Set output_root outside the inputs' "
                "directories, or narrow the glob"
            )


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
            "To extract your data, write a config file of your own (start from "
            "configs/qwen3-8b-1xh200.yaml or configs/deepseek-v3-8xh200.yaml) with "
            "demo.enabled: false, inputs, and model.path (and model.dtype) of the model it "
            "was tokenized for, and pass it with --configfile. To run the demo, leave "
            "inputs unset"
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


def check_dump_dir(cfg: dict) -> None:
    """A configured dump.dir that would hold someone's files is refused at planning."""
    configured = (cfg.get("dump") or {}).get("dir")
    if configured:
        why = dump_dir_refusal(Path(configured))
        if why:
            raise ConfigError(why)


def check_output_root(output_root: str | os.PathLike[str], *, write: bool = True) -> None:
    """Refuse, in one sentence, an output root this user cannot create or write in.

    Without ``write`` (planning, dry runs too) only what fails every command: a path
    through a file (Snakemake's scan of the outputs then ended in NotADirectoryError).
    With it (the workflow's start, before anything is written) a read-only root too
    (EROFS, EACCES), which otherwise failed in a traceback from whichever write came first.
    """
    root = Path(output_root)
    fix = "set output_root to a directory this user can write, or make that one writable"
    existing = Path(os.path.abspath(root))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output_root {root} cannot be written ({existing} is a file): {fix}")
    if not write:
        return
    probe = root / f".hsextract-write-test.{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as exc:
        where = exc.filename or root
        raise ConfigError(
            f"output_root {root} cannot be written ({where}: {exc.strerror or exc}): {fix}"
        ) from None


def resolved_addresses(host: str) -> str:
    """What ``host`` resolves to, for a refusal's message."""
    import socket

    try:
        addrs = sorted({i[4][0] for i in socket.getaddrinfo(host, None)})
    except (socket.gaierror, UnicodeError):
        return "it does not resolve"
    return "it resolves to " + ", ".join(addrs)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one (decided by the
    resolved address, not the text: ``127.x.example.com`` may resolve anywhere)."""
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def resolve_aux_layers(cfg: Config, num_layers: int) -> list[int]:
    layers = cfg.aux_layers
    layers = default_aux_layers(num_layers) if layers is None else list(layers)
    for layer in layers:
        if not 0 <= layer < num_layers:
            raise ConfigError(f"aux_layers {layers}: layer {layer} outside [0, {num_layers})")
    return layers


def captured_layers(cfg: Config, num_layers: int) -> list[int]:
    """What a dump holds as aux, in order: the EAGLE-3 layers, then with ``prenorm_final``
    the stream before the final norm (index L, :func:`convention.prenorm_layer`)."""
    layers = resolve_aux_layers(cfg, num_layers)
    return [*layers, prenorm_layer(num_layers)] if cfg.prenorm_final else layers


def server_aux_layers(cfg: Config) -> list[int] | None:
    """The aux layers a server must be told, or None to let it use the EAGLE-3 default
    (no model config is read then: the default is computed where the model is loaded)."""
    if cfg.prenorm_final:
        return captured_layers(cfg, int(read_model_config(cfg)["num_hidden_layers"]))
    return None if cfg.aux_layers is None else list(cfg.aux_layers)


def read_model_config(cfg: Config) -> dict:
    """The model's HF config.json (its text part for multimodal checkpoints)."""
    data = json.loads((Path(cfg.model.path) / "config.json").read_text())
    return data.get("text_config", data)


def model_identity(cfg: Config, base: str | os.PathLike[str] | None = None) -> dict:
    """What names the model's weights: its resolved path and contents, a revision tag.

    Never the path as written: ``models/llama`` is another model from each directory a
    command runs in (hsextract.model_identity).  The demo's weights are its recipe, built
    at ``model.path`` by its own rule (which refuses a path holding anything else), so the
    recipe names them; its path stays as written only so the demo's run dir keeps its name
    (it cannot name two models: check_demo).  The dict as written (``cfg.raw``), as for the
    whole fingerprint.  ``base``: the directory a relative path is resolved against (the
    working directory when None): a check of a finished run passes the one the run used.
    """
    from hsextract.model_identity import contents_digest, resolved

    raw = cfg.raw
    demo = raw.get("demo", {})
    path = raw["model"]["path"]
    if base is not None and not demo.get("enabled"):
        path = os.path.join(base, path)
    ident: dict[str, Any] = {
        "path": os.path.normpath(path) if demo.get("enabled") else resolved(path),
        "revision": raw["model"].get("revision"),
        "dtype": raw["model"]["dtype"],
    }
    if demo.get("enabled"):
        # The recipe of the seeded random weights (not the data: n_records, n_shards).
        ident["demo"] = {
            k: demo.get(k) for k in ("seed", "num_hidden_layers", "hidden_size", "vocab_size")
        }
    else:
        ident["contents"] = contents_digest(path)
    return ident


def fingerprint_payload(cfg: Config, base: str | os.PathLike[str] | None = None) -> dict:
    """Everything that changes the numbers a record's hidden states hold: the run dir's name.

    Deliberately not here (README, "What each setting changes"): the records themselves
    (inputs, merge policy, max_seq_len, n_chunks: each chunk's content digest tracks
    them, so only chunks whose records changed are re-extracted), how the server runs
    (chunked prefill, batching, SGLang flags: the launch spec, recorded per chunk), and
    the hsextract version (an upgrade alone must not orphan a multi-TB run).

    Taken of the dict as written, not of the typed config: keys absent from an old run's
    config (``storage``, ``prenorm_final``) must stay absent from its payload.
    """
    raw = cfg.raw
    payload = {
        "model": model_identity(cfg, base),
        "aux_layers": raw.get("aux_layers"),
        "convention": CAPTURE_CONVENTION,
        "format_version": FORMAT_VERSION,
        "engine": raw["engine"],
    }
    # The codec changes the bytes (fp8 the numbers too), so a run with another one is
    # another run dir; "none" is the v1 layout and leaves the fingerprint as it was, so a
    # run from before codecs existed stays valid.
    codec = storage_codec(cfg)
    if codec != "none":
        payload["storage_codec"] = codec
    if raw.get("prenorm_final"):  # absent when off: runs from before it keep their dir
        payload["prenorm_final"] = True
    return payload


def storage_codec(cfg: Config) -> str:
    """The chunk codec: a config without ``storage``, as written before codecs, is none (not
    the declared default, lossless, which the schema fills in every config validated now)."""
    return str((cfg.raw.get("storage") or {}).get("codec", "none"))


def fingerprint(cfg: Config, base: str | os.PathLike[str] | None = None) -> str:
    """A short hash of :func:`fingerprint_payload` (relative paths against ``base``, else
    the working directory)."""
    blob = json.dumps(fingerprint_payload(cfg, base), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def launch_settings(cfg: Config) -> dict[str, Any]:
    """What the extraction server is started with, beyond what the fingerprint names.

    A change takes effect at the next launch (``launch_server`` reruns on it, and
    ``ensure()`` replaces a live server started with other settings); finished chunks
    are kept, and each chunk's sidecar records the settings that produced it.  No
    secrets: the API key only as set or not (the client's key is checked by /health).
    The dict as written (``cfg.raw``): its digest names a settings file of every run.
    """
    raw = cfg.raw
    server = raw["server"]
    out: dict[str, Any] = {
        "engine": raw["engine"],
        "model_path": raw["model"]["path"],
        "dtype": raw["model"]["dtype"],
        "aux_layers": raw.get("aux_layers"),
        "max_seq_len": raw["max_seq_len"],  # the context length follows it
        "host": server["host"],
        "port": server["port"],
        "api_key": bool(server.get("api_key")),
        "chunked_prefill_size": server["chunked_prefill_size"],
        "max_running_requests": server["max_running_requests"],
        # As configured: the default's path moves with the project, which is no reason
        # to replace a server (the client reads pieces where the live server writes them).
        "dump_dir": (raw.get("dump") or {}).get("dir"),
    }
    if raw.get("prenorm_final"):  # only when on: a digest from before it stays the same
        out["prenorm_final"] = True
    # dp_size only when > 1: a digest from before it existed stays the same.
    dp = int((raw.get("sglang") or {}).get("dp_size", 1))
    if raw["engine"] == "reference":
        out["device"] = server["device"]
        out["batch_invariant"] = server["batch_invariant"]
        if dp > 1:
            out["dp_size"] = dp
    else:
        out["capture"] = raw.get("capture", "patch")
        out["sglang"] = {
            k: v for k, v in (raw.get("sglang") or {}).items() if not (k == "dp_size" and v == 1)
        }
    return out


def settings_digest(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[
        :12
    ]


def run_dir(cfg: Config, base: str | os.PathLike[str] | None = None) -> Path:
    """``<output_root>/<fingerprint>``, relative paths against ``base`` when given (then
    the result is absolute where output_root is relative to it)."""
    root = Path(cfg.output_root) if base is None else Path(base, cfg.output_root)
    return root / fingerprint(cfg, base)


def run_base(run_dir: str | os.PathLike[str], output_root: str | None = None) -> str:
    """The directory a finished or running run resolved its relative paths against.

    The workflow records it at its start (``state/config_sources.json``, the directory
    Snakemake ran in; hsextract.commands.record); a run dir from before that record is
    placed by its own path (``<base>/<output_root>/<fingerprint>`` for a relative
    output_root); else the working directory.  A check of the run (``verify``,
    ``status``) resolves the config as the run did, wherever it is called from.
    """
    src = recorded(run_dir)
    if src is not None:
        return src.workdir
    rd = Path(os.path.abspath(run_dir))
    parts = Path(output_root or "").parts
    if parts and not Path(output_root or "").is_absolute() and len(parts) < len(rd.parents):
        wd = rd.parents[len(parts)]
        if os.path.realpath(wd / (output_root or "")) == os.path.realpath(rd.parent):
            return str(wd)
    return os.getcwd()


def locate_run(
    cfg: Config, configfiles: Sequence[str | os.PathLike[str]] | None = None
) -> tuple[Path, str | None]:
    """The run dir a command about an existing run reads, and the base it resolved
    relative paths against (None: the working directory, as a new run would).

    ``model.path: models/m`` names another model from each directory, so from outside the
    directory the run was made in the config hashes to a run that does not exist.  When
    it does not, each run under the output root (read here and beside each config file)
    is asked where it was made; one whose config, resolved there, names that very run
    dir is this config's run.
    """
    here = run_dir(cfg)
    if here.is_dir():
        return here, None
    roots = [Path(cfg.output_root)]
    if not roots[0].is_absolute():
        roots += [Path(f).resolve().parent / cfg.output_root for f in configfiles or ()]
    for root in roots:
        try:
            runs = sorted(e.path for e in os.scandir(root) if e.is_dir())
        except OSError:
            continue
        for path in runs:
            rd = Path(path)
            base = run_base(rd, cfg.output_root)
            if not (rd / "state").is_dir() or base == os.getcwd():
                continue
            if os.path.realpath(run_dir(cfg, base)) == os.path.realpath(rd):
                return rd, base
    return here, None


def dump_dir(cfg: Config) -> Path:
    """Per-user, per-run dump dir on /dev/shm unless configured; never shared between users.

    The output root's hash is in the name too: two checkouts of the same config on one
    host must not share (or stale-delete) each other's in-flight pieces.
    """
    configured = cfg.dump.dir
    if configured:
        return Path(configured)
    name = f"hsextract-{getpass.getuser()}-{os.getuid()}-{fingerprint(cfg)}-{output_root_tag(cfg)}"
    return Path("/dev/shm") / name


def output_root_tag(cfg: Config) -> str:
    """A short hash of the resolved output root: two checkouts never share a dump dir."""
    return hashlib.sha256(str(Path(cfg.output_root).resolve()).encode()).hexdigest()[:6]


def public_config(cfg: Config) -> dict:
    """The config as written, secrets masked, for state files and logs."""
    out = copy.deepcopy(cfg.raw)
    if out.get("server", {}).get("api_key"):
        out["server"]["api_key"] = "***"
    return out


def demo_shards(cfg: Config) -> list[str]:
    """The demo's shard paths (demo_data writes them)."""
    return [f"{cfg.output_root}/demo/data/shard_{i:02d}.jsonl" for i in range(cfg.demo.n_shards)]


def input_shards(cfg: Config) -> list[str]:
    """The demo's shards, or every file the configured paths and globs match: the
    library's one expansion (records.resolve_inputs: `**` recursive, sorted, each file
    once), so the workflow merges exactly the shards `hsextract plan` and the merge see."""
    from hsextract.records import resolve_inputs

    if cfg.demo.enabled:
        return demo_shards(cfg)
    return [str(p) for p in resolve_inputs(list(cfg.inputs or []))]


def demo_data_settings_file(cfg: Config, values: dict[str, Any]) -> str:
    return f"{cfg.output_root}/demo/data/settings-{settings_digest(values)}.json"
