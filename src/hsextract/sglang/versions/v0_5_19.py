"""SGLang 0.5.19: what extraction uses is 0.5.18's.  Source-checked only (torch 2.13.0)."""

from dataclasses import replace

from hsextract.sglang.versions import v0_5_18

VERSION = replace(v0_5_18.VERSION, version="0.5.19")
