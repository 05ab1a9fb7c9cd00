"""Capture without patching (``capture: hooks``), run through SGLang's real hook registration
for each release's design (0.5.23: SGLang's own aux capture; 0.5.14: the input norms), and a
check that every SGLang name the patch and the hooks rely on exists in each release's source."""

from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from fixtures_sglang import (
    StandInModel14,
    exec_defs,
    fake_release,
    harness,
    load_file_module,
    stand_in_model,
)
from safetensors import safe_open
from torch import nn

from hsextract.capture import get_writer
from hsextract.config import read_config
from hsextract.errors import ConfigError
from hsextract.sglang import compat, versions
from hsextract.sglang import hooks as hooks_mod
from hsextract.sglang.flags import check_argv, declared_flags
from hsextract.sglang.hooks import HOOK_FACTORY_PATH, HOOK_TARGET_MODULE, forward_hooks_spec
from hsextract.sglang.launch import build_launch
from hsextract.sglang.patching import ensure_pinned_source

H, L = 8, 8
DEFAULT_LAYERS = [2, 4, 5]
PROD = Path(__file__).resolve().parents[1] / "configs" / "deepseek-v3-8xh200.yaml"


class Outer(nn.Module):
    """Shaped like DeepseekV2ForCausalLM: the inner model is ``self.model`` and is called
    with positional arguments, as 0.5.23 does."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.model = inner
        self.config = inner.config
        self.pp_group = inner.pp_group
        self.capture_aux_hidden_states = False

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, fb: Any) -> Any:
        return self.model(ids, pos, fb, None, None)


@pytest.fixture
def server(aux_release: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """A stand-in server model: pristine forward, SGLang's own EAGLE-3 capture switched on by
    the real ``set_eagle3_layers_to_capture``, our hook registered by the real
    ``register_forward_hooks`` from the JSON we put on the command line."""
    dump = tmp_path / "dump"
    dump.mkdir(mode=0o700)
    monkeypatch.setenv("SGLANG_HS_DUMP_DIR", str(dump))
    monkeypatch.delenv("HSEXTRACT_AUX_LAYERS", raising=False)
    rank = [0]
    # dump_hook_factory imports sglang.srt.runtime_context.get_parallel inside the server.
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    rc = ModuleType("sglang.srt.runtime_context")
    rc.get_parallel = lambda: SimpleNamespace(tp_rank=rank[0])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", rc)

    sglang_pkg = ensure_pinned_source(aux_release) / "sglang"
    pristine = harness(sglang_pkg, aux_release, patched=False)
    inner_cls = type("Inner", (stand_in_model(sglang_pkg),), {"forward": pristine.forward})
    outer = Outer(inner_cls(L, H))
    text = (sglang_pkg / "srt/models/deepseek_v2.py").read_text()
    g = exec_defs(text, [("DeepseekV2ForCausalLM", "set_eagle3_layers_to_capture")], {})
    set_layers = g["set_eagle3_layers_to_capture"]
    hm = load_file_module(sglang_pkg / "srt/model_executor/hook_manager.py", "_pinned_hook_manager")
    return SimpleNamespace(
        outer=outer,
        dump=dump,
        rank=rank,
        set_layers=set_layers,
        hm=hm,
        FM=pristine.ForwardMode,
        pristine=pristine,
    )


def _register(server: Any, aux_layers: list[int] | None = None, prenorm: bool = False) -> None:
    server.set_layers(server.outer, aux_layers)  # what --return-aux-hidden-state-layer-ids does
    dump_layers = [*(aux_layers or DEFAULT_LAYERS), L] if prenorm else aux_layers
    spec = forward_hooks_spec("aux_capture", dump_layers, str(server.dump), L if prenorm else None)
    server.hm.register_forward_hooks(server.outer, json.loads(spec))


def _run(server: Any, reqs: list[tuple[str, torch.Tensor, int, int]], mode: str = "EXTEND") -> Any:
    ids = torch.cat([full[s : s + n] for _, full, s, n in reqs])
    pos = torch.cat([torch.arange(s, s + n) for _, _, s, n in reqs])
    fb = SimpleNamespace(
        forward_mode=getattr(server.FM, mode),
        rids=[r for r, *_ in reqs],
        extend_prefix_lens_cpu=[s for _, _, s, _ in reqs],
        extend_seq_lens_cpu=[n for *_, n in reqs],
        can_run_tbo=False,
    )
    return server.outer(ids, pos, fb)


def _pieces(
    dump: Path, layers: list[int] | None = None
) -> dict[str, list[tuple[int, dict[str, torch.Tensor]]]]:
    w = get_writer(str(dump))
    if w is not None:
        w.flush()
    out: dict[str, list[tuple[int, dict[str, torch.Tensor]]]] = {}
    for f in sorted(dump.glob("*/*.safetensors")):
        with safe_open(str(f), "pt") as so:
            got = json.loads(so.metadata()["aux_layers"])
            assert got == layers if layers is not None else got in (DEFAULT_LAYERS, [0, 3, 6])
            out.setdefault(f.parent.name, []).append(
                (int(f.stem), {k: so.get_tensor(k) for k in so.keys()})
            )
    return out


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


def _check(model: StandInModel14, full: torch.Tensor, pieces: list, layers: list[int]) -> None:
    pieces = sorted(pieces, key=lambda p: p[0])
    starts = [s for s, _ in pieces]
    ends = [s + t["input_ids"].shape[0] for s, t in pieces]
    assert starts[0] == 0 and ends[-1] == len(full) and starts[1:] == ends[:-1]
    final, entering = model.reference(full)
    assert torch.equal(torch.cat([t["input_ids"] for _, t in pieces]), full)
    torch.testing.assert_close(torch.cat([t["hidden_states"] for _, t in pieces]), final)
    want_aux = torch.cat([entering[i] for i in layers], dim=-1)
    torch.testing.assert_close(torch.cat([t["aux_hidden_states"] for _, t in pieces]), want_aux)


def test_hook_batch_and_split_passes(server: Any) -> None:
    _register(server)
    assert server.outer.model.layers_to_capture == DEFAULT_LAYERS
    a, b, c = _ids(10, 1), _ids(4, 2), _ids(3, 3)
    _run(server, [("a", a, 0, 4), ("b", b, 0, 4)])
    _run(server, [("c", c, 0, 3), ("a", a, 4, 6)])
    got = _pieces(server.dump)
    assert sorted(got) == ["a", "b", "c"]
    assert sorted(s for s, _ in got["a"]) == [0, 4]
    for rid, full in (("a", a), ("b", b), ("c", c)):
        _check(server.outer.model, full, got[rid], DEFAULT_LAYERS)


def test_an_armed_shift_positions_fault_stores_only_its_request_one_row_late(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live audit's injected error (tests/live): through the real hooks, a request
    matching a ``shift_positions`` rule is stored one position late, its token ids kept (so
    every capture check passes it); the other request in the same pass is untouched."""
    from hsextract import faults

    monkeypatch.setattr(
        faults, "SPEC", faults.load('{"capture": [{"rid": "a", "do": "shift_positions"}]}')
    )
    monkeypatch.setattr(faults, "ACTIVE", True)
    _register(server)
    a, b = _ids(6, 1), _ids(5, 2)
    _run(server, [("b", b, 0, 5), ("a", a, 0, 6)])
    got = _pieces(server.dump)
    _check(server.outer.model, b, got["b"], DEFAULT_LAYERS)
    ((_, piece),) = got["a"]
    final, entering = server.outer.model.reference(a)
    assert torch.equal(piece["input_ids"], a)
    torch.testing.assert_close(piece["hidden_states"], final.roll(1, dims=0))
    want_aux = torch.cat([entering[i] for i in DEFAULT_LAYERS], dim=-1).roll(1, dims=0)
    torch.testing.assert_close(piece["aux_hidden_states"], want_aux)
    assert not torch.allclose(piece["hidden_states"], final)


