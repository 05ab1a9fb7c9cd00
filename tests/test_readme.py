"""Every command the READMEs and docs/*.md print runs as printed.

Each command is read from the Markdown (fenced blocks and inline code that starts with a
program) and checked against the parser of the program it calls: Snakemake's own (with
the profiles it names), hsextract's, each bench script's.  Every Snakemake command is then
dry-run in a workdir holding the configs it names: `--configfile` takes several values,
so a target written after it is read as one more config file (issue 20).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from fixtures_demo import REPO, run_dir_of

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

DOCS = (
    "README.md",
    "bench/README.md",
    "h200/README.md",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
)
PYTHONS = ("python", "python3", ".venv/bin/python")
PROGRAMS = ("snakemake", "hsextract", "bash", "pip", "apt-get", ".", *PYTHONS)
# Code spans that start like a command but are not one to run here, and why.
NOT_RUN = {
    "hsextract [plan]: 1 of 512 chunk(s) to extract, ...": "a line the run prints",
    "python -m sglang.launch_server": "SGLang's own server, which hsextract starts",
}
# Placeholders: the ones in angle brackets are replaced in the text, the synopsis' capitals
# (`hsextract status [--configfile F]`) as whole words.  FP is the demo's fingerprint;
# <checkout> is where the user cloned hsextract (a command run from their own directory).
ANGLED = {
    "<checkout>": str(REPO),
    "<chunk file>": "results/FP/hidden/chunk_00000.safetensors",
    "<chunk>": "results/FP/hidden/chunk_00000.safetensors",
    "<manifest>": "results/FP/manifest.json",
    "<fingerprint>": "FP",
    "<fp>": "FP",
}
WORDS = {
    "F": "config.yaml",
    "M": "results/FP/manifest.json",
    "MANIFEST": "results/FP/manifest.json",
    "CHUNK_FILE": "results/FP/hidden/chunk_00000.safetensors",
    "DIR": "some/dir",
    "N": "8",
    "S": "60",
    "key=value": "seed=1",
    "k=v": "seed=1",
}


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    argv: tuple[str, ...]  # placeholders substituted, env assignments dropped
    env: tuple[tuple[str, str], ...] = ()
    inline: bool = False  # a code span in prose, which may name just a subcommand

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def _split(text: str) -> list[list[str]] | None:
    """The simple commands of one shell line (``a && b``), comments dropped; None if the
    line does not parse as shell (a sample of output)."""
    for placeholder, value in ANGLED.items():
        text = text.replace(placeholder, value)
    # A synopsis' optional parts are checked as given: `[--out DIR]` -> `--out DIR`.
    text = re.sub(r"(?<!\S)\[([^\[\]]*)\](?!\S)", r"\1", text).replace(" ...", "")
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        return None
    out: list[list[str]] = [[]]
    for token in tokens:
        if token == "&&":
            out.append([])
        else:
            out[-1].append(WORDS.get(token, token))
    return [argv for argv in out if argv]


def _program(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        key, _, value = argv[0].partition("=")
        env[key] = value
        argv = argv[1:]
    return env, argv


def _expand(argv: list[str]) -> list[list[str]]:
    """A synopsis' alternatives (`patch apply|verify|revert`), one command each."""
    for i, token in enumerate(argv):
        if "|" in token and re.fullmatch(r"[a-z-]+(\|[a-z-]+)+", token):
            return [
                c for alt in token.split("|") for c in _expand([*argv[:i], alt, *argv[i + 1 :]])
            ]
    return [argv]


def _commands_of(text: str, where: str, inline: bool = False) -> list[Command]:
    found = []
    for argv in _split(text) or []:
        env, argv = _program(argv)
        if not argv or argv[0] not in PROGRAMS:
            return []
        for one in _expand(argv):
            found.append(Command(where, tuple(one), tuple(sorted(env.items())), inline))
            # `HSEXTRACT_RUN="python3 bench/..." bash h200/run.sh`: the inner command too.
            if "HSEXTRACT_RUN" in env:
                found.extend(_commands_of(env["HSEXTRACT_RUN"], where))
    return found


