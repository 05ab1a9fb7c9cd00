"""SGLang 0.5.23, the newest release supported (pins torch 2.14.1: not runnable on the H200
machine, so checked against its source only).

- ``--enable-return-aux-hidden-states``: SGLang's own aux capture without a draft.  Hooks
  use it (``--speculative-algorithm EAGLE3`` names the capture convention, no draft is
  loaded) plus one hook on the inner model; no input-norm hooks, so nothing to disable
  with tp_size > 1 (SGLang's capture sees the stream after any fused all-reduce).
- Everything else as 0.5.22 (options in ``srt/arg_groups/fields/*.py``, residual kept by
  ``residual_batch``, deterministic alignment for flashinfer only; refused at plan time).
"""

from dataclasses import replace

from hsextract.sglang.versions import v0_5_22

VERSION = replace(
    v0_5_22.VERSION,
    version="0.5.23",
    hooks="aux_capture",
    hooks_tp_args=(),
    sglang_kernel="0.4.10",
)
