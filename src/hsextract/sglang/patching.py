"""Apply, verify and revert the SGLang dump patch, refusing any file that is not the pinned one.

Each supported release has its patch: a unified diff under ``patches/sglang-<version>/``
with a ``manifest.json`` recording the target file and its pristine and patched sha256.
The installed release is read from the package itself (``_version.py``) and its patch
chosen; a release with none is refused, naming the ones known.  We apply it ourselves (no
``patch`` binary) and only to a file whose sha256 is the recorded pristine one: a file
changed by anyone else is left untouched, with a message naming version and both hashes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from hsextract.errors import HsextractError

PATCHES_DIR = Path(__file__).resolve().parents[3] / "patches"
BACKUP_SUFFIX = ".hsextract-orig"
# The wheel we read the source from: pinned so every machine and CI python gets the same
# bytes (the .py files are identical across sglang's platform wheels; this is for the cache).
_WHEEL_PIN = [
    "--only-binary=:all:",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--platform",
    "manylinux_2_34_x86_64",
]


class PatchError(HsextractError):
    """The SGLang file is not what the patch was made for, or the patch does not fit."""


@dataclass(frozen=True)
class PatchSpec:
    version: str
    target: str  # relative to the ``sglang`` package directory
    diff: Path
    pristine_sha256: str
    patched_sha256: str


@dataclass
class PatchResult:
    version: str
    path: str
    pristine_sha256: str
    patched_sha256: str
    found_sha256: str
    action: str  # applied | already-patched | verified | reverted | already-pristine
    message: str

    def state(self) -> dict[str, str]:
        """The content of ``state/patch.json``."""
        return asdict(self)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_spec(version: str, patches_dir: Path | None = None) -> PatchSpec:
    from hsextract.sglang import versions

    d = (patches_dir or PATCHES_DIR) / f"sglang-{version}"
    manifest = d / "manifest.json"
    if not manifest.is_file():
        raise PatchError(
            f"no patch for sglang {version} (looked for {manifest}); patches exist for "
            f"{', '.join(versions.known())}. Install one of those, or use capture: hooks, "
            f"which modifies no file (or write its patch: python patches/port.py {version})"
        )
    m = json.loads(manifest.read_text())
    return PatchSpec(
        version=m["sglang_version"],
        target=m["target"],
        diff=d / m["patch"],
        pristine_sha256=m["pristine_sha256"],
        patched_sha256=m["patched_sha256"],
    )


def installed_version(sglang_root: Path) -> str:
    """The version of the ``sglang`` package at ``sglang_root``, read from its files."""
    vfile = sglang_root / "_version.py"
    m = (
        re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", vfile.read_text())
        if vfile.is_file()
        else None
    )
    if m is None:
        raise PatchError(
            f"cannot read the sglang version from {vfile}; is {sglang_root} the sglang package dir?"
        )
    return m.group(1)


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _parse_hunks(diff_text: str) -> list[tuple[int, int, list[str], list[str]]]:
    """Hunks as (old start, new start, old lines, new lines) of a one-file unified diff."""
    hunks: list[tuple[int, int, list[str], list[str]]] = []
    lines = diff_text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        m = _HUNK.match(lines[i])
        i += 1
        if not m:
            continue
        old: list[str] = []
        new: list[str] = []
        while i < len(lines) and not lines[i].startswith("@@"):
            tag, body = lines[i][:1], lines[i][1:]
            if tag in (" ", "-"):
                old.append(body)
            if tag in (" ", "+"):
                new.append(body)
            i += 1
        hunks.append((int(m.group(1)), int(m.group(3)), old, new))
    return hunks


def apply_unified_diff(text: str, diff_text: str, *, reverse: bool = False) -> str:
    """Apply (or undo) a diff exactly at its recorded lines: no fuzz, the sha was checked."""
    src = text.splitlines(keepends=True)
    out: list[str] = []
    pos = 0
    for old_start, new_start, old, new in _parse_hunks(diff_text):
        start = old_start
        if reverse:
            start, old, new = new_start, new, old
        at = start - 1
        if at < pos or src[at : at + len(old)] != old:
            raise PatchError(f"patch hunk at line {start} does not match the file")
        out.extend(src[pos:at])
        out.extend(new)
        pos = at + len(old)
    out.extend(src[pos:])
    return "".join(out)


def _atomic_write(path: Path, data: str) -> None:
    mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _resolve(sglang_root: Path, patches_dir: Path | None) -> tuple[PatchSpec, Path]:
    root = Path(sglang_root)
    if not (root / "srt").is_dir():
        raise PatchError(f"{root} is not the sglang package dir (no srt/ inside)")
    version = installed_version(root)
    spec = load_spec(version, patches_dir)
    target = root / spec.target
    if not target.is_file():
        raise PatchError(f"sglang {version}: {target} does not exist")
    return spec, target


def _result(spec: PatchSpec, target: Path, action: str, message: str) -> PatchResult:
    return PatchResult(
        version=spec.version,
        path=str(target),
        pristine_sha256=spec.pristine_sha256,
        patched_sha256=spec.patched_sha256,
        found_sha256=sha256_file(target),
        action=action,
        message=message,
    )


def _refuse(spec: PatchSpec, target: Path, found: str, doing: str) -> PatchError:
    return PatchError(
        f"refusing to {doing} {target}: sglang {spec.version} expects pristine sha256 "
        f"{spec.pristine_sha256} (or patched {spec.patched_sha256}), found {found}. "
        "The file was changed by something else; reinstall sglang=="
        f"{spec.version} and re-run. The file was left untouched."
    )


def apply(sglang_root: Path, patches_dir: Path | None = None) -> PatchResult:
    """Patch the installed file; a second call is a no-op that says "already patched"."""
    spec, target = _resolve(sglang_root, patches_dir)
    found = sha256_file(target)
    if found == spec.patched_sha256:
        return _result(spec, target, "already-patched", f"already patched: {target}")
    if found != spec.pristine_sha256:
        raise _refuse(spec, target, found, "patch")
    text = target.read_text(encoding="utf-8")
    new = apply_unified_diff(text, spec.diff.read_text(encoding="utf-8"))
    if hashlib.sha256(new.encode("utf-8")).hexdigest() != spec.patched_sha256:
        raise PatchError(
            f"patched text does not have the recorded sha256 {spec.patched_sha256}; "
            f"{target} left untouched"
        )
    backup = target.with_name(target.name + BACKUP_SUFFIX)
    shutil.copy2(target, backup)  # the pristine bytes, kept beside the file for revert
    _atomic_write(target, new)
    return _result(spec, target, "applied", f"patched {target} (backup {backup.name})")


def verify(sglang_root: Path, patches_dir: Path | None = None) -> PatchResult:
    """Succeed only when the file carries exactly our patch."""
    spec, target = _resolve(sglang_root, patches_dir)
    found = sha256_file(target)
    if found == spec.patched_sha256:
        return _result(spec, target, "verified", f"patched: {target}")
    state = "pristine (not patched)" if found == spec.pristine_sha256 else f"unknown sha256 {found}"
    raise PatchError(
        f"sglang {spec.version}: {target} is {state}; expected patched sha256 "
        f"{spec.patched_sha256}. Run: hsextract patch apply --sglang-root {Path(sglang_root)}"
    )


def revert(sglang_root: Path, patches_dir: Path | None = None) -> PatchResult:
    """Restore the pristine file (from the backup, else by undoing the diff), checked by sha."""
    spec, target = _resolve(sglang_root, patches_dir)
    found = sha256_file(target)
    if found == spec.pristine_sha256:
        return _result(spec, target, "already-pristine", f"not patched: {target}")
    if found != spec.patched_sha256:
        raise _refuse(spec, target, found, "revert")
    backup = target.with_name(target.name + BACKUP_SUFFIX)
    if backup.is_file() and sha256_file(backup) == spec.pristine_sha256:
        text = backup.read_text(encoding="utf-8")
    else:
        text = apply_unified_diff(
            target.read_text(encoding="utf-8"), spec.diff.read_text(encoding="utf-8"), reverse=True
        )
    if hashlib.sha256(text.encode("utf-8")).hexdigest() != spec.pristine_sha256:
        raise PatchError(f"could not rebuild the pristine {target}; left untouched")
    _atomic_write(target, text)
    backup.unlink(missing_ok=True)
    return _result(spec, target, "reverted", f"restored pristine {target}")


def default_cache_dir(version: str) -> Path:
    base = os.environ.get("HSEXTRACT_CACHE") or str(Path.home() / ".cache" / "hsextract")
    return Path(base) / f"sglang-{version}"


#: What the flag check, the patch tests and the hook harnesses read of a release (paths
#: under ``sglang/``; ``**/`` any depth, ``*`` within one name), plus the wheel's METADATA:
#: 3-6 MB of each 12-40 MB wheel.  A file added here is picked up by re-extracting the
#: kept wheel.
SOURCE_FILES = (
    "*.py",
    "srt/*.py",
    "srt/arg_groups/**/*.py",
    "srt/managers/*.py",
    "srt/model_executor/**/*.py",
    "srt/layers/*.py",
    "srt/layers/layer_boundary/**/*.py",
    "srt/sampling/*.py",
    "srt/models/deepseek_v2.py",
    "srt/models/llama.py",
    "srt/models/qwen2.py",
    "srt/models/qwen3.py",
)


def _source_pattern(globs: tuple[str, ...]) -> re.Pattern[str]:
    parts = []
    for g in globs:
        rx = "".join(
            "(?:[^/]+/)*" if tok == "**/" else "[^/]*" if tok == "*" else re.escape(tok)
            for tok in re.split(r"(\*\*/|\*)", g)
            if tok
        )
        parts.append(rx)
    # and the wheel's METADATA: the torch and sglang-kernel pins the declarations repeat
    return re.compile(r"sglang/(?:" + "|".join(parts) + r")|sglang-[^/]+\.dist-info/METADATA")


def ensure_pinned_source(version: str, cache_dir: Path | None = None) -> Path:
    """The directory holding release ``version``'s ``sglang/`` source (the files of
    :data:`SOURCE_FILES`); downloads its wheel once and extracts only those.

    Tests and the flag checks read SGLang's real source, never a copy we maintain.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(version)
    src = cache / "src"
    done = cache / ".unpacked"
    wanted = _source_pattern(SOURCE_FILES)
    stamp = json.dumps({"files": wanted.pattern})  # another selection re-extracts

    def ready() -> bool:
        return done.is_file() and done.read_text() == stamp and (src / "sglang" / "srt").is_dir()

    if ready():
        return src
    from filelock import FileLock  # workflow-side dependency; the server never gets here

    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / ".lock")):
        if ready():
            return src
        wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
        if not wheels:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *_WHEEL_PIN]
            cmd += ["-d", str(cache), f"sglang=={version}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
            if proc.returncode != 0 or not wheels:
                raise HsextractError(
                    f"pip download sglang=={version} failed (rc {proc.returncode}):\n"
                    + proc.stderr[-2000:]
                )
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".unpack-"))
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extractall(tmp, [n for n in zf.namelist() if wanted.fullmatch(n)])
        if src.exists():
            shutil.rmtree(src)
        os.replace(tmp, src)
        done.write_text(stamp)
    return src


def _cmd_patch(args: argparse.Namespace) -> int:
    fn = {"apply": apply, "verify": verify, "revert": revert}[args.patch_action]
    try:
        result = fn(Path(args.sglang_root))
    except PatchError as e:
        print(f"hsextract patch {args.patch_action}: {e}", file=sys.stderr)
        return 1
    print(result.message)
    if args.state_out:
        out = Path(args.state_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result.state(), indent=2) + "\n")
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``hsextract patch apply|verify|revert --sglang-root DIR [--state-out FILE]``."""
    p = subparsers.add_parser(
        "patch", help="apply/verify/revert the SGLang hidden-state dump patch"
    )
    p.add_argument("patch_action", choices=["apply", "verify", "revert"])
    p.add_argument(
        "--sglang-root", required=True, help="the installed sglang package dir (holds srt/)"
    )
    p.add_argument("--state-out", help="write state/patch.json here")
    p.set_defaults(func=_cmd_patch)
