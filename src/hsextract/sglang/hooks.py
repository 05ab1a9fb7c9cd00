"""Server-side capture for SGLang: the per-forward logic behind the patch and the hooks.

Two ways to make an SGLang server dump hidden states, both writing the same pieces through
``hsextract.capture`` (one dump protocol):

``capture: patch`` (default)
    ``patches/sglang-<version>`` adds three calls to ``DeepseekV2Model.forward``.  For the
    aux layers it passes a collector in the ``captured_last_layer_outputs`` slot that
    SGLang's EAGLE-3 capture uses, so the dump sees exactly the residual stream SGLang would
    hand a drafter (after any fused all-reduce), while the server's own
    ``layers_to_capture`` keeps working.  The collector speaks both protocols SGLang has
    had: ``append`` (0.5.14 - 0.5.20: a list, then a packer) and ``capture(hidden,
    owned=)`` (0.5.21 on).

``capture: hooks``
    No file modified; ``--forward-hooks`` names :func:`dump_hook_factory`.  Per release
    (``hsextract.sglang.versions``), one of two designs:

    ``layernorm`` (0.5.14 - 0.5.22): a hook on each aux layer's ``input_layernorm``, whose output
    ``(normed, residual)`` holds the residual stream entering the layer (for layer 0, which
    has no residual yet, its input is that stream); one on the final ``norm``; one on the
    inner ``model``, which runs last, sees ``(input_ids, positions, forward_batch)`` and
    writes; and one on ``embed_tokens``, which runs first and starts each forward clean.
    Works for any architecture whose layers call ``input_layernorm(hidden, residual)``
    (DeepSeek, Llama, Qwen3 ...).  A layer whose norm was not called (a fused
    all-reduce + norm kernel) fails the forward loudly instead of leaving a gap.

    ``aux_capture`` (0.5.23 on): SGLang's own aux capture (``--enable-return-aux-hidden-states
    --speculative-algorithm EAGLE3``, no draft loaded) and one hook on the inner ``model``,
    whose output is ``(final hidden, packed aux)``.

Both run only with CUDA graphs off (SGLang registers forward hooks after graph capture and
graph replay runs no Python), on TP rank 0, for EXTEND forwards.  This module is imported
inside the server process, so it uses only the standard library, torch and ``capture``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hsextract import faults
from hsextract.capture import AUX_LAYERS_ENV, DumpWriter, get_writer
from hsextract.convention import default_aux_layers, prenorm_layer

#: The inner model (``DeepseekV2Model``, ``LlamaModel`` ...) is ``self.model`` of the
#: ``*ForCausalLM``; its final norm is ``model.norm``, layer i's ``model.layers.i``.
HOOK_TARGET_MODULE = "model"
HOOK_FACTORY_PATH = "hsextract.sglang.hooks:dump_hook_factory"


def _dumping_forward(forward_batch: Any, tp_rank: int, model: Any) -> bool:
    # TARGET_VERIFY counts as extend in SGLang but is speculative verification, not prefill.
    mode = forward_batch.forward_mode
    if not mode.is_extend() or mode.is_target_verify():
        return False
    # Rank 0 of the TP group holds the full, replicated residual stream; only the last
    # pipeline stage has the final norm.
    pp = getattr(model, "pp_group", None)
    return tp_rank == 0 and (pp is None or bool(pp.is_last_rank))


class _Collector:
    """Stands in SGLang's ``captured_last_layer_outputs`` slot for one aux layer."""

    def __init__(self, own: Any) -> None:
        self.own = own
        self.value: torch.Tensor | None = None

    def capture(self, hidden: torch.Tensor, *, owned: bool = False) -> None:
        """The packer protocol of 0.5.21 on.  SGLang's collector gets exactly what it would
        have."""
        if self.own is not None:
            self.own.capture(hidden, owned=owned)
        # A borrowed value is the live residual buffer, which later layers overwrite.
        self.value = hidden if owned else hidden.clone()

    def append(self, hidden: torch.Tensor) -> None:
        """The protocol of 0.5.14 - 0.5.20: SGLang appends a tensor it keeps as it is (its
        own aux capture relies on that), cloned by its communicator where it would be
        reused (no ``copies_on_append`` here, so 0.5.17's communicator clones too)."""
        if self.own is not None:
            self.own.append(hidden)
        self.value = hidden


