"""A chunk file's layout, read without torch: its header, metadata and index tensors.

The manifest, which runs once after the last chunk of every run, checks each chunk's
structure (tensors, shapes, offsets, metadata, the lossless frame table) and reads no
states; importing torch for that was most of its time (on the H200: ~4 s for the manifest
job of a 44-chunk race, in the run's fixed tail).  So the structural check lives here,
on the safetensors header and ``numpy``; :mod:`hsextract.chunks` reads the states.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np

from hsextract.errors import HsextractError
from hsextract.procs import owner_alive, start_time

log = logging.getLogger(__name__)

#: Codecs a chunk may be stored with (storage.py implements them).
CODECS = ("none", "lossless", "fp8")
#: Columns of the lossless frame table before the per-plane lengths.
FRAME_COLUMNS = ("record", "tensor", "row0", "nrows", "offset")

_ST_SIZE = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4, "I64": 8, "U8": 1, "F8_E4M3": 1}
_ST_NUMPY = {"I32": np.int32, "I64": np.int64, "U8": np.uint8, "F32": np.float32}
_DTYPE_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_STORED = {
    "none": ("input_ids", "loss_mask", "offsets", "hidden_states", "aux_hidden_states"),
    "fp8": (
        "input_ids",
        "loss_mask",
        "offsets",
        "hidden_states",
        "aux_hidden_states",
        "hidden_scales",
        "aux_scales",
    ),
    "lossless": ("input_ids", "loss_mask", "offsets", "frame_start", "frames", "blob"),
}


class ChunkFileError(HsextractError):
    """A chunk file is not what the contract says."""


class ChunkDigestError(ChunkFileError):
    """A chunk file's bytes are not the ones hashed when it was extracted."""

    # The message first and alone positional: a DataLoader worker re-raises an error in
    # the main process as ``type(exc)(message)``.
    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] = "",
        expected: str = "",
        actual: str = "",
    ) -> None:
        super().__init__(message)
        self.path, self.expected, self.actual = Path(path), expected, actual

    @classmethod
    def of(cls, path: str | os.PathLike[str], expected: str, actual: str) -> ChunkDigestError:
        """The error for ``path`` hashing to ``actual``, not ``expected`` (its sentence:
        :func:`digest_mismatch`)."""
        return cls(
            digest_mismatch(path, expected, actual), path=path, expected=expected, actual=actual
        )


def sha256_file(
    path: str | os.PathLike[str], bufsize: int = 1 << 20, stop: threading.Event | None = None
) -> str:
    """Read a slice at a time into one buffer and hashed from there (cache-hot).

    Not from a mapping of the file (as before issue 40): that saves the copy (~5 % of the
    hash's CPU), but unmapping happens with the GIL held (CPython's ``mmap.close``), ~20 ms
    for a 64 MB chunk, every other thread of the process stalled meanwhile -- in a chunk
    job, its sender threads (bench/client_ceiling.py's profile: ~0.3 ms a 4 MB request).
    ``preadv`` and ``update`` release the GIL; 1 MiB slices keep their round trips few.

    ``stop`` ends a background hash early (its caller failed; the digest is moot then):
    an empty string is returned.
    """
    h = hashlib.sha256()
    buf = memoryview(bytearray(bufsize))
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pos = 0
        while True:
            if stop is not None and stop.is_set():
                return ""
            n = os.preadv(fd, [buf], pos)
            if not n:
                break
            h.update(buf[:n])
            pos += n
    finally:
        os.close(fd)
    return h.hexdigest()


def redo_chunk(path: str | os.PathLike[str]) -> str:
    """What to do about a damaged chunk file: never deleted for the user (it may be the
    only copy of hours of GPU time, and the damage may be elsewhere: a bad disk)."""
    from hsextract.commands import snakemake_command

    # A chunk file lives in <run>/hidden/: the run's recorded config renders the command.
    run = Path(path).parent.parent
    return f"delete {path} and rerun `{snakemake_command(Path(path), run_dir=run)}`"


