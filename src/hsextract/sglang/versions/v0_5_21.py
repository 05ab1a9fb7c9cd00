"""SGLang 0.5.21: decoder layers keep the residual in ``forward_batch.residual_stream``
(``residual_batch``) and return ``(hidden, topk)``; aux capture is ``capture(hidden,
owned=)``; the final norm is ``residual_batch.norm(..., capture_output=)``.  The input
norm is still a module called as ``norm(hidden, residual, ...)``, so the layernorm hooks
fit; no ``--enable-return-aux-hidden-states`` yet.  Source-checked only (torch 2.13.0)."""

from dataclasses import replace

from hsextract.sglang.versions import v0_5_20

VERSION = replace(v0_5_20.VERSION, version="0.5.21")
