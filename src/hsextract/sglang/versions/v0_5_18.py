"""SGLang 0.5.18 (SpecForge's pin): deterministic inference aligns by the *prefill*
attention backend (``attention_backends()``: ``--prefill-attention-backend``, else
``--attention-backend``).  Pins torch 2.13.0: source-checked only."""

from dataclasses import replace

from hsextract.sglang.versions import v0_5_17

VERSION = replace(
    v0_5_17.VERSION,
    version="0.5.18",
    prefill_backend_args=("--prefill-attention-backend", "--attention-backend"),
    torch="2.13.0",
    sglang_kernel="0.4.6.post1",
)
