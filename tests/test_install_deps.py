"""What the README's install (``pip install -e .``) brings is enough for the commands it
documents: every third-party module the exports import is a declared dependency of the
package, or one of theirs.  On 51ddea2 ``hsextract export speculators`` (and the
workflow's ``export_speculators``) ended in ``No module named 'datasets'``: only the test
extra named it."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; (]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _installed_with_the_package() -> set[str]:
    """The distributions ``pip install -e .`` installs: the declared dependencies (no
    extra) and, transitively, theirs."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [_name(r) for r in project["dependencies"]]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def _third_party_imports(files: list[Path]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for m in mods:
                top = m.split(".")[0]
                if top not in sys.stdlib_module_names and top != "hsextract":
                    out.setdefault(top, []).append(f.name)
    return out


def test_the_exports_need_nothing_beyond_the_packages_own_install():
    installed = _installed_with_the_package()
    providers = md.packages_distributions()
    exports = sorted((REPO / "src" / "hsextract" / "export").glob("*.py"))
    missing = {
        top: files
        for top, files in _third_party_imports(exports).items()
        if not {_name(d) for d in providers.get(top, [top])} & installed
    }
    assert not missing, f"imported by the exports, not installed by `pip install -e .`: {missing}"
