# ruff: noqa: E501  (the declarations are a table: one key per line, its help in full)
"""Every config setting, declared once: its type, default, help and what a change does.

Modelled on SGLang's ``ServerArgs``: one declaration per key, and everything else that
describes keys is generated from these (``python -m hsextract.settings --schema`` writes
schemas/config.schema.yaml, ``python -m hsextract.settings_doc`` docs/configuration.md).
tests/test_settings.py and tests/test_settings_doc.py check both are up to date and that each key's *kind* is what the
workflow does when it changes.  Stdlib only: the workflow and the CLI import it at parse.

Kinds (what a change of the key does to a finished run):

- ``fingerprint``: a new run dir (config.fingerprint_payload);
- ``chunk content``: a stage that makes the records reruns (merge, split, the demo's data);
  only chunks whose records changed are re-extracted;
- ``merge order``: the merge reruns (train.jsonl reshuffled), no chunk changes;
- ``launch spec``: launch_server reruns (config.launch_settings);
- ``stale deletion``: delete_stale_states reruns;
- ``export``: an export's settings file changes (the export redoes every chunk);
- ``run location``: the run dir moves (same fingerprint, another output root);
- ``neither``: read when used; nothing reruns.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

KINDS = (
    "fingerprint",
    "run location",
    "chunk content",
    "merge order",
    "launch spec",
    "stale deletion",
    "export",
    "neither",
)
#: Which settings files (rules/common.smk, stages.stage_settings) each kind renames; the
#: demo's data and model settings belong to the demo's keys only.
STAGES = ("merge", "split", "launch", "stale", "demo_data", "demo_model", "specforge")

_REQUIRED = object()


@dataclass(frozen=True)
class Setting:
    """One config key.  ``kinds`` holds with ``engine`` (None: with either); with the other
    engine the key is ``neither``.  ``stages``: the settings files a change renames.
    ``sample``: a valid other value, which tests/test_settings.py changes the key to."""

    key: str
    type: str | tuple[str, ...]
    help: str
    kinds: tuple[str, ...] = ("neither",)
    stages: tuple[str, ...] = ()
    default: Any = _REQUIRED
    sample: Any = None
    schema: dict[str, Any] = field(default_factory=dict)
    engine: str | None = None
    note: str = ""
    #: Other keys the sample needs to take effect (set in the unchanged config too).
    sample_with: dict[str, Any] = field(default_factory=dict)

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


@dataclass(frozen=True)
class Group:
    """A mapping of settings (``model``, ``server`` ...): its schema's object node."""

    key: str
    help: str = ""
    required: tuple[str, ...] = ()


S = Setting
_POS = {"minimum": 1}
#: The most chunk files a run is split into: Snakemake plans a job per chunk (51,200 took
#: 38 s, bench/README), and 10^8 ran out of memory in a traceback before any sentence.
MAX_CHUNKS = 1_000_000
_NONNEG = {"minimum": 0}
_POS_NUM = {"exclusiveMinimum": 0}
_AUTO = {"minimum": 1, "pattern": "^auto$"}
LAUNCH = ("launch spec",)
FP_LAUNCH = ("fingerprint", "launch spec")