def digest_mismatch(path: str | os.PathLike[str], expected: str, actual: str) -> str:
    """The one sentence every reader raises for a chunk whose bytes changed on disk."""
    return (
        f"{path} has sha256 {actual[:12]}..., not the {expected[:12]}... recorded when it "
        f"was extracted (its bytes changed on disk since): {redo_chunk(path)}"
    )


class ChunkHasher:
    """The sha256 of a chunk file, taken on a thread while the caller reads the same file.

    Why a thread and not a hash before the read: a chunk is tens of GB, and hashing it
    first would read it twice.  hashlib releases the GIL on large buffers, so the hash
    runs on another core beside the export's decoding and writing, which are slower: it
    stays ahead, and the caller's reads of the same pages come from the page cache.  The
    verdict (:meth:`check`) is taken before the caller commits anything it wrote.
    """

    def __init__(self, path: str | os.PathLike[str], expected: str) -> None:
        self.path, self.expected = Path(path), expected
        self._stop = threading.Event()
        self._digest = ""
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="chunk-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._digest = sha256_file(self.path, stop=self._stop)
        except OSError as exc:
            self._error = exc

    def check(self) -> None:
        """Wait for the hash; raise :class:`ChunkDigestError` unless it is the expected."""
        self._thread.join()
        if self._error is not None:
            raise ChunkFileError(
                f"{self.path} could not be read to check its sha256 ({self._error}); "
                f"{redo_chunk(self.path)}"
            )
        if self._digest != self.expected:
            raise ChunkDigestError.of(self.path, self.expected, self._digest)

    def cancel(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> ChunkHasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()  # after check() a no-op; on an error, the hash stops at its next slice


#: Chunk files whose bytes were hashed whole and matched, by identity (path, inode, size,
#: mtime): a dataset's readers, and forked DataLoader workers, check each file once.
_VERIFIED: set[tuple[str, int, int, int, str]] = set()


#: How every verdict dir's name starts, in the temp dir.
VERDICT_PREFIX = "hsextract-verified-"
#: A private verdict dir's name: ``tempfile.mkdtemp``'s 8 characters of its alphabet.
_PRIVATE_NAME = re.compile(re.escape(VERDICT_PREFIX) + r"[a-z0-9_]{8}")
#: A user record in a verdict dir, ``user-<pid>-<start>-<host>`` (start: clock ticks since
#: boot, so a reused pid is never taken for the original; the host, for a temp dir that
#: several hosts share): an empty file whose name is the record, so made whole by one
#: ``open(O_EXCL)``.
_USER_RECORD = re.compile(r"user-(\d+)-(\d+)-(.+)")
#: A verdict dir with no user record this long after it last changed: its maker died
#: between making it and recording itself (a window of microseconds), or it was made
#: before dirs had records.  Younger, it may be being made now: it stays.
RECORDLESS_GRACE_S = 600.0
#: This process's user record name per verdict dir it uses, and how many of its objects
#: use it: the record goes with the last of them.
_USERS: dict[str, list[Any]] = {}
_USERS_LOCK = threading.Lock()
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def shared_verdict_path(key: str) -> str:
    """The shared verdict dir of the readers keyed ``key`` (16 hex digits), in the temp dir:
    the sweep (:func:`sweep_verdict_dirs`) knows this name for ours."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"{VERDICT_PREFIX}{os.getuid()}-{key}")


class VerifiedDir:
    """A directory where one reader's processes leave the chunk files they hashed (see
    :func:`verify_chunk_file`'s ``shared``), removed when the last process using it lets
    its object go.

    Each process that makes or joins one records itself in it (pid and start time, see
    ``_USER_RECORD``).  A process SIGKILLed (the OOM killer, a scheduler) runs no
    finalizer, so its dir would stay in the temp dir for good, one per crashed job: each
    new one first sweeps the temp dir (:func:`sweep_verdict_dirs`) for dirs every user of
    which is gone.  Why every user, not the maker: a node's ranks share one dir
    (:meth:`shared`), each rank recorded in it, so a dir whose maker died while a sibling
    rank still reads through it survives; tracking the ranks costs one empty file each.
    A rank's loader workers are not recorded: they die with their rank (PyTorch's worker
    watchdog), and one that outlives it loses only its verdicts (it hashes alone).

    Pickled (a spawned DataLoader worker) it is borrowed: only the processes that recorded
    themselves remove it, so a worker's copy going away never pulls it from its siblings.
    """

    def __init__(self, path: str | None = None) -> None:
        if path is not None:
            self.path = path  # borrowed
            return
        import tempfile
        import weakref

        sweep_verdict_dirs()
        self.path = tempfile.mkdtemp(prefix=VERDICT_PREFIX)
        _record_user(self.path)
        weakref.finalize(self, _leave_dir, self.path, os.getpid())

    @classmethod
    def shared(cls, path: str) -> VerifiedDir:
        """The dir at ``path``, which several processes find by name (a trainer's ranks on
        one node): made here if missing, joined if another made it, and removed when its
        last user goes.  One that is not ours alone (a symlink, another user's, open to
        others) is never trusted: a private dir instead, whose only cost is hashing again.

        One left by a job whose users all died is joined, not swept: its verdicts are for
        file identities, so a job restarted under the same id keeps them.  The join holds
        the dir's flock, which a sweep tries first, so a sweep never removes a dir between
        a join's check and its record; a join that finds the dir swept makes it again."""
        import weakref

        sweep_verdict_dirs(keep=path)
        for _ in range(8):
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except FileNotFoundError:
                continue  # swept since: make it again
            except OSError:  # a symlink, or not a directory
                return cls()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                st = os.fstat(fd)
                if st.st_uid != os.getuid() or st.st_mode & 0o077:
                    return cls()
                try:
                    if os.lstat(path).st_ino != st.st_ino:
                        continue  # swept and made again by another: join that one
                except FileNotFoundError:
                    continue
                _record_user(path)
            finally:
                os.close(fd)
            d = cls(path)
            weakref.finalize(d, _leave_dir, path, os.getpid())
            return d
        return cls()  # swept under us again and again: hash alone

    def __fspath__(self) -> str:
        return self.path

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (VerifiedDir, (self.path,))


