"""The extraction-mode ``python -m sglang.launch_server`` command, for each supported release.

Every flag here is a name the release's own source declares (``hsextract.sglang.flags``
reads them; ``launch_server`` checks the command against the installed release before it
starts anything, the tests against every supported one), never a deprecated or
abbreviated spelling: ``--tp-size`` not ``--tp`` (which only works as an argparse
abbreviation), ``--cuda-graph-backend-{decode,prefill} disabled`` not the deprecated
``--disable-cuda-graph``.  Why each setting (the seed's five):

* CUDA graphs off for decode *and* prefill: the dump runs Python inside the forward, and a
  graph replay runs none; 0.5.23 has prefill graphs too.
* ``--disable-radix-cache``: every token is prefilled, no prefix reuse, so every position
  is captured; no hierarchical cache (never emitted, refused in ``extra_args``).
* loopback host, unless ``server.allow_remote`` and an API key.
* a context length SGLang accepts every ``max_seq_len`` record under: its scheduler takes
  an input only if ``len < context_length - 6`` (tp_worker: ``max_req_input_len =
  (context_len - 1) - 5``; utils: refused when ``len >= max_req_input_len``), so we add
  :data:`CONTEXT_HEADROOM`.
* ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1`` so that context may exceed the model's
  ``max_position_embeddings`` when a user asks for it; ``SGLANG_HS_DUMP_DIR`` turns the dump on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hsextract.config import (
    Config,
    captured_layers,
    is_loopback,
    read_model_config,
)
from hsextract.config_types import SglangConfig
from hsextract.convention import prenorm_layer
from hsextract.errors import ConfigError
from hsextract.settings import SETTINGS
from hsextract.sglang import versions
from hsextract.sglang.versions import SglangVersion

#: Every supported release accepts an input of n tokens iff n < context_length - 6 (see
#: module doc; each release's declaration says so, and the tests read it in its source).
CONTEXT_HEADROOM = 7
#: What the client should send as ``sampling_params.max_new_tokens``: 0 is accepted by
#: 0.5.23 (``max_new_tokens must be at least 0``) and makes the request prefill-only
#: (``Req.is_prefill_only``), so no sampling and no decode forward follows the prefill.
CLIENT_MAX_NEW_TOKENS = 0

SGLANG_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")

# Flags that would break extraction, with the reason shown to the user.  Checked against
# extra_args including argparse abbreviations (SGLang's parser has allow_abbrev on).
FORBIDDEN_FLAGS: dict[str, str] = {
    "--enable-hierarchical-cache": "hierarchical cache is off in extraction mode",
    "--enable-hicache": "hierarchical cache is off in extraction mode",
    "--enable-lmcache": "LMCache is a hierarchical KV cache; off in extraction mode",
    "--disable-cuda-graph": "deprecated spelling; CUDA graphs are already off for both phases",
    "--cuda-graph-backend-decode": "CUDA graphs must stay disabled: the dump is Python",
    "--cuda-graph-backend-prefill": "CUDA graphs must stay disabled: the dump is Python",
    "--cuda-graph-config": "CUDA graphs must stay disabled: the dump is Python",
    "--enable-torch-compile": "a compiled forward would not run the dump code as written",
    "--enable-two-batch-overlap": "layers run through the overlap stage path are not captured",
    "--enable-single-batch-overlap": "single-batch overlap is not supported by the capture",
    "--enable-mixed-chunk": "decode tokens mixed into extend batches would be dumped",
    "--allow-auto-truncate": "silently truncates records; max_seq_len is enforced upstream",
    "--enable-dp-attention": "with DP attention rank 0 does not hold every request's rows",
    "--attn-dp-size": "with DP attention rank 0 does not hold every request's rows",
    "--enable-attn-tp-input-scattered": "scattered attention input leaves rank 0 a slice",
    "--pp-size": "pipeline parallelism splits aux layers and final norm across ranks",
    "--enable-prefill-cp": "context parallel splits a request's tokens across ranks",
    "--attn-cp-size": "context parallel splits a request's tokens across ranks",
    "--pipeline-parallel-size": "pipeline parallelism splits aux layers and final norm",
    "--speculative-draft-model-path": "speculative decoding changes what an extend pass is",
    "--config": "a SGLang config file could re-enable anything; use sglang.extra_args",
    "--radix-cache-backend": "radix cache is off in extraction mode (every token prefilled)",
    "--enable-session-radix-cache": "radix cache is off in extraction mode",
}
# Flags we emit from config keys; set the key instead.
MANAGED_FLAGS: dict[str, str] = {
    "--model-path": "model.path",
    "--model": "model.path",
    "--dtype": "model.dtype",
    "--tp-size": "sglang.tp_size",
    "--tensor-parallel-size": "sglang.tp_size",
    "--tp": "sglang.tp_size",
    # Plain DP (each worker its own TP group, its TP rank 0 dumping its own requests) is
    # what sglang.dp_size runs; DP attention stays refused above.
    "--dp-size": "sglang.dp_size",
    "--data-parallel-size": "sglang.dp_size",
    "--host": "server.host",
    "--port": "server.port",
    "--api-key": "server.api_key",
    "--context-length": "max_seq_len (or sglang.context_length)",
    "--chunked-prefill-size": "server.chunked_prefill_size",
    "--max-running-requests": "server.max_running_requests",
    "--mem-fraction-static": "sglang.mem_fraction_static",
    "--disable-radix-cache": "always emitted",
    "--skip-server-warmup": "always emitted",
    "--speculative-algorithm": "capture (hooks sets it to EAGLE3 as a capture convention)",
    "--enable-return-aux-hidden-states": "capture: hooks",
    "--return-aux-hidden-state-layer-ids": "aux_layers",
    "--forward-hooks": "capture: hooks",
}
# Environment variables build_launch owns.
MANAGED_ENV = (
    "SGLANG_HS_DUMP_DIR",
    "HSEXTRACT_AUX_LAYERS",
    "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN",
    "PYTHONPATH",
)

#: The declared ``sglang.*`` keys and their defaults (hsextract.settings).
SGLANG_DEFAULTS: dict[str, Any] = {
    k.split(".", 1)[1]: s.default for k, s in SETTINGS.items() if k.startswith("sglang.")
}


def sglang_section(cfg: dict) -> dict[str, Any]:
    """The ``sglang:`` section as written, defaults filled: what validation checks (unknown
    keys, types) before the config is read typed."""
    return {**SGLANG_DEFAULTS, **(cfg.get("sglang") or {})}


_DETECTED: dict[str, str] = {}


def installed_version(python: str) -> str:
    """The sglang version installed in the env of ``python`` (its package metadata: no
    import, which would initialise CUDA libraries for nothing)."""
    import subprocess

    if python not in _DETECTED:
        code = "import importlib.metadata as m; print(m.version('sglang'))"
        try:
            proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        except OSError as exc:
            raise ConfigError(
                f"cannot run {python} (sglang.python) to find its SGLang version: {exc}; "
                "fix sglang.python, or set sglang.version"
            ) from exc
        if proc.returncode != 0:
            raise ConfigError(
                f"{python} (sglang.python) has no sglang installed: "
                f"{proc.stderr.strip()[-300:]}; fix sglang.python, or set sglang.version"
            )
        _DETECTED[python] = proc.stdout.strip()
    return _DETECTED[python]


def installed_root(python: str) -> Path:
    """The ``sglang`` package dir of the env of ``python`` (``find_spec``, not an import:
    importing sglang would initialise CUDA libraries for nothing)."""
    import subprocess

    code = (
        "import importlib.util as u; s = u.find_spec('sglang'); "
        "print(s.submodule_search_locations[0])"
    )
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise ConfigError(f"cannot run {python} (sglang.python): {exc}") from exc
    if proc.returncode != 0:
        raise ConfigError(
            f"cannot find sglang with {python} (sglang.python): {proc.stderr.strip()[-300:]}"
        )
    return Path(proc.stdout.strip())


_INFERRED: dict[tuple[str, str], SglangVersion] = {}


def release(cfg: Config) -> SglangVersion:
    """The declaration of the configured env's SGLang release (``sglang.version`` or the
    installed one).  An undeclared release runs ``capture: hooks`` when its installed
    source matches a known design (``compat.infer``, read once per run); otherwise it is
    refused, naming the supported releases (or the nearest one and what differs)."""
    sg = cfg.sglang
    version = sg.version or installed_version(sg.python)
    try:
        return versions.get(version)
    except versions.UnknownVersion as exc:
        if cfg.capture != "hooks":
            raise ConfigError(
                f"{exc}. capture: hooks can run an undeclared release whose source matches "
                "a known design; capture: patch needs its patch (python patches/port.py "
                f"{version})"
            ) from None
    key = (sg.python, version)
    if key not in _INFERRED:
        from hsextract.sglang import compat
        from hsextract.sglang.patching import installed_version as version_in

        root = installed_root(sg.python)
        found = version_in(root)
        if found != version:
            raise ConfigError(
                f"sglang.version says {version}, {root} (sglang.python's env) is sglang "
                f"{found}; fix sglang.version (or leave it null)"
            )
        _INFERRED[key] = compat.infer(root, version)
    return _INFERRED[key]


def context_length(cfg: Config, headroom: int = CONTEXT_HEADROOM) -> int:
    """The ``--context-length`` that admits every record of ``max_seq_len`` tokens."""
    configured = cfg.sglang.context_length
    return int(configured) if configured is not None else cfg.max_seq_len + headroom


def _flag_name(token: str) -> str:
    return token.split("=", 1)[0]


def _matches(token: str, flag: str) -> bool:
    # argparse accepts any unambiguous prefix of a long option, so "--enable-hier" is
    # "--enable-hierarchical-cache" to SGLang; refuse prefixes too.
    name = _flag_name(token)
    return name == flag or (len(name) > 3 and flag.startswith(name))


def validate_sglang_config(cfg: Config, rel: SglangVersion | None = None) -> None:
    """Raise ConfigError naming the reason when the config would leave extraction mode.

    The ``sglang:`` section is checked as written (unknown keys, types), the rest typed."""
    sg = sglang_section(cfg.raw)
    unknown = sorted(set(sg) - set(SGLANG_DEFAULTS))
    if unknown:
        # e.g. a hopeful `disable_radix_cache: false`: settings go through known keys only.
        raise ConfigError(f"unknown sglang keys {unknown}; known: {sorted(SGLANG_DEFAULTS)}")
    if not isinstance(sg["python"], str) or not sg["python"]:
        raise ConfigError("sglang.python must name the python of the SGLang env")
    tp = sg["tp_size"]
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"sglang.tp_size must be an integer >= 1, got {tp!r}")
    dp = sg["dp_size"]
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError(f"sglang.dp_size must be an integer >= 1, got {dp!r}")
    dtype = cfg.model.dtype
    if dtype not in SGLANG_DTYPES:
        raise ConfigError(f"model.dtype {dtype!r} is not an SGLang dtype {SGLANG_DTYPES}")
    why = dict(rel.unserved_dtypes).get(dtype) if rel else None
    if why:
        raise ConfigError(
            f"model.dtype {dtype!r} with SGLang {rel.version}: {why}. Use bfloat16 (its "
            "fidelity is checked against HF's own bf16 forward), or engine: reference for "
            "float32 states"
        )
    headroom = rel.context_headroom if rel else CONTEXT_HEADROOM
    max_seq_len = cfg.max_seq_len
    ctx = context_length(cfg, headroom)
    if ctx < max_seq_len + headroom:
        raise ConfigError(
            f"sglang.context_length {ctx} is too short for max_seq_len {max_seq_len}: SGLang "
            f"{rel.version if rel else ''} refuses inputs of >= context_length - "
            f"{headroom - 1} tokens; use >= {max_seq_len + headroom} or null"
        )
    host = cfg.server.host
    if not is_loopback(host) and not (cfg.server.allow_remote and cfg.server.api_key):
        raise ConfigError(
            f"server.host={host!r} is not loopback: needs server.allow_remote: true "
            "and server.api_key"
        )
    extra = sg["extra_args"]
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise ConfigError("sglang.extra_args must be a list of strings")
    for token in extra:
        if not token.startswith("--"):
            continue
        for flag, why in FORBIDDEN_FLAGS.items():
            if _matches(token, flag):
                raise ConfigError(f"sglang.extra_args {token!r} refused: {why}")
        for flag, key in MANAGED_FLAGS.items():
            if _matches(token, flag):
                raise ConfigError(f"sglang.extra_args {token!r} refused: set {key} instead")
    extra_env = sg["extra_env"]
    if not isinstance(extra_env, dict):
        raise ConfigError("sglang.extra_env must be a mapping of strings")
    clash = sorted(set(extra_env) & set(MANAGED_ENV))
    if clash:
        raise ConfigError(f"sglang.extra_env may not set {clash}: build_launch owns them")
    step = _option_value(extra, "--gpu-id-step")
    if step is not None and (not step.isdigit() or int(step) < 1):
        # 0.5.14 server_args.py check_server_args, 0.5.23 validation_hook.py: an assert.
        raise ConfigError(
            f"sglang.extra_args --gpu-id-step {step} refused: SGLang asserts gpu_id_step >= 1. "
            "To put several DP workers on one GPU list it once per worker in "
            "CUDA_VISIBLE_DEVICES and set SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1 (sglang."
            "extra_env; docs/sglang.md, Data-parallel replicas)"
        )
    if rel is not None:
        _check_deterministic_alignment(cfg.sglang, cfg.server.chunked_prefill_size, rel)
    if cfg.capture == "hooks" and rel is not None and rel.hooks == "aux_capture":
        layers = cfg.aux_layers
        if layers and layers[0] == 1:
            # set_eagle3_layers_to_capture adds 1 to every id when the list starts with 1.
            raise ConfigError(
                f"capture: hooks cannot capture aux_layers {list(layers)} with SGLang "
                f"{rel.version}: it shifts a layer-id list starting with 1 by one; use "
                "capture: patch"
            )


def _option_value(args: list[str], flag: str) -> str | None:
    """The value given to ``flag`` in ``args`` (``--flag v`` or ``--flag=v``, argparse
    abbreviations too), the last one winning as in argparse; None if absent."""
    value = None
    for i, token in enumerate(args):
        if token.startswith("--") and _matches(token, flag):
            _, eq, inline = token.partition("=")
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def _check_deterministic_alignment(sg: SglangConfig, chunk: int, rel: SglangVersion) -> None:
    """Deterministic inference cuts chunked prefill at multiples of an alignment for some
    backends; a smaller chunk would leave every longer record unscheduled: a server that
    answers /health and never answers the request (0.5.14) or will not start (0.5.23)."""
    extra = sg.extra_args
    flag = "--enable-deterministic-inference"
    if not any(t.startswith("--") and _matches(t, flag) for t in extra):
        return
    backend = next(
        (v for v in (_option_value(extra, f) for f in rel.prefill_backend_args) if v), None
    )
    for name, env_var, default in rel.deterministic_align:
        if backend != name:
            continue
        align = int(sg.extra_env.get(env_var, default))
        if chunk != -1 and chunk < align:
            raise ConfigError(
                f"sglang.extra_args has --enable-deterministic-inference with the {name} "
                f"attention backend: SGLang {rel.version} then cuts chunked prefill at "
                f"multiples of {align} tokens ({env_var}), and server.chunked_prefill_size "
                f"is {chunk}, so a record longer than {chunk} tokens could never be "
                f"scheduled. Set server.chunked_prefill_size to -1 (off) or a multiple of "
                f"{align}, or set {env_var} in sglang.extra_env to at most {chunk}"
            )


def _aux_layers(cfg: Config) -> list[int] | None:
    """What the dump holds (configured or EAGLE-3 default layers, then index L with
    ``prenorm_final``), from the model's config.json if readable."""
    try:
        return captured_layers(cfg, int(read_model_config(cfg)["num_hidden_layers"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if cfg.prenorm_final:
            raise ConfigError(
                f"prenorm_final needs the layer count from {cfg.model.path}/config.json here: {exc}"
            ) from exc
        if cfg.aux_layers is not None:
            return list(cfg.aux_layers)
        return None  # the server applies the same default from the loaded model


def _src_dir() -> str:
    # The SGLang env is the user's: the patch and the hook import hsextract from this
    # checkout, which needs only torch + safetensors (both in any SGLang env).
    return str(Path(__file__).resolve().parents[2])


def build_launch(
    cfg: Config, *, dump_dir: str, port: int, rel: SglangVersion | None = None
) -> tuple[list[str], dict[str, str]]:
    """argv and the environment variables to add, for an extraction-mode SGLang server of
    release ``rel`` (default: the configured env's, see :func:`release`)."""
    from hsextract.window import for_run

    rel = rel or release(cfg)
    validate_sglang_config(cfg, rel)
    sg, server = cfg.sglang, cfg.server
    argv = [
        sg.python, "-m", "sglang.launch_server",
        "--model-path", str(cfg.model.path),
        "--dtype", cfg.model.dtype,
        "--tp-size", str(sg.tp_size),
        *(["--dp-size", str(sg.dp_size)] if sg.dp_size > 1 else []),
        "--host", server.host,
        "--port", str(port),
        "--context-length", str(context_length(cfg, rel.context_headroom)),
        "--chunked-prefill-size", str(server.chunked_prefill_size),
        "--max-running-requests", str(for_run(cfg).max_running),
        "--cuda-graph-backend-decode", "disabled",
        "--cuda-graph-backend-prefill", "disabled",
        "--disable-radix-cache",
        # SGLang's warmup /generate would be prefilled and dumped under a foreign rid.
        "--skip-server-warmup",
    ]  # fmt: skip
    if sg.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(sg.mem_fraction_static)]
    if server.api_key:
        argv += ["--api-key", str(server.api_key)]
    layers = _aux_layers(cfg)
    env = {str(k): str(v) for k, v in sg.extra_env.items()}
    hooks = cfg.capture == "hooks"
    if hooks:
        # Imported here: hooks pulls in torch, which `server command` should not pay for.
        from hsextract.sglang.hooks import forward_hooks_spec

        if rel.hooks == "aux_capture":
            # SGLang's own EAGLE-3 aux capture without a draft, plus a hook on the model.
            argv += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]
            if cfg.aux_layers is not None:
                argv += ["--return-aux-hidden-state-layer-ids", *map(str, cfg.aux_layers)]
        if sg.tp_size > 1:
            argv += list(rel.hooks_tp_args)
        if layers is None and rel.hooks == "layernorm":
            raise ConfigError(
                f"capture: hooks with SGLang {rel.version} hooks each aux layer by number: "
                f"set aux_layers, or make {cfg.model.path}/config.json readable here"
            )
        # The dump dir travels in the hooks' config, not SGLANG_HS_DUMP_DIR: a patched
        # install (one env for both modes) would otherwise dump every pass twice.
        prenorm = (
            prenorm_layer(int(read_model_config(cfg)["num_hidden_layers"]))
            if cfg.prenorm_final
            else None
        )
        argv += ["--forward-hooks", forward_hooks_spec(rel.hooks, layers, dump_dir, prenorm)]
    argv += list(sg.extra_args)
    pythonpath = _src_dir()
    if os.environ.get("PYTHONPATH"):
        pythonpath += os.pathsep + os.environ["PYTHONPATH"]
    env.update({"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1", "PYTHONPATH": pythonpath})
    if not hooks:
        env["SGLANG_HS_DUMP_DIR"] = str(dump_dir)
    if layers is not None:
        env["HSEXTRACT_AUX_LAYERS"] = json.dumps(layers)
    return argv, env


def redact_argv(argv: list[str]) -> list[str]:
    """argv for logs and state files: the ``--api-key`` value masked."""
    out = list(argv)
    for i, token in enumerate(out):
        if token == "--api-key" and i + 1 < len(out):
            out[i + 1] = "***"
        elif token.startswith("--api-key="):
            out[i] = "--api-key=***"
    return out
