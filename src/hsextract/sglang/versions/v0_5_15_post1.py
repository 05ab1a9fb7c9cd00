"""SGLang 0.5.15.post1: 0.5.14's layout (options in the ``ServerArgs`` dataclass, residual
passed through the layers, aux capture appended to a list) with 18 more options; same
torch 2.11.0 and sglang-kernel 0.4.4 pins, so the same float32 refusal.  Runs on the H200."""

from dataclasses import replace

from hsextract.sglang.versions import v0_5_14

VERSION = replace(v0_5_14.VERSION, version="0.5.15.post1")
