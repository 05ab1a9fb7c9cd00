"""Server-side capture for SGLang 0.5.23: the per-forward logic behind the patch and the hooks.

Two ways to make an SGLang server dump hidden states, both writing the same pieces through
``hsextract.capture`` (one dump protocol):

``capture: patch`` (default)
    ``patches/sglang-0.5.23`` adds three calls to ``DeepseekV2Model.forward``.  For the aux
    layers it passes a collector in the ``captured_last_layer_outputs`` slot that SGLang's
    EAGLE-3 capture uses, so the dump sees exactly the residual stream SGLang would hand a
    drafter, while the server's own ``layers_to_capture`` keeps working.  Needs write access
    to the SGLang install and a checksum-verified edit of one file; works for any aux layers.

``capture: hooks``
    No file modified.  The server runs with ``--enable-return-aux-hidden-states
    --speculative-algorithm EAGLE3`` (SGLang's own aux capture, no draft loaded) and
    ``--forward-hooks`` naming :func:`dump_hook_factory` on the inner ``model`` module.  The
    hook receives ``(input_ids, positions, forward_batch, ...)`` and SGLang's output
    ``(final hidden, packed aux)``.  Choose it when the SGLang install is read-only or shared,
    or a patch must not be applied.  Costs: SGLang also routes the aux tensor through its
    logits processor, and ``set_eagle3_layers_to_capture`` shifts an id list that starts with
    1 by one, so aux layers starting at 1 cannot be expressed (refused by config checks).

Both run only with CUDA graphs off (SGLang registers forward hooks after graph capture and
graph replay never runs Python), on TP rank 0, for EXTEND forwards.  This module is imported
inside the server process, so it uses only the standard library, torch and ``capture``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hsextract.capture import AUX_LAYERS_ENV, DumpWriter, get_writer
from hsextract.convention import default_aux_layers

#: The inner ``DeepseekV2Model`` is ``self.model`` of ``DeepseekV2ForCausalLM``.
HOOK_TARGET_MODULE = "model"
HOOK_FACTORY_PATH = "hsextract.hooks:dump_hook_factory"


def _dumping_forward(forward_batch: Any, tp_rank: int, model: Any) -> bool:
    # TARGET_VERIFY counts as extend in SGLang but is speculative verification, not prefill.
    mode = forward_batch.forward_mode
    if not mode.is_extend() or mode.is_target_verify():
        return False
    # Rank 0 of the TP group holds the full, replicated residual stream; only the last
    # pipeline stage has the final norm.
    return tp_rank == 0 and bool(model.pp_group.is_last_rank)


class _Collector:
    """Stands in SGLang's ``captured_last_layer_outputs`` slot for one aux layer."""

    def __init__(self, own: Any) -> None:
        self.own = own
        self.value: torch.Tensor | None = None

    def capture(self, hidden: torch.Tensor, *, owned: bool = False) -> None:
        # SGLang's collector gets exactly what it would have got without us.
        if self.own is not None:
            self.own.capture(hidden, owned=owned)
        # A borrowed value is the live residual buffer, which later layers overwrite.
        self.value = hidden if owned else hidden.clone()


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


def make_dump_hook(config: dict[str, Any], *, tp_rank: Callable[[], int]) -> Callable[..., None]:
    """A ``register_forward_hook`` hook for the inner model; ``tp_rank`` is injectable for tests.

    ``config`` may hold ``aux_layers`` (list); else ``HSEXTRACT_AUX_LAYERS`` or the EAGLE-3
    default.  The hook checks them against the model's ``layers_to_capture`` on every call, so
    a server launched with other capture layers fails instead of mislabelling data.
    """
    configured = config.get("aux_layers")

    def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
        if len(args) < 3:
            raise RuntimeError(
                "hsextract hook: expected (input_ids, positions, forward_batch, ...)"
            )
        input_ids, forward_batch = args[0], args[2]
        if not _dumping_forward(forward_batch, tp_rank(), module):
            return None
        writer = get_writer()
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


def dump_hook_factory(config: dict[str, Any]) -> Callable[..., None]:
    """Entry point named in ``--forward-hooks`` (SGLang calls ``factory(spec["config"])``)."""
    from sglang.srt.runtime_context import get_parallel  # only inside an SGLang server

    return make_dump_hook(config, tp_rank=lambda: int(get_parallel().tp_rank))


def forward_hooks_spec(aux_layers: Sequence[int] | None) -> str:
    """The ``--forward-hooks`` JSON value (SGLang's spec keys: name, target_modules, ...)."""
    spec = {
        "name": "hsextract-dump",
        "target_modules": [HOOK_TARGET_MODULE],
        "hook_factory": HOOK_FACTORY_PATH,
        "config": {"aux_layers": list(aux_layers) if aux_layers is not None else None},
    }
    return json.dumps([spec], separators=(",", ":"))


__all__ = [
    "AUX_LAYERS_ENV",
    "ForwardDump",
    "begin_forward",
    "dump_hook_factory",
    "forward_hooks_spec",
    "make_dump_hook",
]
