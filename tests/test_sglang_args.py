"""The extraction-mode launch command, checked flag by flag against each supported release's
own declarations (``hsextract.sglang.flags`` reads them from the release's source)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures_sglang import fake_release

from hsextract.config import Config, load_config, typed
from hsextract.errors import ConfigError
from hsextract.sglang import versions
from hsextract.sglang.compat import AUX_CAPTURE_OPTIONS, COMMAND_OPTIONS
from hsextract.sglang.flags import Flag, check_argv, declared_flags
from hsextract.sglang.launch import (
    CLIENT_MAX_NEW_TOKENS,
    CONTEXT_HEADROOM,
    FORBIDDEN_FLAGS,
    MANAGED_FLAGS,
    build_launch,
    redact_argv,
    validate_sglang_config,
)
from hsextract.sglang.patching import ensure_pinned_source

ROOT = Path(__file__).resolve().parents[1]
PROD = ROOT / "configs" / "deepseek-v3-8xh200.yaml"


@pytest.fixture(scope="module")
def flags(release: str, release_pkg: Path) -> dict[str, Flag]:
    """The options ``release`` declares, read from its source by the library's parser."""
    return declared_flags(release_pkg, versions.get(release))


@pytest.fixture(scope="module")
def flags23(sglang_pkg: Path) -> dict[str, Flag]:
    return declared_flags(sglang_pkg, versions.get("0.5.23"))


@pytest.fixture(scope="module")
def flags14(pkg14: Path) -> dict[str, Flag]:
    return declared_flags(pkg14, versions.get("0.5.14"))


def _prod(version: str = "0.5.23", **overrides: Any) -> Config:
    """The production config, for a given release (explicit: no SGLang env here); the
    overrides set unvalidated (typed, not load_config): some are meant to be refused."""
    cfg = load_config(PROD)
    cfg["sglang"]["version"] = version
    for k, v in overrides.items():
        node = cfg
        *parents, last = k.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return typed(cfg)


def test_facts_about_the_0523_flags(sglang_pkg: Path, flags23: dict[str, Flag]) -> None:
    flags = flags23
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


def test_facts_about_the_0514_flags(pkg14: Path, flags14: dict[str, Flag]) -> None:
    """What the H200's live release declares -- and what it lacks."""
    flags = flags14
    assert len(flags) > 300
    assert flags["--disable-cuda-graph"].deprecated
    for phase in ("decode", "prefill"):
        f = flags[f"--cuda-graph-backend-{phase}"]
        assert f.takes_value and f.choices and "disabled" in f.choices and not f.deprecated
    assert "--tp" not in flags and flags["--tp-size"].takes_value
    assert not flags["--disable-radix-cache"].takes_value
    assert flags["--forward-hooks"].takes_value
    # No aux-hidden-state return in 0.5.14 (hooks capture at the input norms instead);
    # --enable-return-hidden-states returns the last chunk only with chunked prefill.
    assert "--enable-return-aux-hidden-states" not in flags
    assert "--return-aux-hidden-state-layer-ids" not in flags
    assert not flags["--enable-return-hidden-states"].takes_value
    assert not flags["--enable-deterministic-inference"].takes_value
    assert not flags["--enforce-disable-flashinfer-allreduce-fusion"].takes_value
    ls = (pkg14 / "launch_server.py").read_text()
    assert 'if __name__ == "__main__":' in ls


def test_refusal_lists_name_real_flags(flags23: dict[str, Flag], flags14: dict[str, Flag]) -> None:
    # A refusal of a flag no supported SGLang has would be dead protection.
    for flag in [*FORBIDDEN_FLAGS, *MANAGED_FLAGS]:
        assert flag in flags23 or flag in flags14 or flag == "--tp", flag