class ForwardDump:
    """One EXTEND forward on the dumping rank: collect the aux layers, then write once.

    Aux index ``prenorm_index`` (L, when asked for: ``prenorm_final``) is the stream after
    the last layer, before the final norm; the patch hands it over through :meth:`prenorm`
    (0.5.14 - 0.5.20) or :meth:`prenorm_capture` (the final-norm capture callback of 0.5.21
    on).
    """

    def __init__(
        self, writer: DumpWriter, layers: Sequence[int], prenorm_index: int | None = None
    ) -> None:
        self.writer = writer
        self.layers = list(layers)
        self.collectors: dict[int, _Collector] = {}
        self.prenorm_index = prenorm_index if prenorm_index in self.layers else None
        self.prenorm_value: torch.Tensor | None = None

    def prenorm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Before ``norm(hidden, residual)``: its fused add is ``hidden + residual``, one
        rounding of the exact sum, which a separate add reproduces bit for bit."""
        if self.prenorm_index is not None:
            self.prenorm_value = hidden.clone() if residual is None else hidden + residual

    def prenorm_capture(self) -> Callable[[torch.Tensor], None] | None:
        """The capture callback of ``residual_batch.norm`` / ``final_norm`` (0.5.21 on): it
        hands over the updated residual, borrowed (so it is copied)."""
        if self.prenorm_index is None:
            return None

        def take(residual: torch.Tensor) -> None:
            self.prenorm_value = residual.clone()

        return take

    def collector(self, layer_id: int, own: Any) -> Any:
        """What to pass as ``captured_last_layer_outputs`` of layer ``layer_id``."""
        if layer_id not in self.layers:
            return own
        c = self.collectors[layer_id] = _Collector(own)
        return c

    def write(
        self,
        forward_batch: Any,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        aux: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Hand the batch to the dump writer; ``aux`` defaults to what the collectors got."""
        if aux is None:
            got = {i: getattr(c, "value", None) for i, c in self.collectors.items()}
            if self.prenorm_index is not None:
                got[self.prenorm_index] = self.prenorm_value
            missing = [i for i in self.layers if got.get(i) is None]
            if missing:
                # Loud, not a silent gap the client would wait on forever: layers run through
                # two-batch overlap's stage path never see a collector.
                raise RuntimeError(f"hsextract: aux layers {missing} were not captured")
            aux = [got[i] for i in self.layers]  # type: ignore[misc]
        prefix, extend = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
        if prefix is None or extend is None:
            raise RuntimeError("hsextract: batch has no host-side extend lens (GPU-only metadata)")
        if faults.ACTIVE:  # tests only: a capture that is wrong (the live audit must catch it)
            hidden, aux = faults.captured_batch(forward_batch.rids, extend, hidden, list(aux))
        self.writer.write_batch(
            forward_batch.rids, prefix, extend, input_ids, hidden, aux, aux_layers=self.layers
        )


def _layers_for(writer: DumpWriter, num_hidden_layers: int) -> list[int]:
    layers = writer.aux_layers
    return list(layers) if layers is not None else default_aux_layers(num_hidden_layers)


def begin_forward(model: Any, forward_batch: Any, *, tp_rank: int) -> ForwardDump | None:
    """Called by the patched ``DeepseekV2Model.forward``; None means: change nothing."""
    if not _dumping_forward(forward_batch, tp_rank, model):
        return None
    writer = get_writer()
    if writer is None:
        return None
    n_layers = int(model.config.num_hidden_layers)
    layers = _layers_for(writer, n_layers)
    # Index L (before the final norm) is taken after the loop, on the stage that ends it.
    bad = [
        i
        for i in layers
        if not (model.start_layer <= i < model.end_layer or i == n_layers == model.end_layer)
    ]
    if bad:
        raise ValueError(
            f"hsextract: aux layers {bad} outside layers [{model.start_layer}, {model.end_layer})"
        )
    return ForwardDump(writer, layers, prenorm_layer(n_layers))


# --------------------------------------------------------------------------- hooks: layernorm


class _Stash:
    """What the norm hooks of the forward under way captured (one forward at a time runs
    in a server process's model thread)."""

    def __init__(self) -> None:
        self.aux: dict[int, torch.Tensor] = {}
        self.final: torch.Tensor | None = None
        self.prenorm: torch.Tensor | None = None

    def clear(self) -> None:
        self.aux.clear()
        self.final = None
        self.prenorm = None


