"""docs/configuration.md, generated from the settings' declarations (hsextract.settings).

The page a user reads to write a config: the keys that have no default, then every key
with its type, default, what a change does to a finished run (its kinds) and its help.
It is generated, never edited, so it cannot drift from what the workflow validates and
does: tests/test_settings_doc.py checks the committed page is what this module renders.

Regenerate from the repository root::

    python -m hsextract.settings_doc > docs/configuration.md

Stdlib only, as hsextract.settings is.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any

from hsextract import settings
from hsextract.settings import KINDS, Group, Setting

#: The command that rewrites the page; the test's failure message prints it.
REGENERATE = "python -m hsextract.settings_doc > docs/configuration.md"

#: What a change of a key of each kind does, in a table cell.
_SHORT = {
    "fingerprint": "new run dir: re-extracts every chunk",
    "run location": "the run dir moves (same fingerprint)",
    "chunk content": "re-extracts the chunks whose records change",
    "merge order": "reshuffles train.jsonl; re-extracts nothing",
    "launch spec": "the next server starts with it",
    "stale deletion": "reruns stale deletion",
    "export": "re-exports every chunk",
    "neither": "nothing reruns",
}  # fmt: skip
assert set(_SHORT) == set(KINDS), "a kind without its sentence"


def _is_group(d: Setting | Group) -> bool:
    """By shape, not class: ``render`` also takes declarations loaded from another copy
    of hsextract/settings.py (another commit's), whose classes are not these."""
    return not hasattr(d, "kinds")


def _text(text: str) -> str:
    """Prose as Markdown: ``<output_root>`` outside code spans would be read as a tag."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _cell(text: str) -> str:
    """A Markdown table cell: a `|` would end it, a newline the row."""
    return " ".join(text.split()).replace("|", "\\|")


def _type(s: Setting) -> str:
    types = s.type if isinstance(s.type, tuple) else (s.type,)
    said = " or ".join(types)
    if "enum" in s.schema:
        said += ": " + ", ".join(f"`{v}`" for v in s.schema["enum"])
    if "pattern" in s.schema and s.schema["pattern"] == "^auto$":
        said += ": a number or `auto`"
    low = s.schema.get("minimum", s.schema.get("exclusiveMinimum"))
    high = s.schema.get("maximum")
    if low is not None or high is not None:
        strict = "exclusiveMinimum" in s.schema
        bounds = [f"> {low}" if strict else f">= {low}"] if low is not None else []
        bounds += [f"<= {high}"] if high is not None else []
        said += f" ({', '.join(bounds)})"
    return said


def _default(s: Setting) -> str:
    if s.required:
        return "**required**"
    return f"`{json.dumps(s.default)}`"


def _change(s: Setting) -> str:
    # A new run dir re-extracts everything: what else the key does adds nothing to that.
    kinds = ("fingerprint",) if "fingerprint" in s.kinds else s.kinds
    said = "; ".join(_SHORT[k] for k in kinds)
    if s.engine:
        said = f"with engine {s.engine}: {said}; else nothing reruns"
    return said


def _about(s: Setting) -> str:
    return _text(s.help + (f" ({s.note})" if s.note else ""))


def _sections(declared: Iterable[Setting | Group]) -> list[tuple[str, str, list[Setting]]]:
    """(group key, its help, its settings) in declaration order; "" is the top level.
    A nested group (``export.specforge``) is a section of its own."""
    groups = {d.key: d for d in declared if _is_group(d)}
    sections: dict[str, tuple[str, list[Setting]]] = {"": ("", [])}
    for d in declared:
        if _is_group(d):
            sections.setdefault(d.key, (d.help, []))
            continue
        parent = d.key.rpartition(".")[0]
        help_ = groups[parent].help if parent in groups else ""
        sections.setdefault(parent, (help_, []))[1].append(d)
    return [(key, help_, keys) for key, (help_, keys) in sections.items() if keys]


def _required(declared: Iterable[Setting | Group]) -> list[Setting]:
    return [d for d in declared if not _is_group(d) and d.required]


def render(declared: tuple[Any, ...] | None = None) -> str:
    """The whole page for ``declared`` (default: hsextract.settings.DECLARED)."""
    declared = settings.DECLARED if declared is None else declared
    lines = [
        "# Configuration",
        "",
        "<!-- GENERATED from src/hsextract/settings.py; do not edit this page. Regenerate "
        f"from the repository root: {REGENERATE} -->",
        "",
        "A config is a YAML file passed with `--configfile` (or `./config.yaml`, the demo's).",
        "Each key below is declared once, in `src/hsextract/settings.py`, with its type,",
        "default and help. This page, the schema Snakemake validates with and the typed",
        "config the code reads are all generated from those declarations.",
        "",
        "## Keys without a default",
        "",
        "A config must set these:",
        "",
    ]
    for s in _required(declared):
        lines.append(f"- `{s.key}` ({_type(s)}): {_text(s.help)}")
    lines += [
        "- `inputs`: your shards, unless `demo.enabled` is true (see below).",
        "",
        "## What a change does",
        "",
        "Each key has one or more kinds. The kind says what changing the key does to a run",
        "that has already finished:",
        "",
        "| kind | a change |",
        "|---|---|",
    ]
    for kind in KINDS:
        lines.append(f"| {kind} | {_cell(settings._CHANGE[kind])} |")
    lines += [
        "",
        "A key marked with an engine does that with this engine only; with the other one a",
        "change reruns nothing.",
    ]
    for key, help_, keys in _sections(declared):
        lines += ["", f"## `{key}`" if key else "## Top level", ""]
        if help_:
            lines += [_text(help_[0].upper() + help_[1:]) + ".", ""]
        lines += ["| key | type | default | a change | what it is |", "|---|---|---|---|---|"]
        for s in keys:
            row = (f"`{s.key}`", _type(s), _default(s), _change(s), _about(s))
            lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    lines += ["", "## By kind", "", "The same keys, grouped by what a change does:", ""]
    lines += _by_kind(declared)
    return "\n".join(lines) + "\n"


def _by_kind(declared: Iterable[Setting | Group]) -> list[str]:
    """One row per kind, its keys in declaration order; a key of one engine is listed
    under ``neither`` for the other engine."""
    rows = ["| kind | keys |", "|---|---|"]
    for kind in KINDS:
        keys = []
        for s in declared:
            if _is_group(s):
                continue
            if kind in s.kinds:
                keys.append(f"`{s.key}`" + (f" ({s.engine} engine)" if s.engine else ""))
            elif kind == "neither" and s.engine:
                other = "sglang" if s.engine == "reference" else "reference"
                keys.append(f"`{s.key}` ({other} engine)")
        rows.append(f"| {kind} | {', '.join(keys)} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hsextract.settings_doc",
        description=f"print docs/configuration.md, generated from the settings' "
        f"declarations; from the repository root: {REGENERATE}",
    )
    p.parse_args(argv)
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