def _record_user(path: str) -> None:
    """Record this process as a user of the verdict dir ``path`` (once per process)."""
    import socket

    with _USERS_LOCK:
        entry = _USERS.setdefault(path, [None, 0])
        entry[1] += 1
        if entry[0] is None:
            me = os.getpid()
            entry[0] = f"user-{me}-{start_time(me)}-{socket.gethostname()}"
        # Made again even if this process made it before: the dir may be a new one.
        with contextlib.suppress(FileExistsError):
            os.close(os.open(os.path.join(path, entry[0]), _NEW_FILE, 0o600))


def _user_records(fd: int) -> list[re.Match[str]]:
    """The user records (``_USER_RECORD``) of the verdict dir open at ``fd``."""
    return [m for m in map(_USER_RECORD.fullmatch, os.listdir(fd)) if m]


def _user_alive(pid: str, start: str, host: str) -> bool:
    """Whether a verdict dir's user may still run: on another host it cannot be told."""
    import socket

    return host != socket.gethostname() or owner_alive(pid, start)


def _leave_dir(path: str, owner: int) -> None:
    """This process's last object using ``path`` went: drop its record, and the dir if no
    other user of it lives (under its flock, as a sweep or a join holds it)."""
    # A forked worker inherits the finalizer with the object: only the recorded process.
    if os.getpid() != owner:
        return
    with _USERS_LOCK:
        entry = _USERS.get(path)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _USERS[path]
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, entry[0]))
            if not any(_user_alive(*m.groups()) for m in _user_records(fd)):
                import shutil

                shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)


