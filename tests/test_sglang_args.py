"""The extraction-mode launch command, checked flag by flag against SGLang 0.5.23's own
declarations (parsed from ``srt/arg_groups/fields/*.py`` and ``srt/server_args.py``)."""

from __future__ import annotations

import ast
import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsextract.config import load_config
from hsextract.errors import ConfigError
from hsextract.sglang import (
    CLIENT_MAX_NEW_TOKENS,
    CONTEXT_HEADROOM,
    FORBIDDEN_FLAGS,
    MANAGED_FLAGS,
    build_launch,
    redact_argv,
    validate_sglang_config,
)

ROOT = Path(__file__).resolve().parents[1]
PROD = ROOT / "configs" / "deepseek-v3-8xh200.yaml"


@dataclass
class Flag:
    name: str
    takes_value: bool
    choices: list[str] | None = None
    deprecated: bool = False
    names: list[str] = field(default_factory=list)


def _literal_strings(node: ast.AST) -> list[str]:
    return [
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def declared_flags(pkg: Path) -> dict[str, Flag]:
    """Every CLI option SGLang 0.5.23 registers, read the way arg_utils derives them:
    ``--field-name`` (or ``cli_name``) plus aliases, bools as store_true, ``no_cli`` skipped;
    plus the manual ``add_argument`` calls of ``ServerArgs.add_cli_args``."""
    flags: dict[str, Flag] = {}
    for path in sorted((pkg / "srt/arg_groups/fields").glob("*.py")):
        tree = ast.parse(path.read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            if not any(
                isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "_NS_PATH"
                for s in cls.body
            ):
                continue
            for st in cls.body:
                if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
                    continue
                ann = st.annotation
                if not (isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "A"):
                    continue
                typ, meta = ann.slice.elts  # type: ignore[attr-defined]
                kw: dict[str, ast.expr] = {}
                if isinstance(meta, ast.Call) and ast.unparse(meta.func) == "Arg":
                    kw = {k.arg: k.value for k in meta.keywords if k.arg}
                elif not (isinstance(meta, ast.Constant) and isinstance(meta.value, str)):
                    continue
                if "no_cli" in kw and ast.unparse(kw["no_cli"]) == "True":
                    continue
                cli = "--" + st.target.id.replace("_", "-")
                if "cli_name" in kw:
                    cli = _literal_strings(kw["cli_name"])[0]
                aliases = _literal_strings(kw["aliases"]) if "aliases" in kw else []
                t = ast.unparse(typ)
                is_bool = t in ("bool", "Optional[bool]") and "action" not in kw
                choices = None
                if "Literal[" in t:
                    choices = _literal_strings(typ)
                elif "choices" in kw and isinstance(kw["choices"], ast.List):
                    choices = _literal_strings(kw["choices"])
                f = Flag(cli, takes_value=not is_bool, choices=choices, names=[cli, *aliases])
                for n in f.names:
                    flags[n] = f
    tree = ast.parse((pkg / "srt/server_args.py").read_text())
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "parser.add_argument"):
            continue
        names = [
            a.value
            for a in call.args
            if isinstance(a, ast.Constant) and str(a.value).startswith("--")
        ]
        kw = {k.arg: ast.unparse(k.value) for k in call.keywords if k.arg}
        action = kw.get("action", "")
        f = Flag(
            names[0],
            takes_value=action not in ("'store_true'", "DeprecatedStoreTrueAction"),
            deprecated=action.startswith("Deprecated") or "Deprecated" in kw.get("help", ""),
            names=names,
        )
        for n in names:
            flags[n] = f
    return flags


@pytest.fixture(scope="module")
def flags(sglang_pkg: Path) -> dict[str, Flag]:
    return declared_flags(sglang_pkg)


def _prod(**overrides: Any) -> dict:
    cfg = load_config(PROD)
    for k, v in overrides.items():
        node = cfg
        *parents, last = k.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return cfg


def _check_argv(argv: list[str], flags: dict[str, Flag]) -> list[str]:
    """Every option is declared, not deprecated, and gets a value iff it takes one."""
    seen = []
    i = 3
    while i < len(argv):
        tok = argv[i]
        assert tok.startswith("--"), f"stray value {tok!r} at {i}"
        assert tok in flags, f"{tok} is not declared by SGLang 0.5.23"
        f = flags[tok]
        assert tok == f.name, f"{tok} is an alias; emit the declared name {f.name}"
        assert not f.deprecated, f"{tok} is deprecated"
        seen.append(tok)
        if f.takes_value:
            value = argv[i + 1]
            assert not value.startswith("--")
            if f.choices:
                assert value in f.choices, f"{tok} {value} not in {f.choices}"
            i += 2
            while i < len(argv) and not argv[i].startswith("--"):  # nargs="+" lists
                i += 1
        else:
            i += 1
    return seen


def test_facts_about_the_pinned_flags(sglang_pkg: Path, flags: dict[str, Flag]) -> None:
    assert len(flags) > 300  # the parse found the real surface, not a handful
    # --disable-cuda-graph: deprecated spelling, pointing at the per-phase backends.
    sa = (sglang_pkg / "srt/server_args.py").read_text()
    assert flags["--disable-cuda-graph"].deprecated
    assert re.search(
        r'"--disable-cuda-graph",\s*action=DeprecatedStoreTrueAction,\s*new_flag="--cuda-graph-backend-\{decode,prefill\}=disabled"',
        sa,
    )
    for phase in ("decode", "prefill"):
        f = flags[f"--cuda-graph-backend-{phase}"]
        assert f.takes_value and f.choices and "disabled" in f.choices and not f.deprecated
    # --tp is not declared; it works only as argparse's abbreviation of --tp-size.
    assert "--tp" not in flags and flags["--tp-size"].takes_value
    assert [n for n in flags if n.startswith("--tp")] == ["--tp-size"]
    assert 'argparse.ArgumentParser(prog="sglang serve")' in sa  # allow_abbrev left on
    # python -m sglang.launch_server still exists (beside `sglang serve`).
    ls = (sglang_pkg / "launch_server.py").read_text()
    assert 'if __name__ == "__main__":' in ls and "prepare_server_args(sys.argv[1:])" in ls
    # Hierarchical cache is off by default; radix cache flag is a plain switch.
    assert not flags["--enable-hierarchical-cache"].takes_value and "--enable-hicache" in flags
    assert not flags["--disable-radix-cache"].takes_value
    assert (
        flags["--forward-hooks"].takes_value
        and not flags["--enable-return-aux-hidden-states"].takes_value
    )


def test_refusal_lists_name_real_flags(flags: dict[str, Flag]) -> None:
    # A refusal of a flag SGLang does not have would be dead protection.
    for flag in [*FORBIDDEN_FLAGS, *MANAGED_FLAGS]:
        assert flag in flags or flag == "--tp", flag


def test_max_new_tokens_zero_is_a_prefill_only_request(sglang_pkg: Path) -> None:
    assert CLIENT_MAX_NEW_TOKENS == 0
    sp = (sglang_pkg / "srt/sampling/sampling_params.py").read_text()
    assert re.search(r"if self\.max_new_tokens < 0:\s*raise ValueError", sp)  # 0 accepted
    sb = (sglang_pkg / "srt/managers/schedule_batch.py").read_text()
    assert "return self.sampling_params.max_new_tokens == 0 and spec_alg is None" in sb
    tp = (sglang_pkg / "srt/managers/tp_worker.py").read_text()
    assert "if not forward_batch.is_prefill_only:" in tp  # no sampling for such a batch


def _int_after(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    assert m is not None, pattern
    return int(m.group(1))


def test_context_headroom_is_what_sglang_needs(sglang_pkg: Path) -> None:
    """An input of n tokens is accepted iff n < (context_len - a) - b; we need n = max_seq_len."""
    tp = (sglang_pkg / "srt/managers/tp_worker.py").read_text()
    a = _int_after(r"max_req_len = min\(\s*self\.model_config\.context_len - (\d+),", tp)
    b = _int_after(r"max_req_input_len = max_req_len - (\d+)", tp)
    utils = (sglang_pkg / "srt/managers/utils.py").read_text()
    assert "if len(req.origin_input_ids) >= max_req_input_len:" in utils
    assert CONTEXT_HEADROOM == a + b + 1  # smallest context_len with max_seq_len < limit
    cfg = _prod()
    argv, _ = build_launch(cfg, dump_dir="/dev/shm/x", port=1)
    ctx = int(argv[argv.index("--context-length") + 1])
    assert cfg["max_seq_len"] < ctx - a - b and not cfg["max_seq_len"] < (ctx - 1) - a - b


@pytest.mark.parametrize("capture", ["patch", "hooks"])
def test_build_launch_emits_only_declared_flags(flags: dict[str, Flag], capture: str) -> None:
    cfg = _prod(capture=capture, **({"aux_layers": [2, 30, 58]} if capture == "hooks" else {}))
    argv, env = build_launch(cfg, dump_dir="/dev/shm/hs", port=31000)
    assert argv[:3] == ["/opt/sglang-0.5.23/bin/python", "-m", "sglang.launch_server"]
    seen = _check_argv(argv, flags)
    for needed in (
        "--cuda-graph-backend-decode", "--cuda-graph-backend-prefill", "--disable-radix-cache",
        "--tp-size", "--host", "--port", "--context-length", "--model-path",
    ):  # fmt: skip
        assert needed in seen
    assert argv[argv.index("--cuda-graph-backend-decode") + 1] == "disabled"
    assert argv[argv.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    assert argv[argv.index("--tp-size") + 1] == "8"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert not any("hierarchical" in a or "hicache" in a for a in argv)
    assert env["SGLANG_HS_DUMP_DIR"] == "/dev/shm/hs"
    assert env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] == "1"
    # The server imports the hsextract this process imports (whichever checkout the
    # venv's editable install points at), not necessarily the one this test file is in.
    import hsextract

    assert env["PYTHONPATH"].split(":")[0] == str(Path(hsextract.__file__).resolve().parents[1])
    assert (Path(env["PYTHONPATH"].split(":")[0]) / "hsextract" / "capture.py").is_file()
    if capture == "hooks":
        assert env["HSEXTRACT_AUX_LAYERS"] == "[2, 30, 58]"
        spec = json.loads(argv[argv.index("--forward-hooks") + 1])
        assert spec[0]["hook_factory"] == "hsextract.hooks:dump_hook_factory"
        assert argv[argv.index("--speculative-algorithm") + 1] == "EAGLE3"
        i = argv.index("--return-aux-hidden-state-layer-ids")
        assert argv[i + 1 : i + 4] == ["2", "30", "58"]
    else:
        assert "--forward-hooks" not in argv and "--speculative-algorithm" not in argv


def test_aux_layers_env_from_model_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 61}))
    _, env = build_launch(_prod(**{"model.path": str(tmp_path)}), dump_dir="/d", port=1)
    assert json.loads(env["HSEXTRACT_AUX_LAYERS"]) == [2, 30, 58]