def test_max_new_tokens_zero_is_a_prefill_only_request(release: str, release_pkg: Path) -> None:
    assert CLIENT_MAX_NEW_TOKENS == 0
    sp = (release_pkg / "srt/sampling/sampling_params.py").read_text()
    assert re.search(r"if self\.max_new_tokens < 0:\s*raise ValueError", sp)  # 0 accepted
    sb = (release_pkg / "srt/managers/schedule_batch.py").read_text()
    assert re.search(r"self\.sampling_params\.max_new_tokens == 0", sb)
    tp = (release_pkg / "srt/managers/tp_worker.py").read_text()
    assert "is_prefill_only" in tp  # no sampling for such a batch


def _int_after(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    assert m is not None, pattern
    return int(m.group(1))


def test_context_headroom_is_what_sglang_needs(release: str, release_pkg: Path) -> None:
    """An input of n tokens is accepted iff n < (context_len - a) - b; we need n = max_seq_len."""
    tp = (release_pkg / "srt/managers/tp_worker.py").read_text()
    a = _int_after(r"max_req_len = min\(\s*self\.model_config\.context_len - (\d+),", tp)
    b = (
        _int_after(r"max_req_input_len = max_req_len - (\d+)", tp)
        if ("max_req_input_len = max_req_len -" in tp)
        else _int_after(r"max_req_len - (\d+),", tp)
    )
    utils = (release_pkg / "srt/managers/utils.py").read_text()
    assert "if len(req.origin_input_ids) >= max_req_input_len:" in utils
    rel = versions.get(release)
    assert rel.context_headroom == CONTEXT_HEADROOM == a + b + 1
    cfg = _prod(release)
    argv, _ = build_launch(cfg, dump_dir="/dev/shm/x", port=1)
    ctx = int(argv[argv.index("--context-length") + 1])
    assert cfg.max_seq_len < ctx - a - b and not cfg.max_seq_len < (ctx - 1) - a - b


@pytest.mark.parametrize("capture", ["patch", "hooks"])
def test_build_launch_emits_only_declared_flags(
    release: str, flags: dict[str, Flag], capture: str
) -> None:
    cfg = _prod(release, capture=capture, aux_layers=[2, 30, 58])
    argv, env = build_launch(cfg, dump_dir="/dev/shm/hs", port=31000)
    assert argv[:3] == ["/opt/sglang-0.5.23/bin/python", "-m", "sglang.launch_server"]
    seen = check_argv(argv, flags, release)
    rel = versions.get(release)
    # compat.check holds an undeclared release to the same options.
    assert set(seen) <= {*COMMAND_OPTIONS, *AUX_CAPTURE_OPTIONS, *rel.hooks_tp_args}
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
    assert env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] == "1"
    # The server imports the hsextract this process imports (whichever checkout the
    # venv's editable install points at), not necessarily the one this test file is in.
    import hsextract

    assert env["PYTHONPATH"].split(":")[0] == str(Path(hsextract.__file__).resolve().parents[1])
    assert (Path(env["PYTHONPATH"].split(":")[0]) / "hsextract" / "capture.py").is_file()
    assert env["HSEXTRACT_AUX_LAYERS"] == "[2, 30, 58]"
    if capture == "patch":
        assert env["SGLANG_HS_DUMP_DIR"] == "/dev/shm/hs"
        assert "--forward-hooks" not in argv and "--speculative-algorithm" not in argv
        return
    # Hooks: the dump dir travels in the hooks' config only (a patched install must not
    # dump twice), and each release gets its design.
    assert "SGLANG_HS_DUMP_DIR" not in env
    spec = json.loads(argv[argv.index("--forward-hooks") + 1])
    assert {s["hook_factory"] for s in spec} == {"hsextract.sglang.hooks:dump_hook_factory"}
    assert {s["config"]["dump_dir"] for s in spec} == {"/dev/shm/hs"}
    if versions.get(release).hooks == "aux_capture":
        assert argv[argv.index("--speculative-algorithm") + 1] == "EAGLE3"
        i = argv.index("--return-aux-hidden-state-layer-ids")
        assert argv[i + 1 : i + 4] == ["2", "30", "58"]
    else:
        assert "--speculative-algorithm" not in argv
        targets = [t for s in spec for t in s["target_modules"]]
        assert "model.layers.30.input_layernorm" in targets and targets[-1] == "model"
        # TP=8 on SM90 would auto-enable the fused all-reduce + norm that bypasses them.
        assert "--enforce-disable-flashinfer-allreduce-fusion" in argv