def sweep_verdict_dirs(keep: str | None = None) -> list[str]:
    """Remove the verdict dirs in the temp dir that are provably ours and abandoned; return
    their names.  ``keep``: a dir about to be joined (:meth:`VerifiedDir.shared`).

    Ours: a name we make (a private dir's, or a shared one's with our uid), a real
    directory (not a symlink), of our uid, mode 0700.  Abandoned: it has user records and
    none of them runs (each pid gone, or now another process: its start time differs), or
    it has none and has not changed for ``RECORDLESS_GRACE_S``.  A record of another host
    is never judged.  A dir being joined or left now (its flock held) is left for the next
    sweep.  Anything else stays, whatever it holds.
    """
    import tempfile

    tmp = tempfile.gettempdir()
    shared = re.compile(re.escape(VERDICT_PREFIX) + rf"{os.getuid()}-[0-9a-f]{{16}}")
    keep = os.path.abspath(keep) if keep is not None else None
    removed = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(tmp)):
            path = os.path.join(tmp, name)
            if path == keep or not (_PRIVATE_NAME.fullmatch(name) or shared.fullmatch(name)):
                continue
            with contextlib.suppress(OSError):  # not a dir, a symlink, gone, not ours
                if _remove_if_abandoned(path):
                    removed.append(name)
    if removed:
        log.info("removed verdict dirs that killed readers left in %s: %s", tmp, removed)
    return removed


def _remove_if_abandoned(path: str) -> bool:
    import shutil
    import stat
    import time

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if os.lstat(path).st_ino != st.st_ino:
            return False  # replaced since opened: not the dir judged
        users = _user_records(fd)
        if users:
            if any(_user_alive(*m.groups()) for m in users):
                return False
        elif time.time() - st.st_mtime < RECORDLESS_GRACE_S:
            return False
        shutil.rmtree(path)
        return True
    finally:
        os.close(fd)


