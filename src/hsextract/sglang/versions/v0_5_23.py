"""SGLang 0.5.23, the newest release supported (pins torch 2.14.1: not runnable on the H200
machine, so checked against its source only).

- Options: ``A[T, Arg(...)]`` fields of the classes in ``srt/arg_groups/fields/*.py`` that
  set ``_NS_PATH`` (plus manual ``add_argument`` calls in server_args.py).
- Decoder layers keep the residual in an opaque per-batch object and return
  ``(hidden, topk)``; the aux capture packer has ``capture(hidden, owned=...)``.  Hooks
  use SGLang's own aux capture (``--enable-return-aux-hidden-states
  --speculative-algorithm EAGLE3``, no draft loaded) plus one hook on the inner model.
- ``--enable-deterministic-inference`` aligns chunked prefill only for flashinfer (triton
  tiles keys at absolute positions now) and refuses to start when the chunk is smaller
  (``check_truncation_align_fits_chunk``); we refuse it at plan time, before a GPU.
"""

from hsextract.sglang.versions import SglangVersion

VERSION = SglangVersion(
    version="0.5.23",
    args_files=("srt/arg_groups/fields/*.py", "srt/server_args.py"),
    args_classes="_NS_PATH",
    hooks="aux_capture",
    context_headroom=7,
    deterministic_align=(("flashinfer", "SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE", 4096),),
    prefill_backend_args=("--prefill-attention-backend", "--attention-backend"),
    torch="2.14.1",
)
