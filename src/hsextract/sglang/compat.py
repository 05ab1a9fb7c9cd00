"""Does an SGLang release's source fit a capture design?  Read in about a second (``ast``
and text, no import: importing SGLang initialises CUDA libraries).

Two uses, one list of checks:

- CI runs :func:`check` on every declared release's real source: the hooks attach to
  that release's real classes and every option of the command is declared there;
- a release with no declaration (0.5.24 when it comes) gets ``capture: hooks`` when its
  source passes the checks of a known design: :func:`infer` adapts the nearest declared
  release to it (options layout, deterministic alignment, context headroom, pins: read
  from its source) and otherwise refuses, naming that release and every check that
  differs.  ``capture: patch`` still needs a patch: ``patches/port.py`` writes one.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, replace
from pathlib import Path

from hsextract.errors import ConfigError
from hsextract.sglang import versions
from hsextract.sglang.flags import declared_flags
from hsextract.sglang.versions import SglangVersion

#: Options the extraction command may carry for any release (``launch.build_launch``
#: emits these; tests/test_sglang_args.py checks the list covers what it emits).
COMMAND_OPTIONS = (
    "--model-path", "--dtype", "--tp-size", "--host", "--port", "--context-length",
    "--chunked-prefill-size", "--max-running-requests", "--cuda-graph-backend-decode",
    "--cuda-graph-backend-prefill", "--disable-radix-cache", "--skip-server-warmup",
    "--mem-fraction-static", "--api-key", "--forward-hooks",
)  # fmt: skip
#: What the ``aux_capture`` design adds to the command.
AUX_CAPTURE_OPTIONS = (
    "--enable-return-aux-hidden-states",
    "--speculative-algorithm",
    "--return-aux-hidden-state-layer-ids",
)
DSV2 = "srt/models/deepseek_v2.py"


@dataclass(frozen=True)
class Check:
    """One thing capture needs from the release, and whether its source has it."""

    need: str
    ok: bool

    def __str__(self) -> str:
        return f"{'ok' if self.ok else 'MISSING'}: {self.need}"


def _text(pkg: Path, *globs: str) -> str:
    return "\n".join(p.read_text(errors="replace") for g in globs for p in sorted(pkg.glob(g)))


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _self_stores(cls: ast.ClassDef | None) -> set[str]:
    if cls is None:
        return set()
    return {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }


def _method(cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    if cls is None:
        return None
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _inner_model_call(causal: ast.ClassDef | None) -> list[str]:
    fwd = _method(causal, "forward")
    for n in ast.walk(fwd) if fwd is not None else ():
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "self.model" and not n.keywords:
            return [ast.unparse(a) for a in n.args]
    return []


def check(pkg: Path, rel: SglangVersion) -> list[Check]:
    """What ``capture: hooks`` (design ``rel.hooks``) and the launch command need, checked
    in the source of the ``sglang`` package at ``pkg``."""
    pkg = Path(pkg)
    out: list[Check] = []
    flags = declared_flags(pkg, rel) if _has_args(pkg, rel) else {}
    out.append(Check(f"options declared in {' + '.join(rel.args_files)}", len(flags) > 100))
    wanted = [*COMMAND_OPTIONS, *rel.hooks_tp_args]
    if rel.hooks == "aux_capture":
        wanted += AUX_CAPTURE_OPTIONS
    for name in wanted:
        f = flags.get(name)
        out.append(Check(f"option {name}", f is not None and f.name == name and not f.deprecated))
    fbi = _text(pkg, "srt/model_executor/forward_batch_info.py")
    for name in ("forward_mode", "rids", "extend_prefix_lens_cpu", "extend_seq_lens_cpu"):
        out.append(Check(f"ForwardBatch.{name}", re.search(rf"^\s+{name}:", fbi, re.M) is not None))
    for name in ("is_extend", "is_target_verify", "is_idle"):
        out.append(Check(f"ForwardMode.{name}()", f"def {name}(self" in fbi))
    rc = _text(pkg, "srt/runtime_context.py")
    out.append(Check("runtime_context.get_parallel()", "def get_parallel()" in rc))
    hm = _text(pkg, "srt/model_executor/hook_manager.py")
    protocol = all(f'spec.get("{k}"' in hm for k in ("name", "target_modules", "hook_factory"))
    protocol = protocol and "hook_factory(config)" in hm and "register_forward_hook(hook)" in hm
    out.append(Check("--forward-hooks spec {name, target_modules, hook_factory, config}", protocol))
    runner = _text(pkg, "srt/model_executor/**/*.py")
    out.append(
        Check(
            "forward hooks registered after CUDA-graph capture", "hooks AFTER cuda-graph" in runner
        )
    )
    dsv2 = _text(pkg, DSV2)
    tree = ast.parse(dsv2) if dsv2 else ast.Module(body=[], type_ignores=[])
    model = _class(tree, "DeepseekV2Model")
    causal = _class(tree, "DeepseekV2ForCausalLM")
    call = _inner_model_call(causal)
    out.append(
        Check(
            "DeepseekV2ForCausalLM calls self.model(input_ids, positions, forward_batch, ...)",
            call[:3] == ["input_ids", "positions", "forward_batch"],
        )
    )
    stores = _self_stores(model)
    out.append(
        Check(
            "DeepseekV2Model.{config, layers, norm, layers_to_capture, start_layer, end_layer}",
            {"config", "layers", "norm", "layers_to_capture", "start_layer", "end_layer"} <= stores,
        )
    )
    if rel.hooks == "layernorm":
        layer = _class(tree, "DeepseekV2DecoderLayer")
        out.append(Check("DeepseekV2Model.embed_tokens", "embed_tokens" in stores))
        out.append(
            Check(
                "DeepseekV2DecoderLayer.input_layernorm", "input_layernorm" in _self_stores(layer)
            )
        )
        calls = _text(pkg, "srt/layers/communicator.py", "srt/layers/layer_boundary/**/*.py")
        out.append(
            Check(
                "the input norm called as a module with the residual",
                re.search(
                    r"(?:self\.input_layernorm|return norm)\(\s*hidden_states,\s*residual", calls
                )
                is not None,
            )
        )
        ln = _text(pkg, "srt/layers/layernorm.py")
        out.append(Check("RMSNorm returns (x, residual)", "return x, residual" in ln))
    elif rel.hooks == "aux_capture":
        aux = _text(pkg, "srt/layers/aux_hidden_states.py")
        out.append(
            Check("AuxHiddenStatePacker.capture(hidden, owned=)", "def capture(self, hidden" in aux)
        )
        eagle = ast.get_source_segment(dsv2, _method(causal, "set_eagle3_layers_to_capture")) or ""  # type: ignore[arg-type]
        out.append(
            Check(
                "set_eagle3_layers_to_capture: default [2, L // 2, L - 3], lists from 1 shifted",
                "[2, num_layers // 2, num_layers - 3]" in eagle and "layer_ids[0] == 1" in eagle,
            )
        )
    else:
        out.append(Check(f"a known hooks design (not {rel.hooks!r})", False))
    return out


def _has_args(pkg: Path, rel: SglangVersion) -> bool:
    return any(any(Path(pkg).glob(g)) for g in rel.args_files)


def _version_of(pkg: Path) -> str:
    from hsextract.sglang.patching import installed_version

    return installed_version(Path(pkg))


def deterministic_align(pkg: Path) -> tuple[tuple[str, str, int], ...]:
    """``backend_sizes`` of ``init_deterministic_inference_config`` in scheduler.py."""
    src = _text(pkg, "srt/managers/scheduler.py")
    i = src.find("def init_deterministic_inference_config")
    if i < 0:
        return ()
    body = src[i:]
    body = body[: body.find("self.truncation_align_size = (")]
    found = re.findall(r'"(\w+)":\s*\("(\w+)",\s*(\d+)\)', body)
    return tuple(sorted((b, env, int(n)) for b, env, n in found))


def prefill_backend_args(pkg: Path) -> tuple[str, ...]:
    """The options naming the backend that deterministic alignment is chosen by."""
    src = _text(pkg, "srt/managers/scheduler.py")
    if "prefill_backend, _ = attention_backends()" in src:
        return ("--prefill-attention-backend", "--attention-backend")
    return ("--attention-backend",)


def context_headroom(pkg: Path) -> int | None:
    """n tokens are accepted iff n < context_length - (headroom - 1); None if not found."""
    tp = _text(pkg, "srt/managers/tp_worker.py")
    a = re.search(r"max_req_len = min\(\s*self\.model_config\.context_len - (\d+),", tp)
    b = re.search(r"max_req_input_len = max_req_len - (\d+)", tp) or re.search(
        r"max_req_len - (\d+),", tp
    )
    utils = _text(pkg, "srt/managers/utils.py")
    if not (a and b and "if len(req.origin_input_ids) >= max_req_input_len:" in utils):
        return None
    return int(a.group(1)) + int(b.group(1)) + 1


def _pins(pkg: Path, version: str) -> dict[str, str]:
    """torch and sglang-kernel as the installed wheel's METADATA pins them."""
    meta = _text(Path(pkg).parent, f"sglang-{version}.dist-info/METADATA")
    return dict(re.findall(r"^Requires-Dist: (torch|sglang-kernel)==([^\s;]+)$", meta, re.M))