DECLARED: tuple[Setting | Group, ...] = (
    S("inputs", ("array", "null"), "globs or paths of JSON-lines input shards; required unless demo.enabled, refused with it (config.check_demo)",
      ("chunk content",), ("merge",), None, sample=["results/demo/data/shard_0[01].jsonl"], schema={"items": {"type": "string"}},
      note="`**` recurses; each file's size and mtime, either way",
      sample_with={"demo.enabled": False, "inputs": ["results/demo/data/shard_*.jsonl"]}),
    S("output_root", "string", "runs live in <output_root>/<fingerprint>/", ("run location",), ("merge",),
      sample="elsewhere", note="the demo's shards move with it"),
    S("n_chunks", ("integer", "string"), "how many chunk files the records are split into; auto = the inputs' tokens over chunk_tokens (hsextract.sizing)",
      ("chunk content",), ("split",), "auto", sample=5, schema={"minimum": 1, "maximum": MAX_CHUNKS, "pattern": "^auto$"},
      note="`auto`: counted from the inputs once per version of them; `hsextract plan` says the size"),
    S("chunk_tokens", ("integer", "null"), "n_chunks: auto's target tokens a chunk; null = 144,000 (~4 s of an 8B target's prefill on one H200); within [1,024, 4,194,304]",
      ("chunk content",), ("split",), None, sample=4096, schema={"minimum": 1},
      note="with `n_chunks: auto` only", sample_with={"n_chunks": "auto"}),
    S("max_seq_len", "integer", "the one source of truth for length", ("chunk content", "launch spec"),
      ("merge", "launch", "demo_data"), sample=300, schema=_POS, note="the context length too"),
    S("seed", "integer", "shuffles the merge", ("merge order",), ("merge",), sample=1),
    S("engine", "string", "reference (HF transformers) or sglang", FP_LAUNCH, ("launch",), sample="sglang",
      schema={"enum": ["reference", "sglang"]}),
    Group("model", required=("path", "dtype")),
    S("model.path", "string", "the model's directory", FP_LAUNCH, ("launch",), sample="results/demo/model2"),
    S("model.dtype", "string", "the dtype the server runs the model in", FP_LAUNCH, ("launch",), sample="bfloat16",
      schema={"enum": ["float32", "bfloat16", "float16"]}),
    S("model.revision", ("string", "null"), "bump when weights change in place at the same path", ("fingerprint",),
      default=None, sample="v2"),
    S("aux_layers", ("array", "null"), "the captured layers; null = SGLang's EAGLE-3 default [2, L//2, L-3]", FP_LAUNCH,
      ("launch",), None, sample=[1, 2, 3], schema={"items": {"type": "integer", "minimum": 0}, "minItems": 1}),
    S("prenorm_final", "boolean", "also capture the last decoder layer's output before the final norm (aux index L; vLLM speculators' verifier_last_hidden_states)",
      FP_LAUNCH, ("launch",), False, sample=True, note="off leaves the fingerprint as it was"),
    Group("demo"),
    S("demo.enabled", "boolean", "build the demo's inputs and random model; off for real runs", ("fingerprint", "chunk content"),
      ("merge", "demo_data", "demo_model"), False, sample=False,
      sample_with={"inputs": ["results/demo/data/shard_*.jsonl"]}),
    S("demo.seed", "integer", "seeds the demo's data and weights (top-level seed only shuffles the merge)",
      ("fingerprint", "chunk content"), ("demo_data", "demo_model"), 0, sample=1),
    S("demo.n_records", "integer", "records in the demo's shards", ("chunk content",), ("demo_data",), 48, sample=40, schema=_POS),
    S("demo.n_shards", "integer", "the demo's shard files", ("chunk content",), ("demo_data", "merge"), 3, sample=2, schema=_POS),
    S("demo.num_hidden_layers", "integer", "the demo model's layers", ("fingerprint",), ("demo_model",), 8, sample=6,
      schema={"minimum": 4}),
    S("demo.hidden_size", "integer", "the demo model's hidden size", ("fingerprint",), ("demo_model",), 64, sample=32,
      schema={"minimum": 16}),
    S("demo.vocab_size", "integer", "the demo's vocabulary (its data and its model)", ("fingerprint", "chunk content"),
      ("demo_data", "demo_model"), 512, sample=256, schema={"minimum": 16}),
    Group("merge"),
    S("merge.overlength", "string", "a record longer than max_seq_len is truncated or dropped", ("chunk content",),
      ("merge",), "truncate", sample="drop", schema={"enum": ["truncate", "drop"]}),
    S("merge.max_reject_fraction", "number", "the merge fails when more records than this are rejected", default=0.0,
      sample=0.5, schema={"minimum": 0, "maximum": 1}),
    S("merge.warn_overlength_fraction", "number",
      "the merge warns on the terminal when more records than this are truncated or dropped",
      default=0.05, sample=0.5, schema={"minimum": 0, "maximum": 1}),
    Group("server"),
    S("server.host", "string", "loopback; anything else needs allow_remote + api_key", LAUNCH, ("launch",), "127.0.0.1",
      sample="127.0.0.2"),
    S("server.allow_remote", "boolean", "allow a host that is not loopback", default=False, sample=True),
    S("server.api_key", ("string", "null"), "the server's API key", LAUNCH, ("launch",), None, sample="secret",
      note="set or not"),
    S("server.port", "integer", "0 = pick a free port at launch", LAUNCH, ("launch",), 0, sample=30000,
      schema={"minimum": 0, "maximum": 65535}),
    S("server.chunked_prefill_size", "integer", "tokens per extend batch; -1 = off", LAUNCH, ("launch",), 8192, sample=128),
    S("server.max_running_requests", ("integer", "string"), "requests the server runs at once, per dp worker (SGLang --max-running-requests); auto = client.requests_in_flight x client.sending_jobs, what the turns' windows hold (hsextract.window)", LAUNCH, ("launch",), "auto", sample=4,
      schema=_AUTO, note="`auto`: derived at launch from the merged records' lengths, shown by the plan command (hsextract plan)"),
    S("server.health_timeout_s", "number", "how long a launch may take to become healthy", default=900, sample=100,
      schema=_POS_NUM),
    S("server.health_probes", "integer", "failed /health probes in a row before ensure() replaces a server whose process is alive",
      default=3, sample=5, schema=_POS),
    S("server.probe_interval_s", "number", "seconds between /health probes", default=5, sample=2, schema=_NONNEG),
    S("server.device", "string", "reference engine only: cpu | cuda", LAUNCH, ("launch",), "cpu", sample="cuda",
      engine="reference"),
    S("server.batch_invariant", "boolean", "reference engine: bit-reproducible numbers whatever shares the batch", LAUNCH,
      ("launch",), True, sample=False, engine="reference"),
    Group("client"),
    S("client.requests_in_flight", ("integer", "string"), "requests in flight per sending turn (per dp worker); auto = client.tokens_in_flight over the merged records' median length (the mean where lower), within [2, 256] (hsextract.window); a sending job also takes the share of turns no job holds (client._Window)", default="auto", sample=4,
      schema=_AUTO),
    S("client.tokens_in_flight", ("integer", "string"), "tokens in flight per sending turn (per dp worker); auto = client.requests_in_flight's records at the merged mean length, within 2-4 x server.chunked_prefill_size (2 before the merge), while client.requests_in_flight is auto too; no token limit when that is set; a record longer than it goes alone (hsextract.window)", default="auto", sample=4096,
      schema=_AUTO),
    S("client.sending_jobs", ("integer", "string"), "chunk jobs sending at once; auto = 4 x the records' cost a token to a sending job (a fixed cost a request over the merged mean length, and a cost a byte of captured states) over that of ShareGPT-like records on an 8B with 3 aux layers, within [4, 16] and the workflow's -j, the auto windows a turn split over them so the turns together hold what 4 did (hsextract.window); a set count keeps a turn's window whole",
      default="auto", sample=2, schema=_AUTO, note="`auto`: the count and why, said by the plan command (hsextract plan) and the workflow's log"),
    S("client.nice", "integer", "the chunk jobs' CPU niceness, 0-19 (hsextract.procs.lower_priority): above 0 the server wins a core both want -- its scheduler must launch the next pass the moment one ends; a job already nicer stays so",
      default=5, sample=0, schema={"minimum": 0, "maximum": 19}),
    S("client.request_timeout_s", "number", "one request's timeout", default=600, sample=60, schema=_POS_NUM),
    S("client.piece_timeout_s", "number", "how long a dump piece may take to appear", default=60, sample=30, schema=_POS_NUM),
    S("client.retries", "integer", "attempts after a transient fault", default=3, sample=1, schema=_NONNEG),
    S("client.backoff_s", "number", "backoff between retries", default=1.0, sample=2.0, schema=_NONNEG),
    Group("dump"),
    S("dump.dir", ("string", "null"), "where the server writes pieces; null = /dev/shm/hsextract-<user>-<uid>-<fingerprint>-<tag>",
      LAUNCH, ("launch",), None, sample="/tmp/hsextract-settings-sample"),
    S("dump.shm_budget_gb", "number", "dump space a server may fill (per dp worker)", default=16, sample=1.0, schema=_POS_NUM),
    S("capture", "string", "sglang only: how states are captured", LAUNCH, ("launch",), "patch", sample="hooks",
      schema={"enum": ["patch", "hooks"]}, engine="sglang"),
    Group("storage"),
    S("storage.codec", "string", "how chunk files store the states (src/hsextract/storage.py): lossless = byte planes + zstd per record frame; fp8 = lossy e4m3, per-token per-layer scale",
      ("fingerprint",), (), "lossless", sample="fp8", schema={"enum": ["none", "lossless", "fp8"]},
      note="`none` leaves the fingerprint as it was before codecs; so does a config without `storage` (written before codecs): it is `none`, not the default"),
    Group("gpu"),
    S("gpu.max_used_mib", "integer", "a GPU using more than this is busy", default=200, sample=100, schema=_NONNEG),
    S("gpu.wait_s", "number", "how long to wait for busy GPUs", default=0, sample=10, schema=_NONNEG),
    Group("stale"),
    S("stale.keep_runs", "integer", "stale runs kept", ("stale deletion",), ("stale",), 0, sample=1, schema=_NONNEG),
    S("stale.dry_run", "boolean", "report stale runs only", ("stale deletion",), ("stale",), False, sample=True),
    S("stale.delete_finished", "boolean", "also delete stale runs that hold finished chunks (the seed's 924 GB cleanup)",
      ("stale deletion",), ("stale",), False, sample=True),
    Group("export", "rules/export.smk (docs/output.md)"),
    Group("export.specforge"),
    S("export.specforge.gzip", "boolean", "export_specforge writes data_{idx}.ckpt.gz (SpecForge's --compress, level 6): smaller, slower to write and read; a change re-exports every chunk",
      ("export",), ("specforge",), False, sample=True),
    Group("audit", "a sample of the run's states against HF transformers' forward of model.path (src/hsextract/audit.py, docs/audit.md)"),
    S("audit.records", "integer", "records the audit stage recomputes with HF's forward of model.path and compares with what was stored, seeded and spread over the chunks; 0 = off (the run is then unaudited, and hsextract status says so)",
      default=16, sample=4, schema=_NONNEG, note="a change reruns nothing: `--forcerun audit` audits again"),
    Group("stream", "train while extracting (docs/streaming.md; the protocol: src/hsextract/stream/DESIGN.md); off while budget_gb is null"),
    S("stream.budget_gb", ("number", "null"), "most GB of chunk files not yet acknowledged by the trainer; a chunk job waits before sending past it; null = off (an offline run)",
      default=None, sample=1.0, schema=_POS_NUM),
    S("stream.low_mark", "number", "a paused budget resumes below this fraction of budget_gb (hysteresis: the GPU is not toggled per chunk)",
      default=0.75, sample=0.5, schema={"exclusiveMinimum": 0, "maximum": 1}),
    S("stream.epochs_mode", "string", "keep: nothing deleted before the last pass is acked; regenerate: each pass re-extracts",
      default="keep", sample="regenerate", schema={"enum": ["keep", "regenerate"]}),
    S("stream.passes", "integer", "passes (epochs) the trainer reads", default=1, sample=2, schema=_POS),
    S("stream.prefetch_chunks", "integer", "chunks the trainer holds open at once, all its ranks and loader workers together (they split each chunk's records): its window", default=2, sample=1, schema=_POS),
    S("stream.checkpoint_chunks", "integer", "chunks the trainer (all ranks) consumes between checkpoints, unacked meanwhile (its window)",
      default=2, sample=4, schema=_POS),
    S("stream.poll_s", "number", "longest a waiting chunk job sleeps between looks at the ack file", default=2.0, sample=0.5, schema=_POS_NUM),
    Group("sglang", "engine sglang only; see src/hsextract/sglang/launch.py (build_launch, validate_sglang_config)"),
    S("sglang.python", "string", "python of the user's SGLang env", LAUNCH, ("launch",), "python", sample="python3",
      engine="sglang"),
    S("sglang.version", ("null", "string"), "the SGLang release (0.5.14 to 0.5.23 declared; another one runs capture: hooks if its source fits a known design); null = the one installed in sglang.python's env",
      LAUNCH, ("launch",), None, sample="0.5.14", engine="sglang"),
    S("sglang.tp_size", "integer", "tensor-parallel GPUs", LAUNCH, ("launch",), 1, sample=2, schema=_POS, engine="sglang"),
    S("sglang.dp_size", "integer", "data-parallel workers of the one server (SGLang --dp-size; the reference engine runs as many worker processes): dp x tp GPUs per node; client.requests_in_flight and dump.shm_budget_gb are per worker (docs/sglang.md, Data-parallel replicas)",
      LAUNCH, ("launch",), 1, sample=2, schema=_POS),
    S("sglang.mem_fraction_static", ("null", "number"), "SGLang --mem-fraction-static", LAUNCH, ("launch",), None,
      sample=0.8, schema={"exclusiveMinimum": 0, "maximum": 1}, engine="sglang"),
    S("sglang.context_length", ("null", "integer"), "null = max_seq_len + 7", LAUNCH, ("launch",), None, sample=1024,
      schema=_POS, engine="sglang"),
    S("sglang.extra_args", "array", "more SGLang flags", LAUNCH, ("launch",), [], sample=["--disable-radix-cache"],
      schema={"items": {"type": "string"}}, engine="sglang"),
    S("sglang.extra_env", "object", "more environment variables for the server", LAUNCH, ("launch",), {},
      sample={"A": "1"}, schema={"additionalProperties": {"type": "string"}}, engine="sglang"),
)  # fmt: skip

