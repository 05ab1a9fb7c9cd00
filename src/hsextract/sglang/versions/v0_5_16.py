"""SGLang 0.5.16: 0.5.15.post1's layout; pins sglang-kernel 0.4.5 (torch still 2.11.0: runs
on the H200).  float32 is not refused: 0.4.5's rmsnorm was never seen failing on it."""

from dataclasses import replace

from hsextract.sglang.versions import v0_5_15_post1

VERSION = replace(
    v0_5_15_post1.VERSION, version="0.5.16", sglang_kernel="0.4.5", unserved_dtypes=()
)
