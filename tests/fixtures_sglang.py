"""The source of every supported SGLang release, and harnesses that run its real code.

The sources are downloaded once (``pip download``) into ``$HSEXTRACT_CACHE`` (default
``~/.cache/hsextract``; CI caches that dir).  Nothing here is a copy of SGLang: the
harnesses pull ``DeepseekV2Model.forward`` (pristine or patched), ``ForwardMode``,
``AuxHiddenStatePacker`` and ``register_forward_hooks`` out of the real files and run them
with small stand-ins for the parts that need GPUs and a distributed runtime.  Releases
call their layers in one of two layouts (:func:`layout`): the residual passed through the
layers (0.5.14 - 0.5.20, :class:`StandInModel14`) or kept by ``residual_batch`` (0.5.21 on,
:class:`StandInModel`); ``release``-parametrised fixtures run a test for every release.
"""

from __future__ import annotations
import __future__

import ast
import importlib.util
import shutil
import textwrap
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from enum import IntEnum, auto
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from hsextract.sglang import versions
from hsextract.sglang.patching import (
    apply_unified_diff,
    ensure_pinned_source,
    installed_version,
    load_spec,
)

DSV2 = "srt/models/deepseek_v2.py"
RELEASES = list(versions.known())


@pytest.fixture(scope="session", params=RELEASES)
def release(request: pytest.FixtureRequest) -> str:
    """Each supported SGLang release in turn."""
    return request.param


@pytest.fixture(
    scope="session", params=[v for v, r in versions.known().items() if r.hooks == "layernorm"]
)
def norm_release(request: pytest.FixtureRequest) -> str:
    """Each release whose ``capture: hooks`` hooks the input norms."""
    return request.param


@pytest.fixture(
    scope="session", params=[v for v, r in versions.known().items() if r.hooks == "aux_capture"]
)
def aux_release(request: pytest.FixtureRequest) -> str:
    """Each release whose ``capture: hooks`` uses SGLang's own aux capture."""
    return request.param


@pytest.fixture(scope="session")
def release_pkg(release: str) -> Path:
    """That release's ``sglang`` package dir (read only: never modify)."""
    return ensure_pinned_source(release) / "sglang"


@pytest.fixture(scope="session")
def sglang_src() -> Path:
    """The directory holding the 0.5.23 ``sglang/`` source (read only: never modify)."""
    return ensure_pinned_source("0.5.23")


@pytest.fixture(scope="session")
def sglang_pkg(sglang_src: Path) -> Path:
    """The 0.5.23 ``sglang`` package dir (what ``--sglang-root`` names)."""
    return sglang_src / "sglang"


@pytest.fixture(scope="session")
def pkg14() -> Path:
    """The 0.5.14 ``sglang`` package dir (read only)."""
    return ensure_pinned_source("0.5.14") / "sglang"


def fake_release(src_pkg: Path, tmp_path: Path, version: str = "0.5.24") -> Path:
    """A copy of a real release's extracted source that calls itself ``version`` (a
    release hsextract has no declaration for)."""
    pkg = tmp_path / "site-packages" / "sglang"
    shutil.copytree(src_pkg, pkg)
    v = pkg / "_version.py"
    v.write_text(v.read_text().replace(installed_version(pkg), version))
    return pkg


def _node(tree: ast.Module, *path: str) -> ast.AST:
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for name in path:
        node = next(
            n for n in body if isinstance(n, ast.ClassDef | ast.FunctionDef) and n.name == name
        )
        body = node.body  # type: ignore[union-attr]
    assert node is not None
    return node


def exec_defs(text: str, defs: list[tuple[str, ...]], globs: dict[str, Any]) -> dict[str, Any]:
    """Exec the named (nested) defs of a source file into ``globs``; like the real module,
    with postponed annotations."""
    tree = ast.parse(text)
    for path in defs:
        node = _node(tree, *path)
        seg = ast.get_source_segment(text, node)
        assert seg is not None
        src = textwrap.dedent(" " * node.col_offset + seg)  # type: ignore[attr-defined]
        flags = __future__.annotations.compiler_flag
        exec(
            compile(src, f"<sglang {'.'.join(path)}>", "exec", flags=flags, dont_inherit=True),
            globs,
        )
    return globs


