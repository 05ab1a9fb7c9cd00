"""The command-line options an SGLang release declares, read from its own source.

The launch command is checked against these before a server is started (a wrong flag
costs minutes of an 8-GPU node before SGLang's parser says so) and in the tests, for every
supported release.  Read the way SGLang's ``arg_utils.add_cli_args_from_dataclass``
derives them: ``--field-name`` (or ``cli_name``) plus ``aliases`` of every
``A[T, Arg(...)]`` / ``A[T, "help"]`` field, bools as flags, ``no_cli`` skipped; plus the
manual ``parser.add_argument`` calls, deprecated ones marked.  Parsed with ``ast``, not
imported: importing SGLang initialises CUDA libraries.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from hsextract.errors import ConfigError
from hsextract.sglang.versions import SglangVersion


@dataclass
class Flag:
    name: str
    takes_value: bool
    choices: list[str] | None = None
    deprecated: bool = False
    names: list[str] = field(default_factory=list)


def _strings(node: ast.AST) -> list[str]:
    return [
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def _option_classes(tree: ast.Module, how: str) -> list[ast.ClassDef]:
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    if how == "_NS_PATH":
        return [
            c
            for c in classes
            if any(
                isinstance(s, ast.Assign) and ast.unparse(s.targets[0]) == "_NS_PATH"
                for s in c.body
            )
        ]
    return [c for c in classes if c.name == how]


def _field_flag(st: ast.AnnAssign) -> Flag | None:
    ann = st.annotation
    if not (isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "A"):
        return None
    elts = getattr(ann.slice, "elts", None)
    if not elts or len(elts) < 2:
        return None
    typ = elts[0]
    # SGLang's _unwrap_annotated: the first Arg(...) or help string among the metadata
    # (0.5.17-0.5.19 append an NS("...") marker after it).
    meta = next(
        (
            m
            for m in elts[1:]
            if (isinstance(m, ast.Call) and ast.unparse(m.func) == "Arg")
            or (isinstance(m, ast.Constant) and isinstance(m.value, str))
        ),
        None,
    )
    if meta is None:
        return None
    kw: dict[str, ast.expr] = {}
    if isinstance(meta, ast.Call):
        kw = {k.arg: k.value for k in meta.keywords if k.arg}
    if "no_cli" in kw and ast.unparse(kw["no_cli"]) == "True":
        return None
    assert isinstance(st.target, ast.Name)
    cli = "--" + st.target.id.replace("_", "-")
    if "cli_name" in kw:
        cli = _strings(kw["cli_name"])[0]
    aliases = _strings(kw["aliases"]) if "aliases" in kw else []
    t = ast.unparse(typ)
    is_bool = t in ("bool", "Optional[bool]") and "action" not in kw
    choices = None
    if "Literal[" in t:
        choices = _strings(typ)
    elif "choices" in kw and isinstance(kw["choices"], ast.List):
        choices = _strings(kw["choices"])
    return Flag(cli, takes_value=not is_bool, choices=choices, names=[cli, *aliases])


def declared_flags(pkg: Path, version: SglangVersion) -> dict[str, Flag]:
    """Every option the SGLang package at ``pkg`` declares, by each of its names."""
    flags: dict[str, Flag] = {}
    files = sorted({p for pattern in version.args_files for p in Path(pkg).glob(pattern)})
    if not files:
        raise ConfigError(f"{pkg}: no {version.args_files}; is it sglang {version.version}?")
    for path in files:
        tree = ast.parse(path.read_text())
        for cls in _option_classes(tree, version.args_classes):
            for st in cls.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    f = _field_flag(st)
                    if f is not None:
                        flags.update(dict.fromkeys(f.names, f))
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "parser.add_argument"):
                continue
            names = [
                a.value
                for a in call.args
                if isinstance(a, ast.Constant) and str(a.value).startswith("--")
            ]
            if not names:
                continue
            kw = {k.arg: ast.unparse(k.value) for k in call.keywords if k.arg}
            action = kw.get("action", "")
            f = Flag(
                names[0],
                takes_value=action not in ("'store_true'", "DeprecatedStoreTrueAction"),
                deprecated=action.startswith("Deprecated") or "Deprecated" in kw.get("help", ""),
                names=names,
            )
            flags.update(dict.fromkeys(names, f))
    return flags


def check_argv(argv: list[str], flags: dict[str, Flag], version: str) -> list[str]:
    """Every option of a launch command: declared by ``version`` under that very name (not
    an alias, not an argparse abbreviation), not deprecated, with a value iff it takes one
    and that value among its choices.  Returns the options seen; raises ConfigError
    naming the first problem."""
    i = argv.index("sglang.launch_server") + 1 if "sglang.launch_server" in argv else 0
    seen = []
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"sglang {version}: stray value {token!r} in the launch command")
        name = token.partition("=")[0]
        f = flags.get(name)
        if f is None:
            raise ConfigError(
                f"sglang {version} declares no option {name} (read from its source); "
                "remove it from sglang.extra_args, or use a capture mode or SGLang version "
                "that has it"
            )
        if name != f.name:
            raise ConfigError(f"sglang {version}: {name} is an alias; use {f.name}")
        if f.deprecated:
            raise ConfigError(f"sglang {version}: {name} is deprecated; use its replacement")
        seen.append(name)
        i += 1
        if not f.takes_value:
            continue
        value = token.partition("=")[2] if "=" in token else None
        if value is None:
            if i >= len(argv) or argv[i].startswith("--"):
                raise ConfigError(f"sglang {version}: {name} needs a value")
            value = argv[i]
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):  # nargs="+" lists
                i += 1
        if f.choices and value not in f.choices:
            raise ConfigError(f"sglang {version}: {name} {value!r} is not one of {f.choices}")
    return seen