def verify_chunk_file(
    path: str | os.PathLike[str], expected: str, *, shared: str | os.PathLike[str] | None = None
) -> bool:
    """Hash a whole chunk file once per process (cached while the file is unchanged) and
    raise :class:`ChunkDigestError` naming it unless it is ``expected``; True if this call
    hashed it.

    For readers that read records in any order (a training Dataset), where a hash
    alongside the reads is not possible: the hash also brings the file into the page cache
    the reads then hit.

    ``shared``: a directory private to one reader whose processes (a DataLoader's workers)
    split each file's records between them: the first to open a file hashes it under a
    lock there and leaves its verdict (a match, or the digest it found instead), the
    others take it.  Each worker hashing every file it reads a share of cost as many
    whole-file hashes per chunk as there are workers, which on a streamed run was more
    CPU than decoding the records.  A verdict is for the file's identity (inode, size,
    mtime), as the in-process cache is: a chunk is only ever replaced by a rename, which
    is another inode.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ChunkFileError(f"{path} is unreadable ({exc}); {redo_chunk(path)}") from exc
    key = (str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns, expected)
    if key in _VERIFIED:
        return False
    if shared is None:
        _hash_and_check(path, expected)
        _VERIFIED.add(key)
        return True
    name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
    verdict = Path(shared) / f"{name}.ok"
    try:
        fd = os.open(Path(shared) / f"{name}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    except FileNotFoundError:  # its owner is gone (the loader was dropped): hash alone
        return verify_chunk_file(path, expected)
    bad = verdict.with_suffix(".bad")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a sibling hashing it now: wait for its verdict
        if bad.exists():  # a sibling found other bytes: the same error, no second hash
            raise ChunkDigestError.of(path, expected, bad.read_text())
        hashed = not verdict.exists()
        if hashed:
            try:
                _hash_and_check(path, expected)
            except ChunkDigestError as exc:
                with contextlib.suppress(FileNotFoundError):  # the dir's owner went
                    bad.write_text(exc.actual)
                raise
            with contextlib.suppress(FileNotFoundError):
                verdict.touch()
    finally:
        os.close(fd)
    _VERIFIED.add(key)
    return hashed


def _hash_and_check(path: str | os.PathLike[str], expected: str) -> None:
    try:
        digest = sha256_file(path)
    except OSError as exc:
        raise ChunkFileError(f"{path} is unreadable ({exc}); {redo_chunk(path)}") from exc
    if digest != expected:
        raise ChunkDigestError.of(path, expected, digest)


class ChunkLayout:
    """What a chunk file holds, from its safetensors header and small index tensors."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                size = os.fstat(f.fileno()).st_size
                if not 2 <= n <= size - 8:
                    raise ValueError(f"header length {n} in a file of {size} bytes")
                header = json.loads(f.read(n))
            self._base = 8 + n
            self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
            self._tensors: dict[str, dict] = header
            for name, t in header.items():
                a, b = t["data_offsets"]
                if not 0 <= a <= b <= size - self._base:
                    raise ValueError(f"tensor {name} at {a}..{b} past the end")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ChunkFileError(f"{self.path}: not a readable safetensors file: {exc}") from exc
        self.codec = self.metadata.get("codec", "none")
        if self.codec not in CODECS:
            raise ChunkFileError(
                f"{self.path}: codec {self.codec!r} is not one this hsextract reads "
                f"({', '.join(CODECS)}); upgrade hsextract"
            )
        missing = set(_STORED[self.codec]) - set(self._tensors)
        if missing:
            raise ChunkFileError(f"{self.path}: missing tensors {sorted(missing)}")
        self.offsets = self.array("offsets")
        self.record_ids: list[str] = json.loads(self.metadata.get("record_ids", "[]"))
        #: Every layer stored in ``aux_hidden_states``, in order (what the dump captured).
        self.stored_layers: list[int] = json.loads(self.metadata.get("aux_layers", "[]"))
        self.hidden_size = int(self.metadata.get("hidden_size", -1))
        if self.codec == "none":
            self.esize = _ST_SIZE[self._tensors["hidden_states"]["dtype"]]
        else:
            self.esize = _DTYPE_SIZE.get(self.metadata.get("dtype", ""), 2)
        if self.codec == "lossless":
            self.frame_start = self.array("frame_start")
            width = self._tensors["frames"]["shape"]
            self.frames = self.array("frames").reshape(width)
            a, b = self._tensors["blob"]["data_offsets"]
            self.blob_bytes = b - a

    def array(self, name: str) -> np.ndarray:
        """A small integer tensor of the file (offsets, frame table), read with numpy."""
        t = self._tensors[name]
        a, b = t["data_offsets"]
        dtype = np.dtype(_ST_NUMPY[t["dtype"]])
        with open(self.path, "rb") as f:
            f.seek(self._base + a)
            return np.frombuffer(f.read(b - a), dtype=dtype).copy()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def shapes(self) -> dict[str, tuple[list[int], str]]:
        """The tensors as stored (a compressed file has no ``hidden_states`` tensor)."""
        return {k: (list(v["shape"]), str(v["dtype"])) for k, v in self._tensors.items()}

    def raw_bytes(self) -> int:
        """What the hidden and aux rows take uncompressed, in the captured dtype."""
        return int(self.offsets[-1]) * self.hidden_size * (len(self.stored_layers) + 1) * self.esize

    def stored_bytes(self) -> int:
        return stored_bytes(self.codec, self.shapes())


def stored_bytes(codec: str, shapes: dict[str, tuple[list[int], str]]) -> int:
    """What a chunk's states take as stored: the tensors that hold them, per codec."""
    names = {
        "none": ("hidden_states", "aux_hidden_states"),
        "fp8": ("hidden_states", "aux_hidden_states", "hidden_scales", "aux_scales"),
        "lossless": ("frames", "blob"),
    }[codec]
    return sum(int(np.prod(shapes[n][0])) * _ST_SIZE[shapes[n][1]] for n in names)