def nearest(version: str) -> SglangVersion:
    """The declared release closest below ``version`` (the oldest if it is older)."""
    known = list(versions.known().values())
    key = versions.version_key(version)
    below = [r for r in known if versions.version_key(r.version) <= key]
    return below[-1] if below else known[0]


def _layouts() -> list[tuple[tuple[str, ...], str]]:
    seen: list[tuple[tuple[str, ...], str]] = []
    for r in versions.known().values():
        if (r.args_files, r.args_classes) not in seen:
            seen.append((r.args_files, r.args_classes))
    return seen


def infer(pkg: Path, version: str | None = None) -> SglangVersion:
    """A declaration for an undeclared release, from its source at ``pkg``: the nearest
    declared release with what its source says instead, for the first hooks design (the
    nearest's first) whose checks all pass.  ConfigError naming the nearest release and
    every failing check otherwise."""
    pkg = Path(pkg)
    version = version or _version_of(pkg)
    near = nearest(version)
    base = replace(near, version=version)
    layouts = _layouts()
    layouts.sort(key=lambda lay: lay != (near.args_files, near.args_classes))
    for files, classes in layouts:
        cand = replace(base, args_files=files, args_classes=classes)
        if _has_args(pkg, cand) and len(declared_flags(pkg, cand)) > 100:
            base = cand
            break
    pins = _pins(pkg, version)
    headroom = context_headroom(pkg)
    base = replace(
        base,
        deterministic_align=deterministic_align(pkg),
        prefill_backend_args=prefill_backend_args(pkg),
        context_headroom=headroom if headroom is not None else near.context_headroom,
        torch=pins.get("torch", ""),
        sglang_kernel=pins.get("sglang-kernel", ""),
        # A dtype refusal is a fact about a kernel build: kept only for the same one.
        unserved_dtypes=near.unserved_dtypes
        if pins.get("sglang-kernel") == near.sglang_kernel
        else (),
        notes=(f"undeclared: {near.version}'s declaration adapted from its source",),
    )
    designs = [near.hooks, *(d for d in ("aux_capture", "layernorm") if d != near.hooks)]
    failed: list[Check] = []
    for design in designs:
        cand = replace(base, hooks=design, hooks_tp_args=_tp_args(design))
        checks = check(pkg, cand)
        if headroom is None:
            checks.append(Check("tp_worker/utils: the context-length headroom", False))
        bad = [c for c in checks if not c.ok]
        if not bad:
            return cand
        if design == near.hooks:
            failed = bad
    raise ConfigError(
        f"SGLang {version} has no declaration, and its source at {pkg} does not match the "
        f"nearest supported release, {near.version} (capture: hooks design {near.hooks!r}; "
        f"no other design fits either). What differs: "
        + "; ".join(c.need for c in failed)
        + f". Install a supported release ({', '.join(versions.known())}), or declare it "
        "under src/hsextract/sglang/versions/ (docs/sglang.md: adding a release)"
    )


def _tp_args(design: str) -> tuple[str, ...]:
    """What the design adds with tp_size > 1, as the latest declaration of it says."""
    return next(
        (r.hooks_tp_args for r in reversed(versions.known().values()) if r.hooks == design), ()
    )


__all__ = ["COMMAND_OPTIONS", "Check", "check", "infer", "nearest"]