_STASH = _Stash()


def _aux_hook(layer: int, tp_rank: Callable[[], int]) -> Callable[..., None]:
    def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
        if tp_rank() != 0:
            return  # only rank 0 writes: no copy to make
        # (normed, residual): the residual, updated in place by the fused add + norm, is the
        # stream entering the layer.  Layer 0 has no residual yet: its input is the stream.
        stream = output[1] if isinstance(output, tuple) and len(output) > 1 else args[0]
        # A copy: the next layer's fused add updates this very buffer in place.
        _STASH.aux[layer] = stream.detach().clone()

    return hook


def _begin_hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
    # On the embedding, the first module of every forward: whatever a forward that failed
    # half-way left behind must not stand in for a norm this forward does not call.
    _STASH.clear()


def _final_hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
    _STASH.final = output[0] if isinstance(output, tuple) else output


def _prenorm_hook(tp_rank: Callable[[], int]) -> Callable[..., None]:
    """On the final norm, for aux index L: its fused add's updated residual (the stream
    before the norm), or its input when it was called without a residual."""

    def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
        if tp_rank() != 0:
            return
        stream = output[1] if isinstance(output, tuple) and len(output) > 1 else args[0]
        _STASH.prenorm = stream.detach().clone()

    return hook


def _write_hook(
    config: dict[str, Any], tp_rank: Callable[[], int]
) -> Callable[[Any, tuple[Any, ...], Any], None]:
    layers = list(config["aux_layers"])
    dump_dir = config.get("dump_dir")
    prenorm = config.get("prenorm_layer")

    def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
        try:
            if len(args) < 3:
                raise RuntimeError(
                    "hsextract hook: expected (input_ids, positions, forward_batch, ...)"
                )
            input_ids, forward_batch = args[0], args[2]
            if not _dumping_forward(forward_batch, tp_rank(), module):
                return
            writer = get_writer(dump_dir, layers)
            if writer is None:
                return
            got = dict(_STASH.aux)
            if prenorm is not None and _STASH.prenorm is not None:
                got[prenorm] = _STASH.prenorm
            missing = [i for i in layers if i not in got]
            if missing or _STASH.final is None:
                raise RuntimeError(
                    f"hsextract hook: this forward never called the input_layernorm of aux "
                    f"layers {missing} (or the final norm: {_STASH.final is None}); a fused "
                    "all-reduce + norm kernel bypasses them: disable it, or use capture: patch"
                )
            n = int(input_ids.shape[0])
            rows = {_STASH.final.shape[0], *(got[i].shape[0] for i in layers)}
            if rows != {n}:
                raise RuntimeError(f"hsextract hook: captured rows {rows} for {n} tokens")
            aux = [got[i] for i in layers]
            ForwardDump(writer, layers).write(forward_batch, input_ids, _STASH.final, aux)
        finally:
            _STASH.clear()  # decode passes too: nothing of one forward leaks into the next

    return hook


# --------------------------------------------------------------------------- hooks: aux_capture


def make_dump_hook(config: dict[str, Any], *, tp_rank: Callable[[], int]) -> Callable[..., None]:
    """The ``aux_capture`` hook on the inner model; ``tp_rank`` injectable for tests.

    ``config`` may hold ``aux_layers`` (list); else ``HSEXTRACT_AUX_LAYERS`` or the EAGLE-3
    default.  The hook checks them against the model's ``layers_to_capture`` on every call, so
    a server launched with other capture layers fails instead of mislabelling data.
    """
    configured = config.get("aux_layers")
    dump_dir = config.get("dump_dir")
    prenorm = config.get("prenorm_layer")  # index L: taken by the final norm's hook

    def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
        try:
            if len(args) < 3:
                raise RuntimeError(
                    "hsextract hook: expected (input_ids, positions, forward_batch, ...)"
                )
            input_ids, forward_batch = args[0], args[2]
            if not _dumping_forward(forward_batch, tp_rank(), module):
                return None
            writer = get_writer(dump_dir, configured)
            if writer is None:
                return None
            layers = (
                list(configured)
                if configured is not None
                else _layers_for(writer, int(module.config.num_hidden_layers))
            )
            sglang_layers = [i for i in layers if i != prenorm]
            if list(module.layers_to_capture) != sglang_layers or not isinstance(output, tuple):
                raise RuntimeError(
                    f"hsextract hook: server captures layers {list(module.layers_to_capture)},"
                    f" the dump needs {sglang_layers}; launch with "
                    "--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 and the "
                    "matching layer ids"
                )
            hidden, packed = output
            # packed is [T, k*H] in layer order
            aux = list(packed.chunk(len(sglang_layers), dim=-1))
            if prenorm is not None:
                if _STASH.prenorm is None:
                    raise RuntimeError("hsextract hook: the final norm's hook saw no stream")
                aux.append(_STASH.prenorm)
            ForwardDump(writer, layers).write(forward_batch, input_ids, hidden, aux)
            return None  # never replace the model's output
        finally:
            _STASH.clear()

    return hook