SETTINGS: dict[str, Setting] = {d.key: d for d in DECLARED if isinstance(d, Setting)}
GROUPS: dict[str, Group] = {d.key: d for d in DECLARED if isinstance(d, Group)}


def kinds_with(setting: Setting, engine: str) -> tuple[str, ...]:
    """The setting's kinds when the config's engine is ``engine``."""
    return setting.kinds if setting.engine in (None, engine) else ("neither",)


def _children(prefix: str) -> Iterator[Setting | Group]:
    depth = prefix.count(".") + 1 if prefix else 0
    for d in DECLARED:
        if d.key.count(".") == depth and (not prefix or d.key.startswith(prefix + ".")):
            yield d


def _leaf_schema(s: Setting) -> dict[str, Any]:
    node: dict[str, Any] = {"type": list(s.type) if isinstance(s.type, tuple) else s.type}
    node.update(s.schema)
    if not s.required:
        node["default"] = s.default
    node["description"] = s.help
    return node


def _object_schema(prefix: str, help: str, required: tuple[str, ...]) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "object", "additionalProperties": False}
    if help:
        node["description"] = help
    if required:
        node["required"] = list(required)
    if prefix and not required:
        node["default"] = {}
    props: dict[str, Any] = {}
    for d in _children(prefix):
        name = d.key.rsplit(".", 1)[-1]
        props[name] = (
            _object_schema(d.key, d.help, d.required) if isinstance(d, Group) else _leaf_schema(d)
        )
    node["properties"] = props
    return node