@pytest.mark.parametrize("layers", [None, [0, 3, 6]])
def test_hook_prenorm_final(server: Any, layers: list[int] | None) -> None:
    """prenorm_final with SGLang's own aux capture: layers from SGLang, index L from a
    hook on the final norm; the server still captures only the EAGLE-3 layers."""
    _register(server, layers, prenorm=True)
    want = [*(layers or DEFAULT_LAYERS), L]
    assert server.outer.model.layers_to_capture == (layers or DEFAULT_LAYERS)
    a, b = _ids(7, 21), _ids(3, 22)
    _run(server, [("a", a, 0, 4), ("b", b, 0, 3)])
    _run(server, [("a", a, 4, 3)])
    assert hooks_mod._STASH.prenorm is None  # consumed, nothing left for the next forward
    got = _pieces(server.dump, want)
    for rid, full in (("a", a), ("b", b)):
        _check(server.outer.model, full, got[rid], want)


def test_hook_configured_layers(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSEXTRACT_AUX_LAYERS", "[0, 3, 6]")
    _register(server, [0, 3, 6])
    full = _ids(7, 4)
    _run(server, [("d", full, 0, 7)])
    _check(server.outer.model, full, _pieces(server.dump)["d"], [0, 3, 6])


def test_hook_leaves_output_alone(server: Any) -> None:
    server.set_layers(server.outer, None)
    reqs = [("e", _ids(5, 5), 0, 5)]
    before = _run(server, reqs)
    _register(server)
    after = _run(server, reqs)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


@pytest.mark.parametrize("mode", ["DECODE", "IDLE"])
def test_hook_non_extend_writes_nothing(server: Any, mode: str) -> None:
    _register(server)
    _run(server, [("f", _ids(6, 6), 5, 1)], mode)
    assert _pieces(server.dump) == {}


def test_hook_rank_other_than_zero_writes_nothing(server: Any) -> None:
    _register(server)
    server.rank[0] = 3
    _run(server, [("g", _ids(4, 7), 0, 4)])
    assert _pieces(server.dump) == {}


def test_hook_refuses_a_server_capturing_other_layers(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HSEXTRACT_AUX_LAYERS", "[1, 3, 5]")
    # SGLang 0.5.23 shifts an id list that starts with 1: [1, 3, 5] -> [2, 4, 6].
    server.set_layers(server.outer, [1, 3, 5])
    assert server.outer.model.layers_to_capture == [2, 4, 6]
    spec = forward_hooks_spec("aux_capture", [1, 3, 5], str(server.dump))
    server.hm.register_forward_hooks(server.outer, json.loads(spec))
    with pytest.raises(RuntimeError, match=r"server captures layers \[2, 4, 6\]"):
        _run(server, [("h", _ids(4, 8), 0, 4)])


def test_hook_spec_shape() -> None:
    spec = json.loads(forward_hooks_spec("aux_capture", [2, 30, 58], "/dev/shm/d"))
    assert spec == [
        {
            "name": "hsextract-dump",
            "target_modules": [HOOK_TARGET_MODULE],
            "hook_factory": HOOK_FACTORY_PATH,
            "config": {"role": "aux_capture", "aux_layers": [2, 30, 58], "dump_dir": "/dev/shm/d"},
        }
    ]
    spec = json.loads(forward_hooks_spec("layernorm", [0, 30, 58], "/dev/shm/d"))
    assert [s["target_modules"] for s in spec] == [
        ["model.embed_tokens"], ["model.layers.0.input_layernorm"],
        ["model.layers.30.input_layernorm"], ["model.layers.58.input_layernorm"],
        ["model.norm"], ["model"],
    ]  # fmt: skip
    roles = [s["config"]["role"] for s in spec]
    assert roles == ["begin", "aux", "aux", "aux", "final", "write"]
    assert spec[-1]["config"] == {
        "role": "write",
        "aux_layers": [0, 30, 58],
        "dump_dir": "/dev/shm/d",
    }


# --- hooks on the input norms (0.5.14 - 0.5.22), registered by each release's hook manager --


@pytest.fixture
def server14(norm_release: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The release's pristine forward on its layout's stand-in inside an Outer, no dump env
    at all: the hooks' own config names the dump dir (a patched install must not dump
    twice)."""
    dump = tmp_path / "dump"
    dump.mkdir(mode=0o700)
    monkeypatch.delenv("SGLANG_HS_DUMP_DIR", raising=False)
    monkeypatch.delenv("HSEXTRACT_AUX_LAYERS", raising=False)
    rank = [0]
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    rc = ModuleType("sglang.srt.runtime_context")
    rc.get_parallel = lambda: SimpleNamespace(tp_rank=rank[0])  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", rc)
    pkg = ensure_pinned_source(norm_release) / "sglang"
    pristine = harness(pkg, norm_release, patched=False)
    inner_cls = type("InnerNorm", (stand_in_model(pkg),), {"forward": pristine.forward})
    outer = Outer(inner_cls(L, H))
    hm = load_file_module(pkg / "srt/model_executor/hook_manager.py", f"_hm_{norm_release}")
    return SimpleNamespace(outer=outer, dump=dump, rank=rank, hm=hm, FM=pristine.ForwardMode)


def _register14(server: Any, layers: list[int]) -> None:
    spec = forward_hooks_spec("layernorm", layers, str(server.dump))
    server.hm.register_forward_hooks(server.outer, json.loads(spec))


@pytest.mark.parametrize("layers", [DEFAULT_LAYERS, [0, 1, 7]])
def test_norm_hooks_capture_batches_and_split_passes(server14: Any, layers: list[int]) -> None:
    _register14(server14, layers)
    a, b, c = _ids(10, 1), _ids(4, 2), _ids(3, 3)
    _run(server14, [("a", a, 0, 4), ("b", b, 0, 4)])
    _run(server14, [("c", c, 0, 3), ("a", a, 4, 6)])
    _run(server14, [("a", a, 9, 1)], "DECODE")  # decode passes write nothing, leak nothing
    assert hooks_mod._STASH.aux == {} and hooks_mod._STASH.final is None
    got = _pieces(server14.dump, layers)
    assert sorted(got) == ["a", "b", "c"]
    assert sorted(s for s, _ in got["a"]) == [0, 4]
    for rid, full in (("a", a), ("b", b), ("c", c)):
        _check(server14.outer.model, full, got[rid], layers)


def test_norm_hooks_prenorm_final(server14: Any) -> None:
    """Index L with the layernorm design: the final norm's fused add gives the stream."""
    layers = [*DEFAULT_LAYERS, L]
    spec = forward_hooks_spec("layernorm", layers, str(server14.dump), L)
    names = [s["name"] for s in json.loads(spec)]
    assert "hsextract-prenorm" in names and f"hsextract-aux-{L}" not in names
    server14.hm.register_forward_hooks(server14.outer, json.loads(spec))
    a, b = _ids(8, 31), _ids(5, 32)
    _run(server14, [("a", a, 0, 3), ("b", b, 0, 5)])
    _run(server14, [("a", a, 3, 5)])
    got = _pieces(server14.dump, layers)
    for rid, full in (("a", a), ("b", b)):
        _check(server14.outer.model, full, got[rid], layers)


def test_norm_hooks_leave_the_output_alone(server14: Any) -> None:
    reqs = [("e", _ids(5, 5), 0, 5)]
    before = _run(server14, reqs)
    _register14(server14, DEFAULT_LAYERS)
    assert torch.equal(before, _run(server14, reqs))


def test_norm_hooks_rank_other_than_zero_writes_nothing(server14: Any) -> None:
    _register14(server14, DEFAULT_LAYERS)
    server14.rank[0] = 1
    _run(server14, [("g", _ids(4, 7), 0, 4)])
    assert _pieces(server14.dump, DEFAULT_LAYERS) == {}


def test_a_bypassed_norm_fails_the_forward_loudly(server14: Any) -> None:
    """A fused all-reduce + norm kernel calls the norm's weights, not the module: no hook
    fires, and the forward must fail rather than leave a request's pieces short."""
    _register14(server14, DEFAULT_LAYERS)
    layer = server14.outer.model.layers[4]
    norm = layer.input_layernorm
    del layer.input_layernorm  # a module attribute: replace it by a plain function
    layer.input_layernorm = lambda *a: norm.forward(*a)  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match=r"never called the input_layernorm of aux layers \[4\]"):
        _run(server14, [("x", _ids(4, 9), 0, 4)])
    assert hooks_mod._STASH.aux == {}  # nothing of the failed pass carries over


# --- every SGLang name we read exists in the pinned source ------------------------------


def _src(pkg: Path, rel: str) -> str:
    return (pkg / rel).read_text()


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _self_attrs(cls: ast.ClassDef) -> set[str]:
    out = set()
    for n in ast.walk(cls):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            if isinstance(n.ctx, ast.Store):
                out.add(n.attr)
    return out


def _forward_batch_names(pkg: Path) -> tuple[set[str], set[str]]:
    """``ForwardBatch``'s declared fields and ``ForwardMode``'s methods, in ``pkg``'s source."""
    fbi = ast.parse(_src(pkg, "srt/model_executor/forward_batch_info.py"))
    fields = {
        n.target.id
        for n in _class(fbi, "ForwardBatch").body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    modes = {n.name for n in _class(fbi, "ForwardMode").body if isinstance(n, ast.FunctionDef)}
    return fields, modes


def test_sglang_names_we_read_exist(sglang_pkg: Path) -> None:
    dsv2 = _src(sglang_pkg, "srt/models/deepseek_v2.py")
    tree = ast.parse(dsv2)

    # ForwardBatch fields and ForwardMode methods (patch + hook read them).
    fb_fields, fm = _forward_batch_names(sglang_pkg)
    assert {"forward_mode", "rids", "extend_prefix_lens_cpu", "extend_seq_lens_cpu"} <= fb_fields
    assert {"is_extend", "is_target_verify", "is_idle"} <= fm

    # DeepseekV2Model attributes read by begin_forward / the hook.
    model = _class(tree, "DeepseekV2Model")
    attrs = _self_attrs(model)
    assert {"config", "pp_group", "layers_to_capture", "start_layer", "end_layer", "norm"} <= attrs
    assert "self.pp_group.is_last_rank" in dsv2
    fwd = _method(model, "forward")
    assert [a.arg for a in fwd.args.args][:4] == ["self", "input_ids", "positions", "forward_batch"]
    fwd_src = ast.get_source_segment(dsv2, fwd) or ""
    assert "return hidden_states, aux_hidden_states.finalize()" in fwd_src

    # The collector slot: the layer takes it, the attention stage calls .capture(value, owned=).
    layer_fwd = _method(_class(tree, "DeepseekV2DecoderLayer"), "forward")
    assert "captured_last_layer_outputs" in [a.arg for a in layer_fwd.args.args]
    assert "capture_gathered=captured_last_layer_outputs" in (
        ast.get_source_segment(dsv2, layer_fwd) or ""
    )
    stage = _src(sglang_pkg, "srt/layers/layer_boundary/stage.py")
    assert re.search(r"capture_gathered\.capture\(\s*gathered_last_layer_output,\s*owned=", stage)

    # The TP rank: get_parallel() is imported by deepseek_v2 and declares tp_rank.
    assert re.search(r"from sglang\.srt\.runtime_context import \([^)]*\bget_parallel,", dsv2)
    rc = _src(sglang_pkg, "srt/runtime_context.py")
    assert "def get_parallel() -> ParallelContext:" in rc
    assert re.search(
        r"^\s+tp_rank = Derived\(", _src(sglang_pkg, "srt/arg_groups/fields/parallel.py"), re.M
    )

    # The hook target: the inner model is `self.model`, called with positional args only.
    causal = _class(tree, "DeepseekV2ForCausalLM")
    assert "model" in _self_attrs(causal)
    call = next(
        n
        for n in ast.walk(_method(causal, "forward"))
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "self.model"
    )
    assert [ast.unparse(a) for a in call.args] == [
        "input_ids", "positions", "forward_batch", "input_embeds", "pp_proxy_tensors"
    ] and not call.keywords  # fmt: skip
    # EAGLE-3 default layers and the shift of lists starting with 1.
    eagle = ast.get_source_segment(dsv2, _method(causal, "set_eagle3_layers_to_capture")) or ""
    assert "[2, num_layers // 2, num_layers - 3]" in eagle
    assert "layer_ids[0] == 1" in eagle and "[val + 1 for val in layer_ids]" in eagle

    # --forward-hooks: spec keys, factory(config), plain register_forward_hook, after graphs.
    hm = _src(sglang_pkg, "srt/model_executor/hook_manager.py")
    for key in ('"name"', '"target_modules"', '"hook_factory"', '"config"'):
        assert f"spec.get({key}" in hm
    assert "hook_factory(config)" in hm and "module.register_forward_hook(hook)" in hm
    assert 'if ":" in path:' in hm  # "module:attr" paths resolve
    setup = _src(sglang_pkg, "srt/model_executor/model_runner_components/cuda_graph_setup.py")
    assert "Register forward hooks AFTER cuda-graph capture" in setup


def test_sglang_0514_names_we_read_exist(pkg14: Path) -> None:
    """What the 0.5.14 patch and its norm hooks rely on, read in 0.5.14's own source."""
    dsv2 = _src(pkg14, "srt/models/deepseek_v2.py")
    tree = ast.parse(dsv2)
    fb_fields, fm = _forward_batch_names(pkg14)
    assert {"forward_mode", "rids", "extend_prefix_lens_cpu", "extend_seq_lens_cpu"} <= fb_fields
    assert {"is_extend", "is_target_verify", "is_idle"} <= fm
    model = _class(tree, "DeepseekV2Model")
    attrs = _self_attrs(model)
    assert {"config", "pp_group", "layers_to_capture", "start_layer", "end_layer"} <= attrs
    assert {"norm", "embed_tokens", "layers"} <= attrs
    fwd = _method(model, "forward")
    assert [a.arg for a in fwd.args.args][:4] == ["self", "input_ids", "positions", "forward_batch"]
    # The patch's collector: 0.5.14's aux capture appends to a list.
    comm = _src(pkg14, "srt/layers/communicator.py")
    assert "captured_last_layer_outputs.append(gathered_last_layer_output)" in comm
    assert re.search(r"from sglang\.srt\.runtime_context import get_parallel", dsv2)
    assert "def get_parallel() -> ParallelContext:" in _src(pkg14, "srt/runtime_context.py")
    # The norm hooks: every layer's input norm is a module called with (hidden, residual)
    # and returns (normed, residual); DeepSeek and Qwen3 through the communicator, Llama
    # directly; its all-reduce fusion bypasses the module call, hence the flag we emit.
    assert "hidden_states, residual = self.input_layernorm(\n" in comm
    assert "hidden_states = self.input_layernorm(hidden_states)" in comm
    assert "self.input_layernorm.forward_with_allreduce_fusion(" in comm
    llama = _src(pkg14, "srt/models/llama.py")
    assert "hidden_states, residual = self.input_layernorm(hidden_states, residual)" in llama
    for name in ("llama.py", "qwen2.py", "deepseek_v2.py"):  # Qwen3Model is a Qwen2Model
        src = _src(pkg14, f"srt/models/{name}")
        assert "self.model = " in src and "self.norm = " in src and "self.embed_tokens = " in src
    assert "class Qwen3Model(Qwen2Model):" in _src(pkg14, "srt/models/qwen3.py")
    ln = _src(pkg14, "srt/layers/layernorm.py")
    assert "return x, residual" in ln
    sa = _src(pkg14, "srt/server_args.py")
    assert "enforce_disable_flashinfer_allreduce_fusion: A[" in sa
    assert "Auto-enabling FlashInfer AllReduce Fusion on SM90/SM10X for {model_arch}" in sa
    # --forward-hooks: spec keys, factory(config), plain register_forward_hook, after graphs.
    hm = _src(pkg14, "srt/model_executor/hook_manager.py")
    for key in ('"name"', '"target_modules"', '"hook_factory"', '"config"'):
        assert f"spec.get({key}" in hm
    assert "hook_factory(config)" in hm and "module.register_forward_hook(hook)" in hm
    mr = _src(pkg14, "srt/model_executor/model_runner.py")
    assert "Register forward hooks AFTER cuda-graph capture" in mr


# --- every release's source against its design; releases with no declaration ----------


def test_each_release_source_has_what_its_design_needs(release: str, release_pkg: Path) -> None:
    """The hooks attach to that release's real classes and call protocol, and every
    option of the command is declared there (compat.check, also what an undeclared
    release is held to)."""
    checks = compat.check(release_pkg, versions.get(release))
    assert len(checks) >= 30
    assert [str(c) for c in checks if not c.ok] == []


def test_reading_a_release_source_rebuilds_its_declaration(release: str, release_pkg: Path) -> None:
    """What infer() reads from a source (options layout, alignment, backend options,
    headroom, pins, design) is what each hand-written declaration says."""
    got = compat.infer(release_pkg, release)
    assert replace(got, notes=()) == replace(versions.get(release), notes=())


def test_an_undeclared_release_matching_a_design_runs_hooks(tmp_path: Path) -> None:
    newest = ensure_pinned_source("0.5.23") / "sglang"
    pkg = fake_release(newest, tmp_path)
    rel = compat.infer(pkg)
    assert rel.version == "0.5.24" and rel.hooks == "aux_capture"
    assert rel.args_classes == "_NS_PATH" and "0.5.23" in rel.notes[0]
    # The command built for it passes the flag check against its own source.
    cfg = read_config(PROD, {"capture": "hooks", "aux_layers": [2, 30, 58]})
    argv, _ = build_launch(cfg, dump_dir="/dev/shm/hs", port=31000, rel=rel)
    assert "--enable-return-aux-hidden-states" in check_argv(
        argv, declared_flags(pkg, rel), "0.5.24"
    )


def test_an_undeclared_release_falls_back_to_the_design_its_layers_fit(tmp_path: Path) -> None:
    """0.5.22's source under a new name: no aux-hidden-state option, so not 0.5.23's design,
    but its input norms fit the layernorm hooks."""
    pkg = fake_release(ensure_pinned_source("0.5.22") / "sglang", tmp_path)
    rel = compat.infer(pkg)
    assert rel.hooks == "layernorm"
    assert rel.hooks_tp_args == ("--enforce-disable-flashinfer-allreduce-fusion",)
    assert rel.deterministic_align == versions.get("0.5.22").deterministic_align


def test_an_undeclared_release_that_differs_is_refused_naming_what(tmp_path: Path) -> None:
    pkg = fake_release(ensure_pinned_source("0.5.23") / "sglang", tmp_path)
    fields = pkg / "srt/arg_groups/fields"
    (hit,) = [
        p for p in fields.glob("*.py") if re.search(r"^\s+forward_hooks:", p.read_text(), re.M)
    ]
    hit.write_text(
        re.sub(r"^(\s+)forward_hooks:", r"\1forward_hook_specs:", hit.read_text(), flags=re.M)
    )
    with pytest.raises(ConfigError) as e:
        compat.infer(pkg)
    msg = str(e.value)
    assert "SGLang 0.5.24 has no declaration" in msg and "nearest supported release, 0.5.23" in msg
    assert "option --forward-hooks" in msg and "option --model-path" not in msg