def test_an_unsupported_release_is_refused_naming_the_known() -> None:
    known = ", ".join(versions.known())
    assert known.startswith("0.5.14, 0.5.15.post1, 0.5.16") and known.endswith("0.5.22, 0.5.23")
    with pytest.raises(ConfigError, match=rf"SGLang 0\.5\.9 is not supported: known {known}"):
        build_launch(_prod("0.5.9"), dump_dir="/d", port=1)


def test_the_installed_release_is_detected_from_the_env(tmp_path: Path) -> None:
    from hsextract.sglang import launch

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 0.5.14\n")
    fake.chmod(0o755)
    cfg = _prod(**{"sglang.version": None, "sglang.python": str(fake)})
    assert launch.release(cfg).version == "0.5.14"
    missing = _prod(**{"sglang.version": None, "sglang.python": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="sglang.python"):
        launch.release(missing)


def test_an_undeclared_installed_release_is_read_from_its_source(tmp_path: Path) -> None:
    """sglang.python's env holds 0.5.24 (0.5.23's source renamed): capture: hooks runs on
    a declaration read from it; capture: patch is refused (no patch), naming the tool."""
    from hsextract.sglang import launch

    pkg = fake_release(ensure_pinned_source("0.5.23") / "sglang", tmp_path)
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\ncase "$2" in *find_spec*) echo {pkg};; *) echo 0.5.24;; esac\n')
    fake.chmod(0o755)
    env = {"sglang.version": None, "sglang.python": str(fake)}
    rel = launch.release(_prod(**env, capture="hooks"))
    assert (rel.version, rel.hooks) == ("0.5.24", "aux_capture")
    with pytest.raises(ConfigError, match=r"0\.5\.24 is not supported.*patches/port\.py 0\.5\.24"):
        launch.release(_prod(**env, capture="patch"))
    with pytest.raises(ConfigError, match=r"sglang.version says 0\.5\.25, .* is sglang 0\.5\.24"):
        launch.release(_prod(**{**env, "sglang.version": "0.5.25"}, capture="hooks"))


def test_aux_layers_env_from_model_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 61}))
    _, env = build_launch(_prod(**{"model.path": str(tmp_path)}), dump_dir="/d", port=1)
    assert json.loads(env["HSEXTRACT_AUX_LAYERS"]) == [2, 30, 58]


