"""Make a release's import work without what the H200 payload cannot carry, where SGLang
imports it unconditionally on a path the live tests never run; each edit is recorded in
``SITE/.hsextract-h200-fixups`` (returned in run.sh's output, never silent).

- 0.5.15.post1: ``sglang/jit_kernel/dsa/__init__.py`` imports the CuTe DSL paged-MQA kernel
  (``import cutlass``: nvidia-cutlass-dsl, ~75 MB of wheels, beyond the device's 64 MiB)
  on every CUDA machine, and ``models/deepseek_v2.py`` reaches it through the DSA indexer
  (DeepSeek-V3.2's sparse attention, which DeepSeek-V3 never builds).  0.5.16 made this
  very import lazy; here it falls back to the non-CUDA branch (None) when cutlass is
  missing.  ``deepseek_v2.py``, the patch's target, is untouched (its checksum is checked).

Found by walking each release's module-level imports from the serving entry points
against the site and the H200 image (as of issue 22); a missing import the walk misses
shows up on the H200 as the server's ModuleNotFoundError.

usage: python h200/site_fixups.py SITE_DIR VERSION
"""

import sys
from pathlib import Path

_CUTE = "from .cutedsl_paged_mqa_logits import CuteDSLPagedMQALogitsRunner, pick_dsl_expand\n"
FIXUPS: dict[str, list[tuple[str, str, str]]] = {
    "0.5.15.post1": [
        (
            "sglang/jit_kernel/dsa/__init__.py",
            "if _is_cuda:\n    " + _CUTE + "else:\n",
            "try:  # hsextract H200 payload: no nvidia-cutlass-dsl (0.5.16 defers this import)\n"
            "    if not _is_cuda:\n"
            "        raise ImportError\n"
            "    " + _CUTE + "except ImportError:\n",
        ),
    ],
}


def main(site: str, version: str) -> None:
    done = []
    for rel, old, new in FIXUPS.get(version, []):
        path = Path(site) / rel
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"{path}: the text to fix is not there once; look again ({version})")
        path.write_text(text.replace(old, new))
        done.append(f"{rel}: {new.splitlines()[0].strip()}")
    (Path(site) / ".hsextract-h200-fixups").write_text("".join(f"{d}\n" for d in done))
    print(f"site fixups for {version}: {len(done)}", *done, sep="\n  ")


if __name__ == "__main__":
    main(*sys.argv[1:3])
