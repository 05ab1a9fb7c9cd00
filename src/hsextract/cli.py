"""``hsextract``: the commands the rules use, for people too.

hsextract patch apply|verify|revert --sglang-root DIR
hsextract gpu-gate [--max-used-mib N] [--wait-s S]
hsextract server command|start|status|stop [--configfile F] [--config key=value ...]
hsextract inspect CHUNK_FILE
hsextract verify MANIFEST
hsextract plan [--configfile F]
hsextract run-dir [--configfile F]
hsextract export specforge --manifest M [--out DIR] [--gzip]
hsextract export speculators --manifest M [--out DIR]      (needs prenorm_final: true)
hsextract status [--configfile F] [--json] [--window S] [--watch [S]]
hsextract stream gc [--configfile F]      (stream.budget_gb: free payloads the trainer acked)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hsextract.commands import hsextract_command, snakemake_command
from hsextract.errors import HsextractError
from hsextract.interrupt import INTERRUPTED_EXIT, interrupted_message
from hsextract.procs import pid_alive

if TYPE_CHECKING:
    from hsextract.config import Config

#: A command whose output pipe closed early exits as a shell reports SIGPIPE's end.
BROKEN_PIPE_EXIT = 128 + signal.SIGPIPE


def _load(args: argparse.Namespace) -> Config:
    """The config of ``--configfile``/``--config``, read as Snakemake reads them; and the
    sources every command this process prints is rendered with (hsextract.commands)."""
    from hsextract.commands import set_current, sources_of
    from hsextract.config import read_config, run_dir

    overrides = parse_config_entries(args.config or [])
    cfg = read_config(args.configfile, overrides)
    set_current(sources_of(args.configfile, overrides, run_dir(cfg)))
    return cfg


def parse_config_entries(entries: list[str]) -> dict:
    """``--config`` entries parsed by Snakemake's own parser: an entry either takes works
    in both.  Snakemake refuses a dotted key (``server.port=30000``: "Invalid config
    definition"), so it is refused here too, naming the form both take."""
    if not entries:
        return {}  # Snakemake's parser costs its whole CLI's import (seconds)
    from snakemake.cli import parse_config

    from hsextract.commands import config_entry

    for entry in entries:
        key, eq, value = entry.partition("=")
        if eq and "." in key:
            path = key.split(".")
            nested = config_entry(path, yaml.safe_load(value) if value else None)
            raise HsextractError(
                f"--config {entry}: Snakemake takes no dotted keys, so neither does hsextract; "
                f"write it as --config {shlex.quote(nested)} (works in both)"
            )
    try:
        return parse_config(entries)
    except ValueError as exc:
        raise HsextractError(
            f"--config {' '.join(map(shlex.quote, entries))}: {exc}; write each entry as "
            "KEY=VALUE, a group as KEY='{sub: value}' (e.g. server='{port: 30000}')"
        ) from None


def _add_config_args(p: argparse.ArgumentParser) -> None:
    # As Snakemake reads them (hsextract.config.load_config): the files given, else
    # ./config.yaml; never one beneath the other.
    p.add_argument(
        "--configfile",
        nargs="+",
        metavar="F",
        help="workflow config file(s), merged in order (default: ./config.yaml)",
    )
    p.add_argument(
        "--config",
        nargs="*",
        metavar="KEY=VALUE",
        help="overrides, as Snakemake's: KEY=VALUE, a group as KEY='{sub: value}'",
    )


def shell_command(env: dict[str, str], argv: list[str]) -> str:
    """The env and argv as lines that work when pasted into a POSIX shell.

    Every token is quoted literally except the API key placeholder, which must expand:
    single-quoted, SGLang would start with the literal text ``${HSEXTRACT_API_KEY}`` as its
    key.  It is emitted double-quoted, so the key stays out of the printed command.
    """
    import shlex

    from hsextract.server import API_KEY_ENV, API_KEY_PLACEHOLDER

    def q(token: str) -> str:
        return f'"${API_KEY_ENV}"' if token == API_KEY_PLACEHOLDER else shlex.quote(token)

    lines = [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    return "\n".join([*lines, " ".join(q(a) for a in argv)])


def _server(args: argparse.Namespace) -> int:
    from hsextract import server
    from hsextract.config import run_dir

    cfg = _load(args)
    rd = run_dir(cfg)
    state_dir = rd / "state"
    spec = server.build_spec(cfg, run_dir=rd, log_path=rd / "logs" / "server.log")
    if args.action == "command":
        if spec.api_key_env:
            print(f"# needs the API key in ${spec.api_key_env}")
        print(shell_command(spec.env, spec.argv))
        return 0
    if args.action == "status":
        state = server.read_json(server.live_path(state_dir))
        alive = server.is_serving(state, spec)
        loading = server.starting(state, spec) and not alive
        stale = bool(state) and not alive and not loading and pid_alive(state.get("pid"))
        print(
            json.dumps(
                {
                    "run_dir": str(rd),
                    "serving": alive,
                    # alive but with other settings (or unhealthy): ensure() replaces it
                    "stale": stale,
                    # alive, loading its model: chunk jobs wait for it
                    "starting": loading,
                    # its start failed (state.failed says why)
                    "failed": (state or {}).get("failed"),
                    "state": state,
                },
                indent=2,
                default=str,
            )
        )
        return 0 if alive else 1
    if args.action == "stop":
        print("stopped" if server.stop_live(state_dir) else "no live server for this run")
        return 0
    if args.action == "start":
        from hsextract.steps import ensure_server

        # Owned by $HSEXTRACT_OWNER_PID when set (a workflow, a test); else it runs until
        # `server stop`: the shell that ran this may end the next moment (a script).
        state = ensure_server(cfg, detached=server.inherited_owner() is None)
        stop = hsextract_command("server", "stop")
        owner = state.get("owner_pid")
        lives = (
            f"until process {owner} (its owner) ends, or `{stop}`" if owner else f"until `{stop}`"
        )
        print(json.dumps({"url": state["url"], "pid": state["pid"], "runs": lives}))
        print(f"hsextract: the server at {state['url']} (pid {state['pid']}) runs {lives}",
              file=sys.stderr)  # fmt: skip
        return 0
    raise AssertionError(args.action)


def _inspect(args: argparse.Namespace) -> int:
    from hsextract.chunks import inspect_text

    print(inspect_text(args.chunk))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from hsextract.manifest import verify_manifest

    path = manifest_path(Path(args.manifest))
    problems = verify_manifest(path)
    for p in problems:
        print(p)
    chunks = json.loads(path.read_text()).get("chunks") or []
    freed = sum(1 for c in chunks if isinstance(c, dict) and c.get("deleted_after_ack"))
    if freed and not problems:
        print(
            f"{freed} chunk(s) deleted after the trainer's ack (stream.budget_gb): checked "
            "against their receipts (sidecar, deletion record, index), not re-hashed"
        )
    print("ok: every chunk matches the manifest" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


def manifest_path(path: Path) -> Path:
    """The manifest ``verify`` was pointed at, checked before any of it is trusted.

    A run dir holding a ``manifest.json`` stands for it.  A path that is missing, a
    directory that is not a run, a file that is not JSON or JSON that is no manifest ends
    in one sentence naming it and what to pass instead: the checks below read the fields
    of a manifest, and on anything else they fail with a traceback.
    """
    run_dir_cmd = hsextract_command("run-dir", run_dir=path if path.is_dir() else None)
    hint = f"pass the manifest.json of a run (`{run_dir_cmd}` prints the run dir)"
    if path.is_dir():
        if not (path / "manifest.json").is_file():
            raise HsextractError(
                f"{path} is a directory without a manifest.json: not a finished run; {hint}, "
                f"or run `{snakemake_command('extract_all', run_dir=path)}` to finish it"
            )
        path = path / "manifest.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise HsextractError(f"{path} does not exist; {hint}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HsextractError(f"cannot read {path} ({exc}); {hint}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise HsextractError(f"{path} is not JSON ({exc}), so not a manifest; {hint}") from None
    if not isinstance(data, dict) or not isinstance(data.get("chunks"), list):
        raise HsextractError(
            f"{path} is JSON but not an hsextract manifest (no list of chunks); {hint}"
        )
    return path


def _plan(args: argparse.Namespace) -> int:
    """Which chunks the next run re-extracts, from the current split; touches nothing."""
    from hsextract.config import fingerprint, run_dir
    from hsextract.plan import changed_inputs, chunk_states, later_pass_states
    from hsextract.sizing import chunk_sizing, sizing_report

    cfg = _load(args)
    sizing = chunk_sizing(cfg)
    print("\n".join(sizing_report(cfg, sizing)))
    rd = run_dir(cfg)
    index = rd / "chunks" / "index.json"
    if not index.exists():
        raise HsextractError(
            f"{index} does not exist yet: run the data stage first (CPU only): "
            f"{snakemake_command(index)}"
        )
    states = chunk_states(rd, index, fingerprint(cfg))
    todo = [s for s in states if not s.current]
    stats = rd / "merged" / "stats.json"
    changed = changed_inputs(cfg, json.loads(stats.read_text())) if stats.exists() else []
    print(
        f"{rd}: {len(todo)} of {len(states)} chunk(s) to extract, {len(states) - len(todo)} current"
    )
    for s in todo + later_pass_states(rd, index, fingerprint(cfg)):
        print(f"  {s.chunk}: {s.reason}")
    if changed:
        # Which chunks a changed shard touches is known only once the merge and split
        # have rerun: say so instead of calling the old split's chunks current.
        print(f"inputs changed since the merge ({len(changed)}):")
        for line in changed:
            print(f"  {line}")
        print(
            "the next run re-merges; to see the chunks they change: "
            f"`{snakemake_command(index)}`, then this again"
        )
    else:
        print(
            "(from the split as it is now; if settings changed since, run "
            f"`{snakemake_command(index)}` first)"
        )
    return 0


def _status(args: argparse.Namespace) -> int:
    """Where the config's run stands (chunks, tokens, rates, ETA, server, last error)."""
    from hsextract.commands import current, set_current
    from hsextract.config import locate_run

    cfg = _load(args)
    rd, base = locate_run(cfg, args.configfile)
    here = current()
    if base is not None and here is not None:
        # Made in another directory: the commands it suggests run there.
        set_current(replace(here, workdir=base, run_dir=str(Path(cfg.output_root) / rd.name)))
    if args.watch is None:
        _status_report(cfg, args, base)
        return 0
    # Redrawn every --watch seconds until the run is whole and nothing runs it (then it
    # cannot change), or Ctrl-C, which is how a watch is left: not an interruption.
    tty = sys.stdout.isatty() and not args.json
    try:
        while True:
            if tty:
                print("\x1b[H\x1b[2J", end="")  # clear the terminal, cursor home
            st = _status_report(cfg, args, base)
            if st.finished and not st.workflow_pids:
                return 0
            if not tty:
                print(f"-- next in {args.watch:g}s (Ctrl-C ends the watch)", flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def _status_report(cfg: Config, args: argparse.Namespace, base: str | None) -> Any:
    """One status report printed; returns the :class:`hsextract.status.Status`."""
    from hsextract import status

    st = status.collect(cfg, window_s=args.window, base=base)
    stream = _stream_summary(cfg, Path(st.run_dir))
    if args.json:
        print(json.dumps({**st.to_json(), **({"stream": stream} if stream else {})}, indent=2))
    else:
        print(status.render(st))
        if stream:
            from hsextract.stream.gate import waiting_text

            paused = "paused, chunk jobs wait" if stream["paused"] else "open"
            print(f"stream: {waiting_text(stream)}; gate {paused}")
            if stream["acked_on_disk"]:
                print(
                    f"stream: {stream['acked_on_disk']} payload(s) acknowledged by the trainer, "
                    f"{stream['acked_on_disk_bytes'] / 1e9:.3g} GB, still on disk: the next "
                    f"chunk job's gate deletes them, or now `{hsextract_command('stream', 'gc')}`"
                )
    sys.stdout.flush()
    return st


def _stream(args: argparse.Namespace) -> int:
    """``stream gc``: delete the payloads the trainer acked since the last chunk job
    looked (stream.gate.gc: the producer's own rules), say what it freed and left."""
    from hsextract.config import run_dir
    from hsextract.stream.gate import gc, settings_of

    cfg = _load(args)
    ss = settings_of(cfg)
    rd = run_dir(cfg)
    if ss is None:
        raise HsextractError(
            f"{rd}: stream.budget_gb is null in this config, so its run has no stream and "
            "nothing is deleted after a trainer's ack; pass the config the run streamed with"
        )
    if not (rd / "stream").is_dir():
        raise HsextractError(f"{rd} has no stream/ dir: no chunk was announced to a trainer yet")
    got = gc(rd, ss)
    for path, why in got["left"]:
        print(f"left {path}: {why}")
    print(
        f"freed {len(got['deleted'])} payload(s) acknowledged by the trainer, "
        f"{got['freed_bytes'] / 1e9:.3g} GB ({rd})"
    )
    return 0


def _stream_summary(cfg: Config, rd: Path) -> dict | None:
    """Train while extracting: what waits for the trainer (None for an offline run)."""
    from hsextract.stream.gate import settings_of, summary

    ss = settings_of(cfg)
    if ss is None:
        return None
    return summary(rd, ss.final_pass, budget_bytes=ss.budget_bytes)


def _run_dir(args: argparse.Namespace) -> int:
    from hsextract.config import run_dir

    print(run_dir(_load(args)))
    return 0


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of ``argv``'s command (every command's in full without ``argv``)."""
    from hsextract import gpu
    from hsextract.sglang import patching

    parser = argparse.ArgumentParser(
        prog="hsextract", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    patching.register_cli(sub)
    gpu.register_cli(sub)
    p = sub.add_parser("server", help="the extraction server of a config's run")
    p.add_argument("action", choices=["command", "start", "status", "stop"])
    _add_config_args(p)
    p.set_defaults(func=_server)
    p = sub.add_parser("inspect", help="print a chunk file's metadata and shapes")
    p.add_argument("chunk")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("verify", help="re-hash every chunk of a manifest")
    p.add_argument("manifest")
    p.set_defaults(func=_verify)
    p = sub.add_parser("plan", help="which chunks the next run re-extracts (reads only)")
    _add_config_args(p)
    p.set_defaults(func=_plan)
    p = sub.add_parser("status", help="progress, rate, ETA, server and last error of a run")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    p.add_argument(
        "--window", type=float, default=300.0, help="seconds of the recent rate (%(default)s)"
    )
    p.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=10.0,
        metavar="S",
        help="report again every S seconds (default 10) until the run is finished; Ctrl-C ends it",
    )
    p.set_defaults(func=_status)
    p = sub.add_parser("stream", help="train while extracting (stream.budget_gb)")
    p.add_argument(
        "action",
        choices=["gc"],
        help="gc: delete the payloads the trainer acknowledged (the producer's own rules)",
    )
    _add_config_args(p)
    p.set_defaults(func=_stream)
    p = sub.add_parser("run-dir", help="print the run directory (fingerprint) of a config")
    _add_config_args(p)
    p.set_defaults(func=_run_dir)
    p = sub.add_parser("export", help="write a finished run in a trainer's format")
    export_formats = p.add_subparsers(dest="format", required=True)
    if argv is None or _command_of(argv) == "export":
        # `hsextract export FORMAT ...`: each export module registers its format's
        # subcommand.  Only for an export: they import torch (seconds), which a `status`
        # polled from a script, or `--help`, must not pay.
        from hsextract.export import specforge as specforge_export
        from hsextract.export import speculators as speculators_export

        specforge_export.register_cli(export_formats)
        speculators_export.register_cli(export_formats)
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is no option)."""
    return next((w for w in argv if not w.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its failures end in one sentence on stderr, never a traceback.

    An :class:`HsextractError` carries the sentence.  A file the command could not read
    (a config or state file missing, unreadable, or not YAML) is named by the error
    itself; a YAML error is one here only because the config loader did not catch it, so
    it says which file the command was given.  Ctrl-C prints what was left unfinished and
    exits 130, as a shell reports a command SIGINT ended.  Anything else is a bug and keeps
    its traceback.
    """
    from hsextract.commands import set_current

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HsextractError as exc:
        print(f"hsextract: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`| head`): what it wanted it has; nothing to report, and
        # Python's own flush at exit must not fail on the closed pipe again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE_EXIT
    except KeyboardInterrupt:
        what = f"hsextract {args.command}"
        print(f"hsextract: {interrupted_message(what)}", file=sys.stderr)
        return INTERRUPTED_EXIT
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        print(
            f"hsextract: error: cannot use{where}: {exc.strerror or exc}; make it readable "
            "and writable by this user, or set the config's paths (output_root, dump.dir) "
            "to a place that is",
            file=sys.stderr,
        )
        return 1
    except yaml.YAMLError as exc:
        given = ", ".join(getattr(args, "configfile", None) or ["./config.yaml"])
        print(f"hsextract: error: config file {given} is not valid YAML: {exc}", file=sys.stderr)
        return 1
    finally:
        set_current(None)


if __name__ == "__main__":
    sys.exit(main())