def load_file_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass
class Harness:
    """Runs SGLang's ``DeepseekV2Model.forward`` on a tiny stand-in model."""

    forward: Callable[..., Any]  # the real (pristine or patched) function
    ForwardMode: type
    globs: dict[str, Any]
    tp_rank: list[int] = field(default_factory=lambda: [0])


def _stream(forward_batch: Any) -> Any:
    return forward_batch.residual_stream


def _final_norm(h: Any, fb: Any, norm: Any, capture: Any = None) -> Any:
    """residual_batch.final_norm (0.5.22 on; ``norm(..., capture_output=)`` in 0.5.21): the
    fused add + norm of the last layer's output into the stream, the updated stream handed
    to ``capture`` borrowed."""
    h, residual = norm(h, _stream(fb).residual)
    if capture is not None:
        capture(residual)
    return h


def _stand_in_globals(pkg: Path, tp_rank: list[int]) -> dict[str, Any]:
    aux_mod = load_file_module(pkg / "srt/layers/aux_hidden_states.py", "_pinned_aux_hidden_states")

    def not_expected(*a: Any, **k: Any) -> Any:
        raise AssertionError("path not expected in these tests (TBO / pipeline parallel)")

    class IndexTopKShareState:
        def __init__(self, forward_batch: Any, initial: Any) -> None:
            self.topk_indices = initial

        def update(self, topk: Any) -> None:
            self.topk_indices = topk

    residual_batch = SimpleNamespace(
        start=lambda fb: setattr(fb, "residual_stream", SimpleNamespace(residual=None)),
        complete_output=lambda h, fb: h,
        final_norm=_final_norm,
        norm=lambda h, fb, norm, capture_output=None: _final_norm(h, fb, norm, capture_output),
        to_pp=not_expected,
    )
    recorder = SimpleNamespace(with_current_layer=lambda i: nullcontext())
    return {
        "torch": torch,
        "nullcontext": nullcontext,
        "residual_batch": residual_batch,
        "IndexTopKShareState": IndexTopKShareState,
        "BumpAllocator": lambda **k: None,
        "check_cuda_graph_backend": lambda *a: False,
        "Phase": SimpleNamespace(PREFILL="prefill"),
        "Backend": SimpleNamespace(TC_PIECEWISE="tc_piecewise"),
        "get_global_expert_distribution_recorder": lambda: recorder,
        "AuxHiddenStatePacker": aux_mod.AuxHiddenStatePacker,  # the real one
        "model_forward_stages": not_expected,
        "dsa_layer_skips_topk": not_expected,
        "get_dsa_index_topk": not_expected,
        "_get_llama_4_scaling": not_expected,
        # The TP-rank function: SGLang's get_parallel().tp_rank.
        "get_parallel": lambda: SimpleNamespace(tp_rank=tp_rank[0]),
    }


def _forward_mode(pkg: Path) -> type:
    g = exec_defs(
        (pkg / "srt/model_executor/forward_batch_info.py").read_text(),
        [("ForwardMode",)],
        {"IntEnum": IntEnum, "auto": auto},
    )
    return g["ForwardMode"]


def layout(pkg: Path) -> str:
    """``residual`` when the release's decoder layers take and return the residual
    (0.5.14 - 0.5.20), ``stream`` when ``residual_batch`` keeps it (0.5.21 on)."""
    tree = ast.parse((pkg / DSV2).read_text())
    fwd = _node(tree, "DeepseekV2DecoderLayer", "forward")
    return "residual" if "residual" in [a.arg for a in fwd.args.args] else "stream"  # type: ignore[attr-defined]


def harness(pkg: Path, release: str, patched: bool) -> Harness:
    """SGLang's DeepseekV2Model.forward of ``release`` (pristine or patched), on stand-ins."""
    text = (pkg / DSV2).read_text()
    defs: list[tuple[str, ...]] = [("DeepseekV2Model", "forward")]
    tp_rank = [0]
    stream = layout(pkg) == "stream"
    if patched:
        text = apply_unified_diff(text, load_spec(release).diff.read_text())
        defs += [("_hs_dump_begin",), ("_hs_dump_collector",), ("_hs_dump_write",)]
        defs += [("_hs_dump_prenorm_capture",) if stream else ("_hs_dump_prenorm",)]
    base = _stand_in_globals(pkg, tp_rank) if stream else _stand_in_globals_14(pkg, tp_rank)
    globs = exec_defs(text, defs, base)
    return Harness(globs["forward"], _forward_mode(pkg), globs, tp_rank)