def json_schema() -> dict[str, Any]:
    """The JSON schema Snakemake validates the config with (and fills defaults from)."""
    required = tuple(s.key for s in SETTINGS.values() if "." not in s.key and s.required)
    required += tuple(g.key for g in GROUPS.values() if "." not in g.key and g.required)
    body = _object_schema("", "", required)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "description": "hsextract workflow config (see config.yaml for the embedded default). "
        "GENERATED by `python -m hsextract.settings --schema` from src/hsextract/settings.py: "
        "edit the declarations there, not this file",
        **body,
    }


def _yaml(node: Any, indent: int) -> list[str]:
    """Block YAML for mappings, a JSON flow value (valid YAML) for every leaf's node."""
    lines = []
    pad = "  " * indent
    for k, v in node.items():
        key = json.dumps(k) if k.startswith("$") else k
        if isinstance(v, dict) and ("properties" in v or k == "properties"):
            lines.append(f"{pad}{key}:")
            lines.extend(_yaml(v, indent + 1))
        else:
            lines.append(f"{pad}{key}: {json.dumps(v)}")
    return lines


def schema_yaml() -> str:
    return "\n".join(_yaml(json_schema(), 0)) + "\n"


_CHANGE = {
    "fingerprint": "a new run dir: every chunk is extracted there; the old run is kept while it holds finished chunks (see stale deletion)",
    "run location": "the run dir moves under the new root (same fingerprint); nothing of the old root is used",
    "chunk content": "the stage that makes the records reruns (merge, split, the demo's data); only chunks whose records changed are re-extracted",
    "merge order": "train.jsonl is reshuffled; no chunk changes",
    "launch spec": "`launch_server` reruns and the next server runs with it; finished chunks are kept, each sidecar says which settings produced it",
    "stale deletion": "`delete_stale_states` reruns (and the stages after it; finished chunks are kept)",
    "export": "that export's settings file changes: the export redoes every chunk; extraction reruns nothing",
    "neither": "read when used; nothing reruns",
}  # fmt: skip