def doc_commands(doc: str, mixed: list[str]) -> list[Command]:
    """Every command of one Markdown file: each line of a fenced block of commands, and
    each inline code span that starts with a program.  A block is either commands or a
    sample of output, never both (a mistyped command must not pass as output): the
    others go to ``mixed``."""
    text = (REPO / doc).read_text()
    commands: list[Command] = []
    fence = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
    for block in fence.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).splitlines()
        found = [_commands_of(line, f"{doc}:{first + i}") for i, line in enumerate(lines)]
        said = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if any(found) and len([f for f in found if f]) != len(said):
            mixed.append(f"{doc}:{first}")
        commands.extend(c for cmds in found for c in cmds)
    prose = fence.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in re.finditer(r"`([^`]+)`", prose):
        code = " ".join(span.group(1).split())
        if code in NOT_RUN or code.startswith(('"', "'")):
            continue  # a quoted span is a value (a default: `"python"`), not a command
        where = f"{doc}:{prose.count(chr(10), 0, span.start()) + 1}"
        commands.extend(_commands_of(code, where, inline=True))
    return commands


def config_comment_commands() -> list[Command]:
    """`#   snakemake ...` usage lines in the shipped configs' comments."""
    commands = []
    for path in sorted((REPO / "configs").glob("*.yaml")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            m = re.match(r"#\s+((?:snakemake|hsextract) .*)", line)
            if m:
                commands.extend(_commands_of(m.group(1), f"{path.relative_to(REPO)}:{i}"))
    return commands


MIXED: list[str] = []
COMMANDS = [c for doc in DOCS for c in doc_commands(doc, MIXED)] + config_comment_commands()


def _of(*programs: str) -> list[Command]:
    return [c for c in COMMANDS if c.argv[0] in programs]


def _ids(commands: list[Command]) -> list[str]:
    return [f"{c.where}:{' '.join(c.argv[:4])}" for c in commands]


RULES = {
    m.group(1)
    for path in [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]
    for m in re.finditer(r"^(?:rule|checkpoint) (\w+):", path.read_text(), re.M)
}


def test_every_doc_has_its_commands_found():
    # The extraction itself could fail silently: these are known to be there.
    found = {shlex.join(c.argv) for c in COMMANDS}
    for cmd in (
        "snakemake -j1 extract_all",
        "snakemake --profile profiles/slurm extract_all",
        "hsextract patch verify --sglang-root some/dir",
        "python bench/capture_gpu.py --engine reference --uniform",
        "bash h200/run.sh --group 1",
        "python3 bench/sglang_live.py",
    ):
        assert cmd in found, cmd
    assert len(_of("snakemake")) >= 10 and len(_of("hsextract")) >= 15
    assert not MIXED, f"fenced blocks mixing commands and other lines: {MIXED}"
    unfilled = [str(c) for c in COMMANDS if any(re.search(r"<\w", a) for a in c.argv)]
    assert not unfilled, f"placeholders this test does not fill (add them to ANGLED): {unfilled}"


def test_not_run_spans_are_still_there():
    text = " ".join(" ".join((REPO / doc).read_text().split()) for doc in DOCS)
    for span in NOT_RUN:
        assert f"`{span}`" in text, f"{span!r} left the docs: drop it from NOT_RUN"


def test_main_job_command_installs_only_the_package():
    """The embedded default's command installs what the main job needs, not the test
    extra (pytest, ruff, datasets, openai ...)."""
    demo_cmd = next(ln for ln in (REPO / "README.md").read_text().splitlines() if "-m venv" in ln)
    cmds = [c.argv for c in _commands_of(demo_cmd, "README.md")]
    assert cmds[-1] == ("snakemake", "-j1", "extract_all"), cmds
    pips = [argv for argv in cmds if argv[0] == "pip"]
    assert pips == [("pip", "install", "torch==2.13.0", "-e", ".")], pips


def test_ci_runs_the_readme_test_command_verbatim():
    lines = (REPO / "README.md").read_text().splitlines()
    demo_cmd, test_cmd = [line for line in lines[:30] if "python3 -m venv" in line]
    assert demo_cmd.endswith("snakemake -j1 extract_all")
    assert "pytest" in test_cmd
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci, ".ci/run must run the README's test command exactly as written"


# --- snakemake ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> dict:
    """What the README's commands expect in the checkout: the demo's config.yaml, the
    profiles, and the production config (`configs/...`, `my.yaml`) set up as the README
    says (`model.path`, `inputs`, output root) with a DeepSeek-V3 config.json and 3 shards."""
    from transformers import DeepseekV3Config

    root = tmp_path_factory.mktemp("readme")
    work = root / "checkout"
    work.mkdir()
    (work / "config.yaml").write_text((REPO / "config.yaml").read_text())
    (work / "profiles").symlink_to(REPO / "profiles")
    model = root / "DeepSeek-V3"
    model.mkdir()
    DeepseekV3Config().to_json_file(model / "config.json")
    (root / "shards").mkdir()
    for i in range(3):
        (root / "shards" / f"part-{i}.jsonl").write_text(
            '{"input_ids": [1, 2], "loss_mask": [0, 1]}\n'
        )
    (work / "configs").mkdir()
    # Every shipped config, pointed at the stand-in model and shards ("set model.path,
    # inputs ..." as their comments say); my.yaml is the README's copy of the DeepSeek one.
    for src in sorted((REPO / "configs").glob("*.yaml")):
        prod = yaml.safe_load(src.read_text())
        prod["model"]["path"] = str(model)
        prod["inputs"] = [str(root / "shards" / "*.jsonl")]
        prod["output_root"] = str(root / "out")
        names = [f"configs/{src.name}"]
        if src.name == "deepseek-v3-8xh200.yaml":
            names.append("my.yaml")
        for name in names:
            (work / name).write_text(yaml.safe_dump(prod))
    return {"dir": work, "fp": run_dir_of(work).name}


def _fill(argv: tuple[str, ...], fp: str) -> list[str]:
    return [a.replace("FP", fp) for a in argv]


SNAKEMAKE = _of("snakemake")


@pytest.mark.parametrize("cmd", SNAKEMAKE, ids=_ids(SNAKEMAKE))
def test_snakemake_command_parses_as_written(cmd: Command, workdir, monkeypatch):
    """Snakemake's own parser, with the profiles the command names: each target is a rule
    or a file, each config file exists."""
    from snakemake.cli import parse_args

    monkeypatch.chdir(workdir["dir"])
    argv = _fill(cmd.argv[1:], workdir["fp"])
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            _, args = parse_args(["-s", str(REPO / "Snakefile"), *argv])
    except SystemExit as exc:
        raise AssertionError(f"{cmd}: snakemake refuses it: {err.getvalue()}") from exc
    for cf in args.configfile or []:
        assert Path(cf).is_file(), (
            f"{cmd}: {str(cf)!r} is read as a config file (--configfile takes every word "
            "after it): put the targets before --configfile"
        )
    for target in args.targets or []:
        assert target in RULES or "/" in target, f"{cmd}: target {target!r} is no rule"


def _plan_of(argv: tuple[str, ...]) -> tuple[str, ...]:
    """The command without `-s <checkout>/Snakefile`: the dry run names that file anyway,
    so a command from the user's own directory plans what the same one in the checkout does."""
    out = list(argv)
    for i in range(len(out) - 1):
        if out[i] == "-s" and out[i + 1] == str(REPO / "Snakefile"):
            del out[i : i + 2]
            break
    return tuple(out)


# Each distinct command once; --report needs a finished run: tests/test_report.py runs it.
_FIRST = {_plan_of(c.argv): c for c in reversed(SNAKEMAKE) if "--report" not in c.argv}
DRY = list(_FIRST.values())[::-1]


# What a command needs beyond the shipped config, as the README says beside it.
NEEDS = {"export_speculators": ("needs prenorm_final: true", ["--config", "prenorm_final=true"])}


@pytest.mark.parametrize("cmd", DRY, ids=_ids(DRY))
def test_snakemake_command_dry_runs(cmd: Command, workdir):
    argv = _fill(cmd.argv[1:], workdir["fp"])
    for target, (said, extra) in NEEDS.items():
        if target in argv:
            doc, line = cmd.where.rsplit(":", 1)
            assert said in (REPO / doc).read_text().splitlines()[int(line) - 1], cmd
            argv += extra
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", *argv, "-s", str(REPO / "Snakefile"), "-n"],
        cwd=workdir["dir"], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


# --- hsextract, bench scripts, the rest ---------------------------------------------------

HSEXTRACT = _of("hsextract")


@pytest.mark.parametrize("cmd", HSEXTRACT, ids=_ids(HSEXTRACT))
def test_hsextract_command_parses(cmd: Command):
    """hsextract's own parser.  Prose may name a subcommand without its arguments
    (`hsextract verify` re-derives ...): there nothing is required, but every word given
    must parse."""
    from hsextract.cli import build_parser

    parser = build_parser()
    if cmd.inline:
        _nothing_required(parser)
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            parser.parse_args(list(cmd.argv[1:]))
    except SystemExit as exc:
        raise AssertionError(f"{cmd}: {err.getvalue()}") from exc


# The cheap ones, run as printed in the README's workdir: they read a config and change
# nothing (server start/stop, export and verify need a run; tests/test_cli.py runs them).
CHEAP = ("run-dir", "plan", "status", "server command", "server status", "--help")
RUN_CHEAP = list(
    {
        c.argv: c
        for c in HSEXTRACT
        if not c.inline and any(" ".join(c.argv[1:]).startswith(w) for w in CHEAP)
    }.values()
)


@pytest.mark.parametrize("cmd", RUN_CHEAP, ids=_ids(RUN_CHEAP))
def test_hsextract_command_runs_as_printed(cmd: Command, workdir):
    """Each ends in its output or one sentence (`plan` before the data stage, `server
    status` with no server), never a traceback; a command that sentence suggests parses."""
    from snakemake.cli import parse_args

    proc = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", *_fill(cmd.argv[1:], workdir["fp"])],
        cwd=workdir["dir"], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr, f"{cmd}:\n{proc.stderr[-3000:]}"
    if proc.returncode != 0:
        allowed = cmd.argv[1:3] == ("server", "status") and proc.returncode == 1
        assert allowed or proc.stderr.startswith("hsextract: error: "), f"{cmd}: {proc.stderr}"
    for hint in re.findall(r"(?:^|`|: )(snakemake -j1 [^`\n]*)", proc.stdout + proc.stderr):
        with contextlib.redirect_stderr(io.StringIO()):
            parse_args(shlex.split(hint)[1:])


def _nothing_required(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _nothing_required(sub)
        elif not action.option_strings and action.nargs is None:
            action.nargs = "?"  # a positional; its choices are still checked
        action.required = False


BENCH = [
    c
    for c in _of(*PYTHONS)
    # tests/stream_trainer.py: the README's example trainer for a streamed run.
    if c.argv[1].startswith(("bench/", "patches/", "tests/stream_trainer.py"))
    or c.argv[1:3] == ("-m", "hsextract.settings")
]

# Runs each bench (and patches/) script as __main__ up to its argparse: parse_args parses,
# then stops the script there, so nothing is measured.
_PARSE_ONLY = """
import argparse, contextlib, io, json, runpy, sys
class Parsed(Exception):
    pass
parse = argparse.ArgumentParser.parse_args
def parse_then_stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise Parsed
argparse.ArgumentParser.parse_args = parse_then_stop
out = {}
for argv in json.loads(sys.argv[1]):
    module = argv[1] if argv[0] == "-m" else None
    sys.argv = argv[1:] if module else argv
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(argv[0], run_name="__main__")
        out[" ".join(argv)] = "the script never parsed its arguments"
    except Parsed:
        out[" ".join(argv)] = "ok"
    except SystemExit as exc:
        out[" ".join(argv)] = f"exit {exc.code}: {err.getvalue()}"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def bench_parsed() -> dict[str, str]:
    argvs = sorted({c.argv[1:] for c in BENCH})
    proc = subprocess.run(
        [sys.executable, "-c", _PARSE_ONLY, json.dumps(argvs)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("cmd", BENCH, ids=_ids(BENCH))
def test_bench_command_parses(cmd: Command, bench_parsed):
    assert bench_parsed[" ".join(cmd.argv[1:])] == "ok", f"{cmd}: {bench_parsed}"


PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _pins() -> dict[str, str]:
    reqs = PYPROJECT["dependencies"] + [
        r for extra in PYPROJECT["optional-dependencies"].values() for r in extra
    ]
    return {m.group(1): m.group(2) for r in reqs if (m := re.fullmatch(r"([\w.-]+)==(\S+)", r))}


OTHER = [c for c in COMMANDS if c not in SNAKEMAKE + HSEXTRACT + BENCH]


@pytest.mark.parametrize("cmd", OTHER, ids=_ids(OTHER))
def test_other_command_names_what_exists(cmd: Command):
    """pip: the extras exist and a version the project pins is that pin; bash: the script
    exists, a `-k` selects a live test, a `--group` is one; pytest: markers are registered."""
    argv = list(cmd.argv)
    if argv[0] == "pip":
        assert argv[1] == "install", cmd
        pins = _pins()
        for arg in argv[2:]:
            if m := re.fullmatch(r"\.\[([\w,]+)\]", arg):
                for extra in m.group(1).split(","):
                    assert extra in PYPROJECT["optional-dependencies"], f"{cmd}: no extra {extra}"
            name, _, version = arg.partition("==")
            if version and name in pins:
                assert version == pins[name], f"{cmd}: pyproject pins {name}=={pins[name]}"
    elif argv[0] == "bash":
        assert (REPO / argv[1]).is_file(), cmd
        live = " ".join(p.read_text() for p in (REPO / "tests" / "live").glob("test_*.py"))
        for i, arg in enumerate(argv[:-1]):
            if arg == "-k":
                assert f"def test_{argv[i + 1]}" in live or argv[i + 1] in live, cmd
            if arg == "--group":  # a group of tests/live/conftest.py's GROUPS
                groups = (REPO / "tests" / "live" / "conftest.py").read_text()
                assert f'    "{argv[i + 1]}": (' in groups, cmd
    elif argv[0] in PYTHONS and argv[1:3] == ["-m", "pytest"]:
        markers = {m.split(":")[0] for m in tomllib.loads((REPO / "pyproject.toml").read_text())[
            "tool"]["pytest"]["ini_options"]["markers"]}  # fmt: skip
        for i, arg in enumerate(argv[:-1]):
            if arg == "-m" and i > 2:
                words = set(re.findall(r"\w+", argv[i + 1])) - {"not", "and", "or"}
                assert words <= markers, f"{cmd}: unregistered marker {words - markers}"
    else:
        # python3 -m venv, `.` (activate), apt-get: nothing of ours to check them against.
        assert argv[0] in ("apt-get", ".") or argv[1:3] == ["-m", "venv"], f"unchecked: {cmd}"


# --- links ---------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_every_link_between_the_docs_lands():
    """README's "what to read next" and the pages' cross-references: each relative link
    names a file that exists, and an anchor a heading of it (a page moved or a section
    renamed breaks a newcomer's path silently otherwise)."""
    broken = []
    for doc in DOCS:
        text = re.sub(r"^```.*?^```", "", (REPO / doc).read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            file, _, anchor = target.partition("#")
            path = (REPO / doc).parent / file if file else REPO / doc
            if not path.exists():
                broken.append(f"{doc}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{doc}: {target} (no such heading)")
    assert not broken, broken
