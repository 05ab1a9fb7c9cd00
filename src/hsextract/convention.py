"""The capture convention (a contract): which layers EAGLE-3 trains on.

Standard library only: imported by the workflow side (config, planning without torch) and
by the server side (the SGLang hooks, the reference engine) alike.
"""

from __future__ import annotations

#: The residual stream entering each aux layer plus the final post-norm state (DESIGN.md).
CAPTURE_CONVENTION = "eagle3-residual-entering-layer+final-norm"


def prenorm_layer(num_layers: int) -> int:
    """The aux index of the stream after the last decoder layer, before the final norm:
    "entering layer L" of an L-layer model (opt-in, ``prenorm_final``; vLLM speculators
    trains on it).  One more index, not a new kind of tensor: every part of the dump
    protocol already carries aux layers by index."""
    return num_layers


def default_aux_layers(num_layers: int) -> list[int]:
    """SGLang's EAGLE-3 default, as ``set_eagle3_layers_to_capture(None)`` sets it: the
    residual stream entering layers 2, L//2 and L-3."""
    return [2, num_layers // 2, num_layers - 3]