#: Where ``--types`` writes the typed config (tests/test_settings.py checks it is current).
TYPES_MODULE = "hsextract.config_types"
_PY = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "null": "None"}


def class_name(key: str) -> str:
    """``""`` -> Config, ``export.specforge`` -> ExportSpecforgeConfig."""
    return "".join(part.capitalize() for part in key.split(".") if part) + "Config"


def _py_type(s: Setting) -> str:
    names = []
    for t in s.type if isinstance(s.type, tuple) else (s.type,):
        if t == "array":
            item = _PY[s.schema.get("items", {}).get("type", "string")]
            names.append(f"tuple[{item}, ...]")
        elif t == "object":
            names.append("dict[str, str]")
        else:
            names.append(_PY[t])
    return " | ".join(sorted(names, key=lambda n: n == "None"))  # None last


def _py_default(s: Setting) -> str:
    if isinstance(s.default, list):
        return repr(tuple(s.default))
    if isinstance(s.default, dict):
        assert not s.default, f"{s.key}: a mapping's default is empty"
        return "field(default_factory=dict)"
    if (
        isinstance(s.default, int | float)
        and "number" in s.type
        and not isinstance(s.default, bool)
    ):
        return repr(float(s.default))
    return json.dumps(s.default) if isinstance(s.default, str) else repr(s.default)


