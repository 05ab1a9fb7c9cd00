"""SGLang 0.5.22: the final norm is ``residual_batch.final_norm(..., capture=)``;
deterministic inference aligns only flashinfer (triton tiles keys at absolute positions)
and refuses to start when the chunk is smaller (``check_truncation_align_fits_chunk``).
Source-checked only (torch 2.14.1)."""

from dataclasses import replace

from hsextract.sglang.versions import v0_5_21

VERSION = replace(
    v0_5_21.VERSION,
    version="0.5.22",
    deterministic_align=(("flashinfer", "SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE", 4096),),
    torch="2.14.1",
    sglang_kernel="0.4.9",
)