def stand_in_model(pkg: Path) -> type:
    """The stand-in model class for the release's layout."""
    return StandInModel if layout(pkg) == "stream" else StandInModel14


@pytest.fixture(scope="session")
def release_forwards(release: str, release_pkg: Path) -> SimpleNamespace:
    """The release's patched and pristine forward and its stand-in model class."""
    return SimpleNamespace(
        patched=harness(release_pkg, release, patched=True),
        pristine=harness(release_pkg, release, patched=False),
        Model=stand_in_model(release_pkg),
    )


# --- the norms and layers of both layouts ------------------------------------------------


class StandInRMSNorm(nn.Module):
    """Called like SGLang's RMSNorm, with sgl_kernel's in-place fused add: with a residual,
    the residual becomes input + residual and the input its normalised value, both in
    place, and both are returned."""

    def __init__(self, hidden: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.rand(hidden, generator=g) + 0.5

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        x.copy_(self._norm(residual))
        return x, residual


class StandInLayer14(nn.Module):
    """Shaped like DeepseekV2DecoderLayer of 0.5.14 - 0.5.20: the residual comes in and goes
    out, the input norm is a module called as the communicator calls it, and SGLang's aux
    capture appends (a copy of) the stream entering the layer to what it is given (a list,
    or 0.5.17's packer)."""

    def __init__(self, layer_id: int, hidden: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(100 + layer_id)
        self.w = torch.randn(hidden, hidden, generator=g) / hidden**0.5
        self.input_layernorm = StandInRMSNorm(hidden, 200 + layer_id)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: Any,
        residual: torch.Tensor | None,
        zero_allocator: Any = None,
        gemm_output_zero_allocator: Any = None,
        llama_4_scaling: Any = None,
        prev_topk_indices: Any = None,
        captured_last_layer_outputs: Any = None,
        next_full_attention_layer_id: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if captured_last_layer_outputs is not None:
            captured_last_layer_outputs.append(residual.clone())  # as its communicator does
        out = torch.tanh(hidden_states @ self.w) + 0.01 * positions[:, None]
        return out, residual, None


class StandInModel14(nn.Module):
    """The attributes DeepseekV2Model.forward of 0.5.14 - 0.5.20 reads, on a few tiny
    layers; real submodules (``layers.N.input_layernorm``, ``norm``) for the forward hooks."""

    def __init__(self, num_layers: int = 8, hidden: int = 8, vocab: int = 64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed_tokens = nn.Embedding(vocab, hidden)  # a module, as in SGLang
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(vocab, hidden, generator=g))
        self.norm = StandInRMSNorm(hidden, 7)
        self.config = SimpleNamespace(num_hidden_layers=num_layers)
        self.start_layer, self.end_layer = 0, num_layers
        self.layers = nn.ModuleList(StandInLayer14(i, hidden) for i in range(num_layers))
        self.layers_to_capture: list[int] = []
        self.next_full_attention_layer_id: dict[int, int] = {}
        self.pp_group = SimpleNamespace(is_first_rank=True, is_last_rank=True)
        self.use_dsa = False
        self.dsa_enable_prefill_cp = self.mla_enable_prefill_cp = False
        self.first_k_dense_replace = 1
        self.gemm_output_zero_allocator_size = 0
        self.llama_4_scaling_config = None

    def _dsa_forward_uses_topk(self) -> bool:
        return False

    @torch.no_grad()
    def reference(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Plain per-request computation: final post-norm state and the stream entering
        every layer (hidden + residual), for one whole request starting at position 0."""
        h, residual = self.embed_tokens(ids), None
        pos = torch.arange(ids.shape[0])
        entering = []
        for layer in self.layers:
            entering.append((h if residual is None else h + residual).clone())
            h, residual, _ = layer(pos, h, None, residual)
        entering.append((h + residual).clone())  # [L]: the stream before the final norm
        return self.norm._norm(h + residual), entering


def _stand_in_globals_14(pkg: Path, tp_rank: list[int]) -> dict[str, Any]:
    def not_expected(*a: Any, **k: Any) -> Any:
        raise AssertionError("path not expected in these tests (TBO / PP / context parallel)")

    recorder = SimpleNamespace(with_current_layer=lambda i: nullcontext())
    aux_file = pkg / "srt/layers/aux_hidden_states.py"  # 0.5.17 on: the packer

    class IndexTopKShareState:  # 0.5.18 on
        def __init__(self, forward_batch: Any, initial: Any) -> None:
            self.topk_indices = initial

        def update(self, topk: Any) -> None:
            self.topk_indices = topk

    return {
        "torch": torch,
        "nullcontext": nullcontext,
        "BumpAllocator": lambda **k: None,
        "check_cuda_graph_backend": lambda *a: False,
        "Phase": SimpleNamespace(PREFILL="prefill"),
        "Backend": SimpleNamespace(TC_PIECEWISE="tc_piecewise"),
        "get_global_expert_distribution_recorder": lambda: recorder,
        "dsa_use_prefill_cp": lambda fb, flag: False,
        "mla_use_prefill_cp": lambda fb, flag: False,
        "cp_split_and_rebuild_data": not_expected,
        "cp_split_and_rebuild_position": not_expected,
        "cp_all_gather_rerange_output": not_expected,
        "model_forward_maybe_tbo": not_expected,
        "PPProxyTensors": not_expected,
        "dsa_layer_skips_topk": not_expected,
        "get_dsa_index_topk": not_expected,
        "_get_llama_4_scaling": not_expected,
        "is_cp_v2_active": lambda fb: False,  # 0.5.16 - 0.5.19
        "IndexTopKShareState": IndexTopKShareState,
        **(
            {"AuxHiddenStatePacker": load_file_module(aux_file, "_aux14").AuxHiddenStatePacker}
            if aux_file.is_file()
            else {}
        ),
        "get_parallel": lambda: SimpleNamespace(tp_rank=tp_rank[0]),
    }


class StandInLayer(nn.Module):
    """Shaped like DeepseekV2DecoderLayer of 0.5.21 on: the residual lives in
    ``forward_batch.residual_stream``; the input norm is a module called as
    ``norm(hidden, residual)`` (fused add, in place) or ``norm(hidden)`` on entry, whose
    residual is the input; SGLang's aux capture gets the updated stream *borrowed*
    (``capture(residual)``) -- the buffer the next layer's fused add overwrites, so a
    collector that does not copy would be wrong."""

    def __init__(self, layer_id: int, hidden: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(100 + layer_id)
        self.w = torch.randn(hidden, hidden, generator=g) / hidden**0.5
        self.input_layernorm = StandInRMSNorm(hidden, 200 + layer_id)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: Any,
        zero_allocator: Any = None,
        gemm_output_zero_allocator: Any = None,
        llama_4_scaling: Any = None,
        prev_topk_indices: Any = None,
        captured_last_layer_outputs: Any = None,
        next_full_attention_layer_id: Any = None,
    ) -> tuple[torch.Tensor, None]:
        stream = _stream(forward_batch)
        if stream.residual is None:
            h, stream.residual = self.input_layernorm(hidden_states), hidden_states
        else:
            h, stream.residual = self.input_layernorm(hidden_states, stream.residual)
        if captured_last_layer_outputs is not None:
            captured_last_layer_outputs.capture(stream.residual)  # borrowed, like SGLang's
        return torch.tanh(h @ self.w) + 0.01 * positions[:, None], None


class StandInModel(StandInModel14):
    """The attributes DeepseekV2Model.forward of 0.5.21 on reads, on StandInLayers."""

    def __init__(self, num_layers: int = 8, hidden: int = 8, vocab: int = 64) -> None:
        super().__init__(num_layers, hidden, vocab)
        self.layers = nn.ModuleList(StandInLayer(i, hidden) for i in range(num_layers))

    @torch.no_grad()
    def reference(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Plain per-request computation, as :meth:`StandInModel14.reference`."""
        fb = SimpleNamespace(residual_stream=SimpleNamespace(residual=None))
        h = self.embed_tokens(ids)
        pos = torch.arange(ids.shape[0])
        entering = []
        for layer in self.layers:
            r = fb.residual_stream.residual
            entering.append((h if r is None else h + r).clone())
            h, _ = layer(pos, h, fb)
        entering.append((h + fb.residual_stream.residual).clone())  # [L]: before the norm
        return self.norm._norm(h + fb.residual_stream.residual), entering
