"""The commands hsextract prints for the user to run, rendered with the config they ran.

A hint such as "rerun `snakemake -j1 <chunk>`" printed bare failed as printed whenever the
run came from ``--configfile my.yaml``: Snakemake read the working directory's
``config.yaml`` instead (the demo's, in the project: its run, not the user's), or none
(outside the project, ``MissingRuleException``).  So every command a message suggests is
rendered here, from the sources of the config the run was made with: its ``--configfile``
files (absolute), its ``--config`` entries, the directory it ran in (a relative
``output_root`` or ``model.path`` means something there only), and ``-s`` with the
project's Snakefile when that directory holds no Snakefile of this project.

Where the sources come from: the process that loaded the config says them
(:func:`set_current`: the CLI for its own messages; rules/common.smk in the environment
too, so every job of the workflow inherits them); a process that holds only a run dir
(``hsextract verify``, a trainer's ``ManifestDataset``) reads what the workflow recorded
there at its start (:func:`record`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from hsextract.settings import GROUPS, SETTINGS

#: The environment variable carrying the current config's sources to the workflow's jobs.
SOURCES_ENV = "HSEXTRACT_CONFIG_SOURCES"
#: Where a run dir records the sources of the workflow that last ran it.
RECORD = Path("state") / "config_sources.json"
#: The project's Snakefile (beside src/, as schemas/ is: hsextract.config.SCHEMA_PATH).
SNAKEFILE = Path(__file__).resolve().parents[2] / "Snakefile"


@dataclass(frozen=True)
class ConfigSources:
    """What a command must be given to read the same config as the run it is about."""

    workdir: str  # absolute: where relative paths of the config resolve
    configfiles: tuple[str, ...]  # absolute; none: the workdir's config.yaml
    config: tuple[str, ...]  # --config entries as Snakemake reads them: 'server={port: 0}'
    run_dir: str = ""  # as the workflow names it (relative when output_root is)


def config_entry(path: list[str], value: Any) -> str:
    """``server={port: 1}``: one key's ``--config`` entry as Snakemake reads it (a group as
    a YAML flow mapping, which its parser and ``hsextract.config.load_config`` both take)."""

    def flow(v: Any, top: bool = False) -> str:
        if isinstance(v, Mapping):
            return "{" + ", ".join(f"{k}: {flow(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list | tuple):
            return "[" + ", ".join(flow(x) for x in v) + "]"
        if v is None or isinstance(v, bool):
            return json.dumps(v)
        text = str(v)
        plain = top or re.fullmatch(r"[\w./@+~-][\w./@+~ -]*", text) is not None
        return text if plain else json.dumps(text)

    for key in reversed(path[1:]):
        value = {key: value}
    return f"{path[0]}={flow(value, top=True)}"


def sources_of(
    configfiles: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None,
    overrides: Mapping[str, Any] | None,
    run_dir: str | os.PathLike[str] = "",
) -> ConfigSources:
    """The sources of a config read from ``configfiles`` and ``overrides`` here, now."""
    if isinstance(configfiles, str | os.PathLike):
        configfiles = [configfiles]
    return ConfigSources(
        workdir=os.getcwd(),
        configfiles=tuple(os.path.abspath(f) for f in configfiles or ()),
        config=tuple(config_entry([str(k)], v) for k, v in (overrides or {}).items()),
        run_dir=str(run_dir),
    )


_current: ConfigSources | None = None


def set_current(sources: ConfigSources | None, *, export: bool = False) -> None:
    """Make ``sources`` what this process renders with; with ``export`` (the workflow),
    every process it starts too.  None forgets them (the CLI, once its command is done:
    a test calling it in-process must not leave its config to the next)."""
    global _current
    _current = sources
    if export and sources is not None:
        os.environ[SOURCES_ENV] = json.dumps(asdict(sources))


def current() -> ConfigSources | None:
    """The sources set by this process or the workflow it runs under, if any."""
    return _current or _parse(os.environ.get(SOURCES_ENV))


def record(run_dir: str | os.PathLike[str], sources: ConfigSources) -> None:
    """Record in a run dir the sources of the workflow running it (temp name + rename)."""
    path = Path(run_dir) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(sources), indent=2) + "\n")
    os.replace(tmp, path)


def recorded(run_dir: str | os.PathLike[str]) -> ConfigSources | None:
    """The sources a run dir's last workflow recorded, where the run dir is now.

    A run dir copied or moved with its project (a relative output_root: the recorded
    ``run_dir`` is the tail of its path) is rendered from the directory it is in now, with
    the config files that were inside the old one found inside the new one.  Anywhere else
    (an absolute output_root moved, no record): None, so no command points at the
    original run, whose chunks it would redo.
    """
    try:
        src = _parse((Path(run_dir) / RECORD).read_text())
    except OSError:
        return None
    if src is None or not src.run_dir:
        return None
    here = Path(os.path.realpath(run_dir))
    if _same(Path(src.workdir, src.run_dir), here):
        return src
    tail = Path(src.run_dir).parts
    if Path(src.run_dir).is_absolute() or here.parts[-len(tail) :] != tail:
        return None
    new, old = here.parents[len(tail) - 1], Path(src.workdir)
    files = tuple(
        str(new / Path(f).relative_to(old)) if Path(f).is_relative_to(old) else f
        for f in src.configfiles
    )
    return replace(src, workdir=str(new), configfiles=files)


def _parse(text: str | None) -> ConfigSources | None:
    if not text:
        return None
    try:
        data = json.loads(text)
        return ConfigSources(
            workdir=str(data["workdir"]),
            configfiles=tuple(str(f) for f in data.get("configfiles", ())),
            config=tuple(str(e) for e in data.get("config", ())),
            run_dir=str(data.get("run_dir", "")),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


#: Kinds of setting whose ``--config`` override belongs to the workflow that gave it, not
#: to the run (hsextract.settings): read when used, or an export's own.
ONE_OFF_KINDS = frozenset({"neither", "export"})


def sources_for(run_dir: str | os.PathLike[str] | None = None) -> ConfigSources | None:
    """The sources to render with: the current process's, else those ``run_dir`` recorded,
    less the overrides that belong to the workflow that recorded them (:func:`run_own`)."""
    here = current()
    if here is not None or run_dir is None:
        return here
    src = recorded(run_dir)
    return None if src is None else replace(src, config=run_own(src.config))


def run_own(entries: Sequence[str]) -> tuple[str, ...]:
    """The ``--config`` entries that make the run what it is.

    A run dir records the sources of the last workflow that ran jobs for it, whatever that
    workflow was for: ``snakemake -j1 export_speculators --config 'export={...}'`` or a
    debugging ``client={sending_jobs: 1}``.  Advice rendered from that record (a chunk to
    redo, from ``verify`` or a trainer's reader) re-applied those one-offs to a command
    that has nothing to do with them.  Overrides of every other kind are the run's own:
    without them the redo would read another run, or rerun its stages.  A key hsextract
    does not declare is kept (Snakemake's validation names it, as it did for the run).
    """
    kept = []
    for entry in entries:
        key, sep, text = entry.partition("=")
        try:
            value = yaml.safe_load(text) if sep else None
        except yaml.YAMLError:
            kept.append(entry)
            continue
        own = _own_part([key], value)
        if own is _DROP:
            continue
        kept.append(entry if own == value else config_entry([key], own))
    return tuple(kept)


_DROP = object()


def _own_part(path: list[str], value: Any) -> Any:
    """``value`` at ``path`` less its one-off settings (``_DROP``: nothing is left)."""
    key = ".".join(path)
    if key in SETTINGS:
        return _DROP if set(SETTINGS[key].kinds) <= ONE_OFF_KINDS else value
    if key not in GROUPS or not isinstance(value, Mapping):
        return value
    own = {k: v for k, x in value.items() if (v := _own_part([*path, str(k)], x)) is not _DROP}
    return own or _DROP


def snakemake_command(
    *args: str | os.PathLike[str], run_dir: str | os.PathLike[str] | None = None
) -> str:
    """``snakemake -j1 ARGS`` as it works pasted into the user's shell, here: with the
    config's files and overrides, ``-s`` where the directory has no project Snakefile, and
    ``cd DIR &&`` first when the run was made from another directory.  A path among
    ``args`` is a target: written as the workflow names it (relative to the directory it
    runs in when output_root is relative), or Snakemake finds no rule for it."""
    src = sources_for(run_dir)
    where = Path(src.workdir) if src else Path.cwd()
    argv = ["snakemake", "-j1", *(_target(a, src) for a in args)]
    if not _same(where / "Snakefile", SNAKEFILE):
        argv += ["-s", str(SNAKEFILE)]
    return _render(argv, src, where)


def hsextract_command(
    *args: str | os.PathLike[str],
    run_dir: str | os.PathLike[str] | None = None,
    with_config: bool = True,
) -> str:
    """``hsextract ARGS --configfile ... --config ...`` for a subcommand that reads the
    config (server, plan, status, stream, run-dir), as it works pasted here; ``with_config=False``
    for one that takes paths only (export, verify, inspect): its arguments, quoted."""
    argv = ["hsextract", *(str(a) for a in args)]
    if not with_config:
        return shlex.join(argv)
    src = sources_for(run_dir)
    return _render(argv, src, Path(src.workdir) if src else Path.cwd())


def _render(argv: list[str], src: ConfigSources | None, where: Path) -> str:
    if src is not None:
        # Targets go before these: --configfile and --config take every word after them.
        if src.configfiles:
            argv += ["--configfile", *src.configfiles]
        if src.config:
            argv += ["--config", *src.config]
    line = shlex.join(argv)
    if not _same(where, Path.cwd()):
        line = f"cd {shlex.quote(str(where))} && {line}"
    return line


def _target(arg: str | os.PathLike[str], src: ConfigSources | None) -> str:
    if not isinstance(arg, os.PathLike) or src is None or not src.run_dir:
        return str(arg)
    run = Path(src.workdir, src.run_dir)
    try:
        rel = Path(os.path.realpath(arg)).relative_to(os.path.realpath(run))
    except ValueError:
        return str(arg)  # not of this run: as given
    return str(Path(src.run_dir) / rel)


def _same(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)