def check_chunk(path: str | os.PathLike[str], expect_records: int | None = None) -> dict:
    """Structural check of a finished chunk file: tensors, shapes, offsets, metadata, and
    for a lossless file its frame table (every row of every record covered, once)."""
    r = ChunkLayout(path)
    shapes = r.shapes()
    t = int(r.offsets[-1])
    h = r.hidden_size
    k = len(r.stored_layers)
    n = len(r)
    problems = []
    if shapes["input_ids"][0] != [t] or shapes["loss_mask"][0] != [t]:
        problems.append(f"ids/mask length != offsets[-1]={t}")
    if r.codec in ("none", "fp8"):
        if shapes["hidden_states"][0] != [t, h]:
            problems.append(f"hidden_states {shapes['hidden_states'][0]} != [{t}, {h}]")
        if shapes["aux_hidden_states"][0] != [t, k * h]:
            problems.append(f"aux_hidden_states {shapes['aux_hidden_states'][0]} != [{t}, {k * h}]")
    if r.codec == "fp8" and (
        shapes["hidden_scales"][0] != [t, 1] or shapes["aux_scales"][0] != [t, k]
    ):
        problems.append(f"scales {shapes['hidden_scales'][0]}/{shapes['aux_scales'][0]}")
    if r.codec == "lossless":
        problems += _frame_problems(r, t, n)
    if len(r.record_ids) != n:
        problems.append(f"{len(r.record_ids)} record_ids for {n} records")
    if expect_records is not None and n != expect_records:
        problems.append(f"{n} records, expected {expect_records}")
    if bool((r.offsets[1:] < r.offsets[:-1]).any()) or int(r.offsets[0]) != 0:
        problems.append("offsets not monotone from 0")
    for key in ("record_ids", "aux_layers", "hidden_size", "model", "fingerprint", "engine"):
        if key not in r.metadata:
            problems.append(f"metadata {key!r} missing")
    if problems:
        raise ChunkFileError(f"{path}: " + "; ".join(problems))
    return {
        "records": n,
        "tokens": t,
        "hidden_size": h,
        "aux_layers": r.stored_layers[:-1] if _prenorm(r) else r.stored_layers,
        "stored_layers": r.stored_layers,
        # The longest record, for ``hsextract verify``'s check of the run's max_seq_len.
        "longest": int(np.diff(r.offsets).max()) if n else 0,
        "codec": r.codec,
        "raw_bytes": r.raw_bytes(),
        "stored_bytes": r.stored_bytes(),
        "metadata": r.metadata,
    }


def _prenorm(r: ChunkLayout) -> bool:
    """With ``prenorm_final`` the last stored block is index L (chunks.ChunkReader)."""
    n_layers = r.metadata.get("num_layers")
    return n_layers is not None and int(n_layers) in r.stored_layers


def _frame_problems(r: ChunkLayout, t: int, n: int) -> list[str]:
    """Each record's rows, for each tensor, tiled by its frames in order; each frame's
    planes inside the blob.  (Decoding is what proves the bytes: ``hsextract verify``.)"""
    fs, frames = r.frame_start, r.frames
    ncol = len(FRAME_COLUMNS)
    if len(fs) != n + 1 or int(fs[0]) != 0 or int(fs[-1]) != len(frames):
        return [f"frame_start {len(fs)} entries, {len(frames)} frames, for {n} records"]
    lens = np.diff(r.offsets)
    blob = r.blob_bytes
    for j in range(n):
        rows = {0: 0, 1: 0}
        for row in frames[fs[j] : fs[j + 1]]:
            rec, tensor, r0, nr, at = (int(x) for x in row[:ncol])
            size = int(np.abs(row[ncol:]).sum())
            if rec != j or tensor not in rows or r0 != rows[tensor] or nr <= 0:
                return [f"record {j}: frame {row[:ncol].tolist()} out of order"]
            if at < 0 or at + size > blob:
                return [f"record {j}: frame at {at}+{size} outside the {blob}-byte blob"]
            rows[tensor] += nr
        want = {0: int(lens[j]), 1: int(lens[j]) if r.stored_layers else 0}
        if rows != want:
            return [f"record {j}: frames cover {rows} rows of (hidden, aux), expected {want}"]
    return []
