"""SGLang 0.5.23, the newest release supported (pins torch 2.14.1: not runnable on the H200
machine, so checked against its source only).

- Options: ``A[T, Arg(...)]`` fields of the classes in ``srt/arg_groups/fields/*.py`` that
  set ``_NS_PATH`` (plus manual ``add_argument`` calls in server_args.py).
- Decoder layers keep the residual in an opaque per-batch object and return
  ``(hidden, topk)``; the aux capture packer has ``capture(hidden, owned=...)``.  Hooks
  use SGLang's own aux capture (``--enable-return-aux-hidden-states
  --speculative-algorithm EAGLE3``, no draft loaded) plus one hook on the inner model.
"""

from hsextract.sglang.versions import SglangVersion

VERSION = SglangVersion(
    version="0.5.23",
    args_files=("srt/arg_groups/fields/*.py", "srt/server_args.py"),
    args_classes="_NS_PATH",
    hooks="aux_capture",
    context_headroom=7,
    torch="2.14.1",
)