def test_remote_host_needs_allow_remote_and_key(flags: dict[str, Flag]) -> None:
    with pytest.raises(ConfigError, match="not loopback"):
        validate_sglang_config(_prod(**{"server.host": "0.0.0.0"}))
    with pytest.raises(ConfigError, match="not loopback"):
        validate_sglang_config(_prod(**{"server.host": "0.0.0.0", "server.allow_remote": True}))
    cfg = _prod(
        **{"server.host": "0.0.0.0", "server.allow_remote": True, "server.api_key": "s3cret"}
    )
    argv, _ = build_launch(cfg, dump_dir="/d", port=1)
    _check_argv(argv, flags)
    assert argv[argv.index("--api-key") + 1] == "s3cret"
    assert "s3cret" not in redact_argv(argv)


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--enable-hierarchical-cache"], "hierarchical cache"),
        (["--enable-hicache"], "hierarchical cache"),
        (["--enable-hier"], "hierarchical cache"),  # argparse abbreviation
        (["--enable-lmcache"], "hierarchical"),
        (["--radix-cache-backend", "x"], "radix cache"),
        (["--disable-cuda-graph"], "deprecated"),
        (["--cuda-graph-backend-prefill", "full"], "CUDA graphs"),
        (["--cuda-graph-backend-decode=breakable"], "CUDA graphs"),
        (["--cuda-graph-config", "{}"], "CUDA graphs"),
        (["--enable-torch-compile"], "compiled"),
        (["--context-length", "4096"], "max_seq_len"),
        (["--tp", "4"], "sglang.tp_size"),
        (["--host", "0.0.0.0"], "server.host"),
        (["--enable-two-batch-overlap"], "overlap"),
        (["--enable-mixed-chunk"], "decode tokens"),
        (["--allow-auto-truncate"], "truncat"),
        (["--attn-dp-size", "8"], "DP attention"),
        (["--pp-size", "2"], "pipeline"),
        (["--speculative-algorithm", "EAGLE3"], "capture"),
        (["--config", "x.yaml"], "config file"),
    ],
)
def test_forbidden_extra_args_are_refused(extra: list[str], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        build_launch(_prod(**{"sglang.extra_args": extra}), dump_dir="/d", port=1)


def test_harmless_extra_args_pass_through(flags: dict[str, Flag]) -> None:
    argv, _ = build_launch(
        _prod(**{"sglang.extra_args": ["--trust-remote-code", "--log-level", "warning"]}),
        dump_dir="/d",
        port=1,
    )
    assert argv[-3:] == ["--trust-remote-code", "--log-level", "warning"]
    _check_argv(argv, flags)


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"sglang.context_length": 8192}, "too short for max_seq_len 8192"),
        ({"sglang.context_length": 4096}, "too short"),
        ({"sglang.disable_radix_cache": False}, "unknown sglang keys"),
        ({"sglang.extra_env": {"SGLANG_HS_DUMP_DIR": "/tmp/x"}}, "build_launch owns"),
        ({"sglang.tp_size": 0}, "tp_size"),
        ({"capture": "hooks", "aux_layers": [1, 30, 58]}, "shifts"),
    ],
)
def test_forbidden_config_values_are_refused(overrides: dict[str, Any], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        validate_sglang_config(_prod(**overrides))


def test_production_config_validates_and_prints(flags: dict[str, Flag]) -> None:
    raw = yaml.safe_load(PROD.read_text())
    cfg = load_config(PROD)  # the schema, with its defaults
    assert raw["engine"] == "sglang" and raw["max_seq_len"] == 8192 and not raw["demo"]["enabled"]
    assert raw["sglang"]["tp_size"] == 8 and cfg["dump"]["shm_budget_gb"] > 0
    argv, env = build_launch(copy.deepcopy(cfg), dump_dir="/dev/shm/hs", port=30000)
    _check_argv(argv, flags)
    assert argv[argv.index("--context-length") + 1] == str(8192 + CONTEXT_HEADROOM)
