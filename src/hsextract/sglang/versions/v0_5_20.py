"""SGLang 0.5.20: options move to the ``_NS_PATH`` classes of ``srt/arg_groups/fields/``
(server_args.py keeps the manual ``add_argument`` ones).  Layers unchanged (residual passed
through).  Source-checked only (torch 2.13.0)."""

from dataclasses import replace

from hsextract.sglang.versions import v0_5_19

VERSION = replace(
    v0_5_19.VERSION,
    version="0.5.20",
    args_files=("srt/arg_groups/fields/*.py", "srt/server_args.py"),
    args_classes="_NS_PATH",
    sglang_kernel="0.4.7",
)