# --------------------------------------------------------------------------- entry point


def make_hook(config: dict[str, Any], *, tp_rank: Callable[[], int]) -> Callable[..., None]:
    """The hook one ``--forward-hooks`` spec asks for (see :func:`forward_hooks_spec`)."""
    role = config.get("role", "aux_capture")
    if role == "begin":
        return _begin_hook
    if role == "aux":
        return _aux_hook(int(config["layer"]), tp_rank)
    if role == "final":
        return _final_hook
    if role == "prenorm":
        return _prenorm_hook(tp_rank)
    if role == "write":
        return _write_hook(config, tp_rank)
    if role == "aux_capture":
        return make_dump_hook(config, tp_rank=tp_rank)
    raise ValueError(f"hsextract hook: unknown role {role!r}")


def dump_hook_factory(config: dict[str, Any]) -> Callable[..., None]:
    """Entry point named in ``--forward-hooks`` (SGLang calls ``factory(spec["config"])``)."""
    from sglang.srt.runtime_context import get_parallel  # only inside an SGLang server

    return make_hook(config, tp_rank=lambda: int(get_parallel().tp_rank))


def forward_hooks_spec(
    design: str,
    aux_layers: Sequence[int] | None,
    dump_dir: str | None = None,
    prenorm_index: int | None = None,
) -> str:
    """The ``--forward-hooks`` JSON value (SGLang's spec keys: name, target_modules, ...).

    ``layernorm`` needs the aux layers by number (from the config or the model's
    config.json, see ``launch``).  The writer hooks the inner model, so it runs after the
    forward, when every norm of the pass has been called.  With ``prenorm_index`` (L, in
    ``aux_layers``: ``prenorm_final``) a hook on the final norm takes the stream before it.
    """

    def spec(name: str, target: str, **config: Any) -> dict[str, Any]:
        return {
            "name": f"hsextract-{name}",
            "target_modules": [target],
            "hook_factory": HOOK_FACTORY_PATH,
            "config": {**config, "dump_dir": dump_dir},
        }

    final_norm = f"{HOOK_TARGET_MODULE}.norm"
    prenorm = (
        [spec("prenorm", final_norm, role="prenorm")]
        if prenorm_index is not None and aux_layers is not None and prenorm_index in aux_layers
        else []
    )
    pn = {"prenorm_layer": prenorm_index} if prenorm else {}
    if design == "aux_capture":
        layers = list(aux_layers) if aux_layers is not None else None
        specs = [
            *prenorm,
            spec("dump", HOOK_TARGET_MODULE, role="aux_capture", aux_layers=layers, **pn),
        ]
    elif design == "layernorm":
        if aux_layers is None:
            raise ValueError("hooks design 'layernorm' needs the aux layers by number")
        specs = [spec("begin", f"{HOOK_TARGET_MODULE}.embed_tokens", role="begin")]
        norm = f"{HOOK_TARGET_MODULE}.layers.{{}}.input_layernorm"
        specs += [
            spec(f"aux-{i}", norm.format(i), role="aux", layer=i)
            for i in aux_layers
            if i != prenorm_index
        ]
        specs.append(spec("final", final_norm, role="final"))
        specs += prenorm
        specs.append(
            spec("write", HOOK_TARGET_MODULE, role="write", aux_layers=list(aux_layers), **pn)
        )
    else:
        raise ValueError(f"unknown hooks design {design!r}")
    return json.dumps(specs, separators=(",", ":"))


__all__ = [
    "AUX_LAYERS_ENV",
    "ForwardDump",
    "begin_forward",
    "dump_hook_factory",
    "forward_hooks_spec",
    "make_dump_hook",
    "make_hook",
]