def test_remote_host_needs_allow_remote_and_key(release: str, flags: dict[str, Flag]) -> None:
    with pytest.raises(ConfigError, match="not loopback"):
        validate_sglang_config(_prod(release, **{"server.host": "0.0.0.0"}))
    with pytest.raises(ConfigError, match="not loopback"):
        validate_sglang_config(
            _prod(release, **{"server.host": "0.0.0.0", "server.allow_remote": True})
        )
    cfg = _prod(
        release,
        **{"server.host": "0.0.0.0", "server.allow_remote": True, "server.api_key": "s3cret"},
    )
    argv, _ = build_launch(cfg, dump_dir="/d", port=1)
    check_argv(argv, flags, release)
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
        (["--enable-prefill-cp"], "context parallel"),
        (["--attn-cp-size", "2"], "context parallel"),
        (["--speculative-algorithm", "EAGLE3"], "capture"),
        (["--config", "x.yaml"], "config file"),
    ],
)
def test_forbidden_extra_args_are_refused(extra: list[str], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        build_launch(_prod(**{"sglang.extra_args": extra}), dump_dir="/d", port=1)


def test_harmless_extra_args_pass_through(release: str, flags: dict[str, Flag]) -> None:
    argv, _ = build_launch(
        _prod(release, **{"sglang.extra_args": ["--trust-remote-code", "--log-level", "warning"]}),
        dump_dir="/d",
        port=1,
    )
    assert argv[-3:] == ["--trust-remote-code", "--log-level", "warning"]
    check_argv(argv, flags, release)


def test_an_undeclared_flag_is_refused_before_launch(flags14: dict[str, Flag]) -> None:
    """What launch_server runs against the installed release: a 0.5.23-only flag on 0.5.14."""
    argv, _ = build_launch(
        _prod("0.5.14", **{"sglang.extra_args": ["--enable-http-worker-reuseport"]}),
        dump_dir="/d",
        port=1,
    )
    with pytest.raises(
        ConfigError, match=r"sglang 0\.5\.14 declares no option --enable-http-worker"
    ):
        check_argv(argv, flags14, "0.5.14")


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
        validate_sglang_config(_prod(**overrides), versions.get("0.5.23"))


def test_hooks_on_0514_take_any_aux_layers() -> None:
    # The shift of lists starting with 1 is 0.5.23's aux capture; 0.5.14's norm hooks
    # capture any layers.
    validate_sglang_config(
        _prod("0.5.14", capture="hooks", aux_layers=[1, 30, 58]), versions.get("0.5.14")
    )


def test_production_config_validates_and_prints(release: str, flags: dict[str, Flag]) -> None:
    raw = yaml.safe_load(PROD.read_text())
    cfg = _prod(release)  # the schema, with its defaults
    assert raw["engine"] == "sglang" and raw["max_seq_len"] == 8192 and not raw["demo"]["enabled"]
    assert raw["sglang"]["tp_size"] == 8 and cfg.dump.shm_budget_gb > 0
    argv, env = build_launch(cfg, dump_dir="/dev/shm/hs", port=30000)
    check_argv(argv, flags, release)
    assert argv[argv.index("--context-length") + 1] == str(8192 + CONTEXT_HEADROOM)


def _declared_align_sizes(pkg: Path) -> dict[str, tuple[str, int]]:
    """``backend_sizes`` of the release's ``init_deterministic_inference_config``, read
    from its scheduler.py: {backend: (env var, default)}."""
    src = (pkg / "srt/managers/scheduler.py").read_text()
    body = src[src.index("def init_deterministic_inference_config") :]
    body = body[: body.index("self.truncation_align_size = (")]
    found = re.findall(r'"(\w+)":\s*\("(\w+)",\s*(\d+)\)', body)
    return {b: (env, int(n)) for b, env, n in found}


def test_deterministic_alignment_declared_as_each_release_has_it(
    release: str, release_pkg: Path
) -> None:
    rel = versions.get(release)
    declared = {b: (e, n) for b, e, n in rel.deterministic_align}
    assert declared == _declared_align_sizes(release_pkg)
    scheduler = (release_pkg / "srt/managers/scheduler.py").read_text()
    body = scheduler[scheduler.index("def init_deterministic_inference_config") :][:3000]
    # Which option names the backend it aligns for: --attention-backend up to 0.5.17, the
    # prefill backend (falling back to --attention-backend) from 0.5.18.
    if "prefill_backend, _ = attention_backends()" in body:
        assert rel.prefill_backend_args == ("--prefill-attention-backend", "--attention-backend")
    else:
        assert "self.server_args.attention_backend, (None, None)" in body
        assert rel.prefill_backend_args == ("--attention-backend",)
    if "def check_truncation_align_fits_chunk" in scheduler:
        return  # 0.5.22 on: refuses to start with a smaller chunk
    # Before: a record longer than a chunk below the alignment is left unscheduled, silently
    # (0.5.20 rounds the chunk down to the alignment, to 0, and returns OTHER the same).
    policy = (release_pkg / "srt/managers/schedule_policy.py").read_text()
    assert re.search(
        r"if trunc_len < truncation_align_size:\s*return AddReqResult.OTHER", policy
    ) or re.search(
        r"extend_len // truncation_align_size \* truncation_align_size\s*\)[^@]{0,300}?"
        r"if extend_len <= 0:\s*return AddReqResult.OTHER",
        policy,
    )


DET = ["--enable-deterministic-inference"]


@pytest.mark.parametrize(
    ("version", "extra", "chunk", "env", "refused"),
    [
        ("0.5.14", [*DET, "--attention-backend", "triton"], 64, {}, True),
        ("0.5.14", [*DET, "--attention-backend=triton"], 8192, {}, False),
        ("0.5.14", [*DET, "--attention-backend", "triton"], -1, {}, False),
        ("0.5.14", ["--enable-det", "--attention-backend", "flashinfer"], 2048, {}, True),
        (
            "0.5.14",
            [*DET, "--attention-backend", "triton"],
            64,
            {"SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE": "64"},
            False,
        ),
        ("0.5.14", [*DET, "--attention-backend", "fa3"], 64, {}, False),
        ("0.5.14", ["--attention-backend", "triton"], 64, {}, False),
        ("0.5.17", [*DET, "--prefill-attention-backend", "triton"], 64, {}, False),
        ("0.5.18", [*DET, "--prefill-attention-backend", "triton"], 64, {}, True),
        ("0.5.21", [*DET, "--attention-backend", "triton"], 64, {}, True),
        ("0.5.22", [*DET, "--attention-backend", "triton"], 64, {}, False),
        ("0.5.23", [*DET, "--attention-backend", "triton"], 64, {}, False),
        ("0.5.23", [*DET, "--prefill-attention-backend", "flashinfer"], 64, {}, True),
    ],
)
def test_deterministic_inference_with_a_chunk_below_its_alignment_is_refused(
    version: str, extra: list[str], chunk: int, env: dict, refused: bool
) -> None:
    cfg = _prod(
        version,
        **{"sglang.extra_args": extra, "sglang.extra_env": env,
           "server.chunked_prefill_size": chunk},
    )  # fmt: skip
    if refused:
        with pytest.raises(ConfigError, match=rf"chunked_prefill_size is {chunk}, so a record"):
            validate_sglang_config(cfg, versions.get(version))
    else:
        validate_sglang_config(cfg, versions.get(version))


@pytest.mark.parametrize("dtype", ["float32", "float"])
def test_float32_is_refused_for_the_releases_that_cannot_serve_it(dtype: str) -> None:
    # The releases pinning sglang-kernel 0.4.4, whose rmsnorm failed live on float32.
    refused = [v for v, rel in versions.known().items() if rel.sglang_kernel == "0.4.4"]
    assert refused == ["0.5.14", "0.5.15.post1"]
    for version in versions.known():
        cfg = _prod(version, **{"model.dtype": dtype})
        if version in refused:
            with pytest.raises(ConfigError, match=r"no float32 kernel.*Use bfloat16"):
                validate_sglang_config(cfg, versions.get(version))
        else:  # never run live: nothing known to refuse it for
            validate_sglang_config(cfg, versions.get(version))


def test_declared_pins_are_the_wheels(release: str, release_pkg: Path) -> None:
    """torch and sglang-kernel as the release's own METADATA pins them (h200/build.sh and
    the README's live/source-checked split read the declaration)."""
    (meta,) = release_pkg.parent.glob(f"sglang-{release}.dist-info/METADATA")
    pins = dict(
        re.findall(r"^Requires-Dist: (torch|sglang-kernel)==([^\s;]+)$", meta.read_text(), re.M)
    )
    rel = versions.get(release)
    assert pins == {"torch": rel.torch, "sglang-kernel": rel.sglang_kernel}


def test_readme_release_table_is_the_declarations() -> None:
    """The README's per-release table (live or source-checked, torch, design) says what
    the declarations say: live only where the torch pin is the H200 image's 2.11.0."""
    readme = (ROOT / "docs" / "sglang.md").read_text()
    rows = re.findall(r"^\| (0\.5\.[\w.]+) \| ([^|]+) \| ([\d.]+) \| `(\w+)` \|", readme, re.M)
    assert [r[0] for r in rows] == list(versions.known())
    for version, live, torch_pin, design in rows:
        rel = versions.get(version)
        assert (torch_pin, design) == (rel.torch, rel.hooks), version
        assert ("source-checked" in live) == (rel.torch != "2.11.0"), version
