"""docs/configuration.md is what the settings' declarations generate (hsextract.settings_doc).

A setting added, removed or changed in src/hsextract/settings.py changes the page; the
committed page must be regenerated with it, and the failure says the command that does."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from hsextract import settings, settings_doc
from hsextract.settings import Setting
from tests.fixtures_demo import REPO

PAGE = REPO / "docs" / "configuration.md"


def test_the_committed_page_is_what_the_declarations_generate():
    assert PAGE.read_text() == settings_doc.render(), (
        "docs/configuration.md is stale (a setting's declaration changed in "
        "src/hsextract/settings.py): regenerate it from the repository root with "
        f"`{settings_doc.REGENERATE}`, then commit it"
    )


def test_the_regenerate_command_writes_the_page(tmp_path):
    """The command the failure message prints, as a shell runs it from the repo root."""
    out = tmp_path / "configuration.md"
    cmd = settings_doc.REGENERATE.replace("docs/configuration.md", str(out))
    cmd = cmd.replace("python ", f"{sys.executable} ", 1)
    subprocess.run(cmd, shell=True, cwd=REPO, check=True, timeout=120)
    assert out.read_text() == settings_doc.render()


def test_every_key_is_on_the_page_with_its_default_and_kind():
    page = settings_doc.render()
    rows = {
        line.split(" | ")[0].removeprefix("| `").removesuffix("`"): line
        for line in page.splitlines()
        if line.startswith("| `")
    }
    for key, s in settings.SETTINGS.items():
        assert key in rows, f"{key} has no row"
        cells = rows[key].split(" | ")
        default = "**required**" if s.required else f"`{json.dumps(s.default)}`"
        assert cells[2] == default, (key, cells)
        if "fingerprint" in s.kinds:
            assert "new run dir" in cells[3], (key, cells)
        elif s.kinds == ("neither",):
            assert cells[3] == "nothing reruns", (key, cells)


def test_the_keys_without_a_default_are_the_schemas_required():
    """What the page tells a user to set is what validation refuses a config without."""
    schema = settings.json_schema()
    required = [k for k in schema["required"] if k in settings.SETTINGS]
    for group in schema["required"]:
        if group in settings.GROUPS:
            node = schema["properties"][group]
            required += [f"{group}.{k}" for k in node.get("required", [])]
    page = settings_doc.render()
    listed = page.split("## Keys without a default", 1)[1].split("\n## ", 1)[0]
    said = [ln.split("`")[1] for ln in listed.splitlines() if ln.startswith("- `")]
    assert sorted(said) == sorted([*required, "inputs"]), said


def test_a_new_declaration_reaches_the_page():
    """The failure the audit's new key meets: a declaration the page does not have yet."""
    new = Setting(
        "client.example_s", "number", "an example key's help | with a bar", default=1.5,
        schema={"minimum": 0},
    )  # fmt: skip
    declared = (*settings.DECLARED, new)
    page = settings_doc.render(declared)
    assert page != settings_doc.render()
    row = (
        "| `client.example_s` | number (>= 0) | `1.5` | nothing reruns | "
        "an example key's help \\| with a bar |"
    )
    assert row in page.split("## `client`", 1)[1].split("\n## ", 1)[0]
    launch = dataclasses.replace(new, kinds=("launch spec",))
    by_kind = settings_doc.render((*settings.DECLARED, launch)).split("## By kind", 1)[1]
    launch_row = next(ln for ln in by_kind.splitlines() if ln.startswith("| launch spec |"))
    assert "`client.example_s`" in launch_row
