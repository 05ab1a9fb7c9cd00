"""Server-side capture for SGLang: the per-forward logic behind the patch and the hooks.

Two ways to make an SGLang server dump hidden states, both writing the same pieces through
``hsextract.capture`` (one dump protocol):

``capture: patch`` (default)
    ``patches/sglang-<version>`` adds three calls to ``DeepseekV2Model.forward``.  For the
    aux layers it passes a collector in the ``captured_last_layer_outputs`` slot that
    SGLang's EAGLE-3 capture uses, so the dump sees exactly the residual stream SGLang would
    hand a drafter (after any fused all-reduce), while the server's own
    ``layers_to_capture`` keeps working.  The collector speaks both releases' protocols:
    0.5.14 appends to a list (``append``), 0.5.23 packs (``capture(hidden, owned=)``).

``capture: hooks``
    No file modified; ``--forward-hooks`` names :func:`dump_hook_factory`.  Per release
    (``hsextract.sglang.versions``), one of two designs:

    ``layernorm`` (0.5.14): a hook on each aux layer's ``input_layernorm``, whose output
    ``(normed, residual)`` holds the residual stream entering the layer (for layer 0, which
    has no residual yet, its input is that stream); one on the final ``norm``; one on the
    inner ``model``, which runs last, sees ``(input_ids, positions, forward_batch)`` and
    writes; and one on ``embed_tokens``, which runs first and starts each forward clean.
    Works for any architecture whose layers call ``input_layernorm(hidden, residual)``
    (DeepSeek, Llama, Qwen3 ...).  A layer whose norm was not called (a fused
    all-reduce + norm kernel) fails the forward loudly instead of leaving a gap.

    ``aux_capture`` (0.5.23): SGLang's own aux capture (``--enable-return-aux-hidden-states
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

from hsextract.capture import AUX_LAYERS_ENV, DumpWriter, get_writer
from hsextract.convention import default_aux_layers

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
        """0.5.23's packer protocol.  SGLang's collector gets exactly what it would have."""
        if self.own is not None:
            self.own.capture(hidden, owned=owned)
        # A borrowed value is the live residual buffer, which later layers overwrite.
        self.value = hidden if owned else hidden.clone()

    def append(self, hidden: torch.Tensor) -> None:
        """0.5.14's list protocol: SGLang appends a tensor it keeps as it is (its own aux
        capture relies on that), cloned by its communicator where it would be reused."""
        if self.own is not None:
            self.own.append(hidden)
        self.value = hidden


class ForwardDump:
    """One EXTEND forward on the dumping rank: collect the aux layers, then write once."""

    def __init__(self, writer: DumpWriter, layers: Sequence[int]) -> None:
        self.writer = writer
        self.layers = list(layers)
        self.collectors: dict[int, _Collector] = {}

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
            missing = [
                i for i in self.layers if getattr(self.collectors.get(i), "value", None) is None
            ]
            if missing:
                # Loud, not a silent gap the client would wait on forever: layers run through
                # two-batch overlap's stage path never see a collector.
                raise RuntimeError(f"hsextract: aux layers {missing} were not captured")
            aux = [self.collectors[i].value for i in self.layers]  # type: ignore[misc]
        prefix, extend = forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu
        if prefix is None or extend is None:
            raise RuntimeError("hsextract: batch has no host-side extend lens (GPU-only metadata)")
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
    layers = _layers_for(writer, int(model.config.num_hidden_layers))
    bad = [i for i in layers if not model.start_layer <= i < model.end_layer]
    if bad:
        raise ValueError(
            f"hsextract: aux layers {bad} outside layers [{model.start_layer}, {model.end_layer})"
        )
    return ForwardDump(writer, layers)


# --------------------------------------------------------------------------- hooks: layernorm


class _Stash:
    """What the norm hooks of the forward under way captured (one forward at a time runs
    in a server process's model thread)."""

    def __init__(self) -> None:
        self.aux: dict[int, torch.Tensor] = {}
        self.final: torch.Tensor | None = None

    def clear(self) -> None:
        self.aux.clear()
        self.final = None


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


def _write_hook(
    config: dict[str, Any], tp_rank: Callable[[], int]
) -> Callable[[Any, tuple[Any, ...], Any], None]:
    layers = list(config["aux_layers"])
    dump_dir = config.get("dump_dir")

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
            missing = [i for i in layers if i not in _STASH.aux]
            if missing or _STASH.final is None:
                raise RuntimeError(
                    f"hsextract hook: this forward never called the input_layernorm of aux "
                    f"layers {missing} (or the final norm: {_STASH.final is None}); a fused "
                    "all-reduce + norm kernel bypasses them: disable it, or use capture: patch"
                )
            n = int(input_ids.shape[0])
            rows = {_STASH.final.shape[0], *(_STASH.aux[i].shape[0] for i in layers)}
            if rows != {n}:
                raise RuntimeError(f"hsextract hook: captured rows {rows} for {n} tokens")
            aux = [_STASH.aux[i] for i in layers]
            ForwardDump(writer, layers).write(forward_batch, input_ids, _STASH.final, aux)
        finally:
            _STASH.clear()  # decode passes too: nothing of one forward leaks into the next

    return hook


# --------------------------------------------------------------------------- hooks: aux_capture


def make_dump_hook(config: dict[str, Any], *, tp_rank: Callable[[], int]) -> Callable[..., None]:
    """The ``aux_capture`` hook on the inner model (0.5.23); ``tp_rank`` injectable for tests.

    ``config`` may hold ``aux_layers`` (list); else ``HSEXTRACT_AUX_LAYERS`` or the EAGLE-3
    default.  The hook checks them against the model's ``layers_to_capture`` on every call, so
    a server launched with other capture layers fails instead of mislabelling data.
    """
    configured = config.get("aux_layers")
    dump_dir = config.get("dump_dir")

    def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
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
        if list(module.layers_to_capture) != layers or not isinstance(output, tuple):
            raise RuntimeError(
                f"hsextract hook: server captures layers {list(module.layers_to_capture)}, "
                f"the dump needs {layers}; launch with --enable-return-aux-hidden-states "
                "--speculative-algorithm EAGLE3 and the matching layer ids"
            )
        hidden, packed = output
        aux = list(packed.chunk(len(layers), dim=-1))  # packed is [T, k*H] in layer order
        ForwardDump(writer, layers).write(forward_batch, input_ids, hidden, aux)
        return None  # never replace the model's output

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
    design: str, aux_layers: Sequence[int] | None, dump_dir: str | None = None
) -> str:
    """The ``--forward-hooks`` JSON value (SGLang's spec keys: name, target_modules, ...).

    ``layernorm`` needs the aux layers by number (from the config or the model's
    config.json, see ``launch``).  The writer hooks the inner model, so it runs after the
    forward, when every norm of the pass has been called.
    """

    def spec(name: str, target: str, **config: Any) -> dict[str, Any]:
        return {
            "name": f"hsextract-{name}",
            "target_modules": [target],
            "hook_factory": HOOK_FACTORY_PATH,
            "config": {**config, "dump_dir": dump_dir},
        }

    if design == "aux_capture":
        layers = list(aux_layers) if aux_layers is not None else None
        specs = [spec("dump", HOOK_TARGET_MODULE, role="aux_capture", aux_layers=layers)]
    elif design == "layernorm":
        if aux_layers is None:
            raise ValueError("hooks design 'layernorm' needs the aux layers by number")
        specs = [spec("begin", f"{HOOK_TARGET_MODULE}.embed_tokens", role="begin")]
        norm = f"{HOOK_TARGET_MODULE}.layers.{{}}.input_layernorm"
        specs += [spec(f"aux-{i}", norm.format(i), role="aux", layer=i) for i in aux_layers]
        specs.append(spec("final", f"{HOOK_TARGET_MODULE}.norm", role="final"))
        specs.append(spec("write", HOOK_TARGET_MODULE, role="write", aux_layers=list(aux_layers)))
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
