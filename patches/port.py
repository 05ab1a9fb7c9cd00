"""Write ``patches/sglang-<version>/`` for a release from its own ``deepseek_v2.py``.

The patch is the same four edits in every release (see any ``deepseek_v2.py.patch``): the
dump begins after ``aux_hidden_states`` is created, the aux layers get a collector in
SGLang's ``captured_last_layer_outputs`` slot, the final norm hands over the stream before
it, and the batch is written once the forward is done.  The edits find their lines by
content, not by line number, in the two layouts SGLang has had:

- ``residual`` passed through the layers and ``self.norm(hidden_states, residual)`` at the
  end (0.5.14 - 0.5.20);
- the residual kept by ``residual_batch`` and ``residual_batch.norm`` / ``final_norm(...,
  capture=...)`` at the end (0.5.21 on).

A release whose file matches neither fails here naming the edit; its patch is then written
by hand.  Reproduces the committed patches byte for byte (tests/test_patching.py checks).

usage: python patches/port.py VERSION [SGLANG_PKG_DIR]   (default: the cached wheel source)
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import sys
from pathlib import Path

TARGET = "srt/models/deepseek_v2.py"
HERE = Path(__file__).resolve().parent

_BEGIN = re.compile(
    r"^( +)aux_hidden_states = (?:\[\]|AuxHiddenStatePacker\(len\(self\.layers_to_capture\)\))\n",
    re.M,
)
_COLLECTOR = re.compile(
    r"^( +)captured_last_layer_outputs=(?:\(\n +aux_hidden_states if i in "
    r"self\.layers_to_capture else None\n +\),|aux_hidden_states\n +if i in "
    r"self\.layers_to_capture\n +else None,)\n",
    re.M,
)
_NORM_RESIDUAL = re.compile(
    r"^( +)if residual is None:\n +hidden_states = self\.norm\(hidden_states\)\n +else:\n"
    r" +hidden_states, _ = self\.norm\(hidden_states, residual\)\n",
    re.M,
)
_NORM_BATCH = re.compile(
    r"^( +)hidden_states = residual_batch\.(norm|final_norm)\(\n"
    r"( +hidden_states, forward_batch, self\.norm\n) +\)\n",
    re.M,
)
# The name of residual_batch's capture callback argument, per function.
_CAPTURE_KW = {"norm": "capture_output", "final_norm": "capture"}

_TAIL = """

# --- hsextract (patches/sglang-{version}): hidden-state dump for EAGLE-3 training ---
# Off unless SGLANG_HS_DUMP_DIR is set; then hsextract.sglang.hooks decides per forward
# (EXTEND, TP rank 0) and takes the residual stream entering the aux layers through
# the collector argument SGLang's own EAGLE-3 capture uses (and, with prenorm_final,
# the stream before the final norm). Off, the helpers hand back what they get, so
# nothing the model computes changes.


def _hs_dump_begin(model, forward_batch):
    import os

    if not os.environ.get("SGLANG_HS_DUMP_DIR"):
        return None
    from hsextract.sglang.hooks import begin_forward  # imported only by a dumping server

    return begin_forward(model, forward_batch, tp_rank=get_parallel().tp_rank)


def _hs_dump_collector(dump, layer_id, own):
    return own if dump is None else dump.collector(layer_id, own)
{prenorm}

def _hs_dump_write(dump, forward_batch, input_ids, hidden_states):
    if dump is not None:
        dump.write(forward_batch, input_ids, hidden_states)
"""
_PRENORM_RESIDUAL = """

def _hs_dump_prenorm(dump, hidden_states, residual):
    if dump is not None:
        dump.prenorm(hidden_states, residual)
"""
_PRENORM_CAPTURE = """

def _hs_dump_prenorm_capture(dump):
    return None if dump is None else dump.prenorm_capture()
"""


class PortError(RuntimeError):
    """The release's file does not have the lines an edit looks for."""


def _one(pattern: re.Pattern[str], text: str, what: str) -> re.Match[str]:
    hits = list(pattern.finditer(text))
    if len(hits) != 1:
        raise PortError(f"{TARGET}: {len(hits)} places for the edit {what!r} (need exactly 1)")
    return hits[0]


