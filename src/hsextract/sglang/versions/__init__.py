"""The SGLang releases hsextract supports: one module per release, one declaration each.

What differs between releases lives here and nowhere else: where the server options are
declared (for the flag check), which forward-hooks design fits the release, the patch's
directory, flags a release needs.  A release whose relevant parts equal its predecessor's
is ``dataclasses.replace(<predecessor>.VERSION, version=...)`` plus what changed, so each
module names only what that release changed.  Adding the next release is one new
``v<X>_<Y>_<Z>.py`` next to these, plus its ``patches/sglang-<version>/`` (written by
``patches/port.py``).  A release with no declaration can still run ``capture: hooks``
when its source matches a known design (``hsextract.sglang.compat``).  Standard library
only.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass, field
from functools import cache


@dataclass(frozen=True)
class SglangVersion:
    """One SGLang release, as far as extraction cares."""

    version: str
    #: Where the release declares ``ServerArgs`` options: files (globs, relative to the
    #: ``sglang`` package) and how to find the classes holding ``A[T, Arg(...)]`` fields
    #: in them: a class name, or ``"_NS_PATH"`` for every class that sets one.
    args_files: tuple[str, ...]
    args_classes: str
    #: How ``capture: hooks`` captures (see ``hsextract.sglang.hooks``):
    #: ``"layernorm"`` -- forward hooks on each aux layer's ``input_layernorm`` (its output
    #: is the residual stream entering the layer), the final ``norm`` and the inner
    #: model; any architecture whose layers call ``input_layernorm(hidden, residual)``.
    #: ``"aux_capture"`` -- SGLang's own EAGLE-3 aux capture
    #: (``--enable-return-aux-hidden-states``) plus one hook on the inner model.
    hooks: str
    #: Always added to the launch command with ``capture: hooks`` and ``tp_size > 1``.
    hooks_tp_args: tuple[str, ...] = ()
    #: An input of n tokens is accepted iff n < context_length - (headroom - 1).
    context_headroom: int = 7
    #: ``--enable-deterministic-inference`` cuts chunked prefill at multiples of an
    #: alignment for some prefill attention backends: ``(backend, env var, default
    #: tokens)``.  A ``server.chunked_prefill_size`` below it can never schedule a longer
    #: record (SGLang 0.5.14 then waits forever; later releases refuse to start).
    deterministic_align: tuple[tuple[str, str, int], ...] = ()
    #: The options that name the prefill attention backend, first given wins.
    prefill_backend_args: tuple[str, ...] = ("--attention-backend",)
    #: ``model.dtype`` values the release cannot serve on CUDA, with what goes wrong.
    unserved_dtypes: tuple[tuple[str, str], ...] = ()
    #: The torch and sglang-kernel this release pins (for the docs and the H200 recipe,
    #: ``h200/build.sh``; not enforced).
    torch: str = ""
    sglang_kernel: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def patch_dir(self) -> str:
        return f"sglang-{self.version}"


def version_key(version: str) -> tuple[int, ...]:
    """Orders release strings as PyPI does for SGLang's: 0.5.15 < 0.5.15.post1 < 0.5.16."""
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?", version)
    if m is None:
        raise ValueError(f"not an SGLang release string: {version!r}")
    a, b, c, post = m.groups()
    return (int(a), int(b), int(c), -1 if post is None else int(post))


@cache
def known() -> dict[str, SglangVersion]:
    """Every declared release, by version string, oldest first."""
    out = {}
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("v"):
            v = importlib.import_module(f"{__name__}.{mod.name}").VERSION
            out[v.version] = v
    return dict(sorted(out.items(), key=lambda kv: version_key(kv[0])))


class UnknownVersion(LookupError):
    """An SGLang release hsextract has no declaration (and no patch) for."""


def get(version: str) -> SglangVersion:
    try:
        return known()[version]
    except KeyError:
        raise UnknownVersion(
            f"SGLang {version} is not supported: known {', '.join(known())}. Install one of "
            "those in the env named by sglang.python, or add a declaration under "
            "src/hsextract/sglang/versions/ and its patch under patches/"
        ) from None


__all__ = ["SglangVersion", "UnknownVersion", "get", "known", "version_key"]