def _py_class(prefix: str, help: str) -> list[str]:
    doc = f"``{prefix}``: {help}" if help else f"``{prefix or '(top level)'}``"
    lines = ["", "", "@dataclass(frozen=True, kw_only=True)", f"class {class_name(prefix)}:"]
    lines.append(
        f'    """{doc}."""'
        if prefix
        else '    """The whole config (hsextract.config.typed builds it)."""'
    )
    lines.append("")
    for d in _children(prefix):
        name = d.key.rsplit(".", 1)[-1]
        if isinstance(d, Group):
            cls = class_name(d.key)
            default = "" if d.required else f" = field(default_factory={cls})"
            lines.append(f"    {name}: {cls}{default}")
            continue
        kinds = f" [{', '.join(d.kinds)}]" if d.kinds != ("neither",) else ""
        only = f" ({d.engine} engine; else neither)" if d.engine else ""
        lines.append(f"    #: {d.help}{kinds}{only}")
        default = "" if d.required else f" = {_py_default(d)}"
        lines.append(f"    {name}: {_py_type(d)}{default}")
    if not prefix:
        lines.append("    #: The validated dict this was built from: what the fingerprint and the")
        lines.append("    #: stages' settings files are computed from (hsextract.config).")
        lines.append(
            "    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)"
        )
    return lines


def python_types() -> str:
    """The typed config: a frozen dataclass per group, groups before the config holding them."""
    order = sorted(GROUPS, key=lambda k: -k.count("."))  # nested groups first
    lines = [
        "# ruff: noqa: E501",
        '"""GENERATED by `python -m hsextract.settings --types` from src/hsextract/settings.py:',
        "edit the declarations there, not this file.",
        "",
        "The config as typed objects (``cfg.server.host``): one frozen dataclass per group of",
        "settings, each field's type and default as declared, its help and kinds beside it.",
        "``hsextract.config.typed`` builds them from the validated dict.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from dataclasses import dataclass, field",
        "from typing import Any",
    ]
    for g in order:
        lines += _py_class(g, GROUPS[g].help)
    lines += _py_class("", "")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hsextract.settings", description=__doc__)
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--schema", action="store_true", help="print schemas/config.schema.yaml")
    out.add_argument("--types", action="store_true", help="print src/hsextract/config_types.py")
    args = p.parse_args(argv)
    if args.types:
        sys.stdout.write(python_types())
    else:
        sys.stdout.write(schema_yaml())
    return 0


if __name__ == "__main__":
    sys.exit(main())