def patched_text(text: str, version: str) -> str:
    """The release's file with the dump patch's four edits."""
    edits: list[tuple[int, int, str]] = []
    m = _one(_BEGIN, text, "dump begins after aux_hidden_states")
    ind = m.group(1)
    line = f"{ind}hs_dump = _hs_dump_begin(self, forward_batch)  # hsextract: None unless dumping\n"
    edits.append((m.end(), m.end(), line))
    m = _one(_COLLECTOR, text, "collector in captured_last_layer_outputs")
    ind = m.group(1)
    edits.append(
        (
            m.start(),
            m.end(),
            f"{ind}captured_last_layer_outputs=_hs_dump_collector(\n{ind}    hs_dump,\n"
            f"{ind}    i,\n{ind}    aux_hidden_states if i in self.layers_to_capture else None,\n"
            f"{ind}),\n",
        )
    )
    residual = list(_NORM_RESIDUAL.finditer(text))
    if residual:
        m = _one(_NORM_RESIDUAL, text, "final norm with residual")
        ind = m.group(1)
        write = f"{ind[:-4]}_hs_dump_write(hs_dump, forward_batch, input_ids, hidden_states)\n"
        edits.append(
            (m.start(), m.start(), f"{ind}_hs_dump_prenorm(hs_dump, hidden_states, residual)\n")
        )
        edits.append((m.end(), m.end(), write))
        prenorm = _PRENORM_RESIDUAL
    else:
        m = _one(_NORM_BATCH, text, "final norm through residual_batch")
        ind, fn = m.group(1), m.group(2)
        args = f"{ind}    hidden_states,\n{ind}    forward_batch,\n{ind}    self.norm,\n"
        args += f"{ind}    {_CAPTURE_KW[fn]}=_hs_dump_prenorm_capture(hs_dump),\n"
        edits.append((m.start(3), m.end(3), args))
        edits.append(
            (
                m.end(),
                m.end(),
                f"{ind[:-4]}_hs_dump_write(hs_dump, forward_batch, input_ids, hidden_states)\n",
            )
        )
        prenorm = _PRENORM_CAPTURE
    out = text
    for start, end, new in sorted(edits, reverse=True):
        out = out[:start] + new + out[end:]
    return out + _TAIL.format(version=version, prenorm=prenorm)


def make_diff(text: str, new: str) -> str:
    """A unified diff with 3 lines of context, as ``diff -u`` writes it (difflib's
    ``unified_diff`` treats a frequent line such as a lone ``)`` as junk and would mark
    it changed: no autojunk here)."""
    a, b = text.splitlines(keepends=True), new.splitlines(keepends=True)
    name = f"sglang/{TARGET}"
    out = [f"--- a/{name}\n", f"+++ b/{name}\n"]
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for group in matcher.get_grouped_opcodes(3):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@\n")
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                out += [" " + ln for ln in a[a1:a2]]
                continue
            out += ["-" + ln for ln in a[a1:a2]]
            out += ["+" + ln for ln in b[b1:b2]]
    return "".join(out)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write(version: str, pkg: Path, out_dir: Path = HERE) -> Path:
    """Write ``<out_dir>/sglang-<version>/`` (patch + manifest) from ``pkg``'s file."""
    text = (pkg / TARGET).read_text(encoding="utf-8")
    new = patched_text(text, version)
    d = out_dir / f"sglang-{version}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "deepseek_v2.py.patch").write_text(make_diff(text, new))
    manifest = {
        "sglang_version": version,
        "target": TARGET,
        "patch": "deepseek_v2.py.patch",
        "pristine_sha256": sha256(text),
        "patched_sha256": sha256(new),
        "what": "DeepseekV2Model.forward hands the aux layers' residual stream and the final "
        "post-norm hidden state to hsextract.sglang.hooks/hsextract.capture while "
        "SGLANG_HS_DUMP_DIR is set; unset, nothing changes",
    }
    (d / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return d


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", help="the SGLang release, e.g. 0.5.24")
    ap.add_argument("sglang_pkg_dir", nargs="?", help="its sglang/ dir (default: the wheel's)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent / "src"))
    from hsextract.sglang.patching import ensure_pinned_source

    root = args.sglang_pkg_dir or ensure_pinned_source(args.version) / "sglang"
    print(write(args.version, Path(root)))
