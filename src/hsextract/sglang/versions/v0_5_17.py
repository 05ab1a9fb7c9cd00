"""SGLang 0.5.17: option fields gain a third ``NS(...)`` marker (``A[T, Arg(...), NS(..)]``,
read by ``flags``); aux capture packs into ``AuxHiddenStatePacker`` but still through
``append`` (the patch's collector speaks it).  Same pins as 0.5.16: runs on the H200."""

from dataclasses import replace

from hsextract.sglang.versions import v0_5_16

VERSION = replace(v0_5_16.VERSION, version="0.5.17")
