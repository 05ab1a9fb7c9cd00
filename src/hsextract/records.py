"""Input records: validated merge + seeded shuffle, chunk split, and chunk loading.

Scale drives the design: the production input is ~37k records / ~88 M tokens / ~800 MB of
JSON lines on a 2-core machine, and the merge must stay within ~2x of GNU ``shuf``.  So:

* Records are never held as Python objects.  Each input line is validated where it lies
  (a byte range of a shard) and the output is written by copying the original bytes in a
  shuffled order of line offsets.  Only truncated records are re-serialised, and records
  without an ``id`` get one spliced in after their opening brace.
* Validation has a fast path that checks the two token arrays on raw bytes with numpy
  (the digits, commas and lengths *are* the values) and parses only the rest of the line
  with orjson, so 88 M ints never become Python objects.  Anything the fast path does not
  recognise falls back to a full orjson parse and a Python check that names the reason.
  The fast path only ever *accepts* lines that the slow path would also accept; it never
  rejects on its own.
* Byte ranges are validated in worker processes (2 cores), the parent only concatenates
  small per-line tables, assigns ids, removes duplicates, shuffles and writes.

The output depends only on the input bytes and the seed, never on the worker count or the
range size (tests check this byte for byte).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from hsextract.budget import human
from hsextract.errors import HsextractError
from hsextract.procs import start_time

log = logging.getLogger(__name__)

#: Token ids must fit the chunk file's int32 ``input_ids`` when the vocab size is unknown.
INT32_BOUND = 2**31
#: Target bytes per validation task: small enough to balance 2 cores and keep per-task
#: buffers reused by malloc, large enough that per-task overhead is noise.
RANGE_BYTES = 8 << 20
#: Below this many input bytes the merge runs in-process: a pool costs more than it saves.
PARALLEL_MIN_BYTES = 16 << 20
OVERLENGTH_POLICIES = ("truncate", "drop")
#: Where a merge that fails on too many rejects leaves them, beside the outputs: not one of
#: them, so Snakemake does not delete it with the failed job's; the next merge removes it.
FAILED_REJECTS = "rejects-failed.jsonl"
#: chunks/index.json layout: 2 added content digests and hash assignment.
INDEX_FORMAT = 2
#: What the merge writes in its output dir (by temp name first, see :func:`_tmp_name`):
#: the only temp files a later merge removes there.
_MERGE_OUTPUTS = re.compile(r"train\.jsonl|stats\.json|rejects\.jsonl|" + re.escape(FAILED_REJECTS))
#: What split_chunks writes in its chunk dir: the chunk files and its index (the
#: workflow's ``split.json``; ``index.json`` where it is called with that name).
_SPLIT_OUTPUTS = re.compile(r"chunk_\d{5}\.jsonl|split\.json|index\.json")

_WS = b" \t\r\n"
_IDS_KEY = b'"input_ids"'
_MASK_KEY = b'"loss_mask"'
# Placeholders swapped in for the two arrays before orjson parses the rest of a line.
_NUL_ESCAPE = b"\\u0000"
_IDS_PH = b'"\\u0000hsx\\u001fph:ids"'
_MASK_PH = b'"\\u0000hsx\\u001fph:mask"'
_IDS_PH_VAL = "\x00hsx\x1fph:ids"
_MASK_PH_VAL = "\x00hsx\x1fph:mask"
_IDS_CHARS = b"0123456789,"
_MASK_CHARS = b"01,"


class InputError(HsextractError):
    """An input path or glob is missing, or there is nothing to merge."""


class DiskFullError(HsextractError):
    """An output's filesystem ran out of space (ENOSPC) or quota (EDQUOT) while writing it."""


class RejectFractionError(HsextractError):
    """More input records were malformed than ``merge.max_reject_fraction`` allows."""


class ChunkInputError(HsextractError):
    """A chunk file does not match its index, or holds a record the client must not send."""


@dataclass(frozen=True)
class Record:
    """One validated record as the extraction client sends it."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]
    line: int


@dataclass(frozen=True)
class _Limits:
    """What a line is validated against; ``max_seq_len=None`` means no length policy."""

    vocab_bound: int
    max_seq_len: int | None
    overlength: str


@dataclass
class _RangeResult:
    """Per-line outcome of one byte range; line indices are local to the range."""

    n_lines: int
    blank: int
    # kept lines, in line order
    line: np.ndarray  # int64 local line index
    offset: np.ndarray  # int64 absolute byte offset of the line in its file
    length: np.ndarray  # int64 bytes without the newline
    has_nl: np.ndarray  # bool: a newline follows in the file (lets us copy it too)
    tokens: np.ndarray  # int64 tokens after truncation
    loss_tokens: np.ndarray  # int64
    ids: list[str | None]  # canonical id (str) or None when the record has none
    replaced: dict[int, bytes] = field(default_factory=dict)  # kept index -> new bytes
    truncated: int = 0
    rejects: list[tuple[int, str, str]] = field(default_factory=list)  # (line, reason, detail)
    dropped: list[tuple[int, int]] = field(default_factory=list)  # (line, tokens)


# --------------------------------------------------------------------------- validation


#: Control bytes JSON allows nowhere (tab and CR are whitespace outside strings; LF ends a
#: line), and a string's opening quote: where a scan outside strings stops.
_OUTSIDE_STRING = re.compile(rb'["\x00-\x08\x0b\x0c\x0e-\x1f]')
#: A string's body up to its closing quote, or to the first byte it may not hold raw.
_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f]")
_STRING_BODY = re.compile(rb'(?:[^"\\\x00-\x1f]|\\[^\x00-\x1f])*')
_CONTROL_NAMES = {0x00: "NUL", 0x09: "tab", 0x0D: "carriage return", 0x1B: "ESC"}
_MAGIC = (
    (b"\x1f\x8b", "gzip", "gunzip"),
    (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"),
    (b"\xfd7zXZ\x00", "xz", "unxz"),
)


def _reason_for_parse_error(line: bytes) -> tuple[str, str]:
    """Name why orjson refused a line, in words that say what to fix.

    orjson's own messages are about its parser state, and stdlib json, given bytes,
    guesses UTF-16/32 from where the NUL bytes are: a line of binary came back as
    "'utf-16-be' codec can't decode byte ...".  So the encoding and the raw control bytes
    are checked first, and stdlib json (which only classifies, it never accepts) gets
    text.  Columns count bytes from 1; the reject record names the file and line.
    """
    for magic, kind, tool in _MAGIC:
        if line.startswith(magic):
            return "binary_data", (
                f"{kind}-compressed data, not JSON text (magic bytes {magic.hex(' ')} at "
                f"column 1): decompress the file first ({tool}); the merge reads plain "
                "JSON Lines"
            )
    foreign = _utf16_or_32(line)
    if foreign is not None:
        return "invalid_utf8", foreign
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return _not_utf8(line, e)
    if text.startswith("\ufeff"):
        return "utf8_bom", (
            "starts with a UTF-8 byte-order mark (bytes ef bb bf), which JSON Lines does not "
            "allow: remove it (e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' FILE)"
        )
    bad = _bad_control_byte(line)
    if bad is not None:
        return "control_byte", _control_detail(line, *bad)
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        return "invalid_json", str(e)[:200]
    # Parses for Python but not orjson: ints beyond 64 bits, NaN/Infinity and the like.
    problem = _validate_obj(obj, _Limits(INT32_BOUND, None, "truncate"))
    if problem is not None:
        return problem
    return "invalid_json", "not strict JSON (NaN, Infinity or a number out of range)"


def _utf16_or_32(line: bytes) -> str | None:
    """UTF-16 or UTF-32 text: a byte-order mark, or a NUL at every other byte (a UTF-16
    file's lines after the first, split at the low byte of its newlines)."""
    boms = (
        (b"\xff\xfe\x00\x00", "UTF-32LE"),
        (b"\x00\x00\xfe\xff", "UTF-32BE"),
        (b"\xff\xfe", "UTF-16LE"),
        (b"\xfe\xff", "UTF-16BE"),
    )
    for bom, enc in boms:
        if line.startswith(bom):
            return (
                f"not UTF-8: {enc} text (byte-order mark {bom.hex(' ')} at column 1); convert "
                f"the file to UTF-8 (e.g. iconv -f {enc[:6]} -t UTF-8)"
            )
    nul = line.count(0)
    if len(line) >= 4 and 3 * nul >= len(line):
        on_one_side = max(line[0::2].count(0), line[1::2].count(0))
        if on_one_side >= 0.9 * nul and not _CONTROL.search(line.replace(b"\x00", b"")):
            return (
                "not UTF-8: looks like UTF-16 text (a NUL byte at every other column); convert "
                "the file to UTF-8 (e.g. iconv -f UTF-16 -t UTF-8)"
            )
    return None


def _not_utf8(line: bytes, e: UnicodeDecodeError) -> tuple[str, str]:
    at = e.start
    bad = line[at : max(e.end, at + 1)]
    shown = f"byte{'s' if len(bad) > 1 else ''} {bad.hex(' ')}"
    if _CONTROL.search(line):
        return "binary_data", (
            f"binary data, not UTF-8 text: {shown} at column {at + 1} is not UTF-8 and the "
            "line holds raw control bytes; is this a binary file?"
        )
    return "invalid_utf8", (
        f"not UTF-8 text at column {at + 1} ({shown}): the file is in another "
        "encoding, e.g. Latin-1 or cp1252; convert it to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)"
    )


def _bad_control_byte(line: bytes) -> tuple[int, bool] | None:
    """(index, inside a string) of the first control byte JSON does not allow where it is.

    Regex scans only (a rejected line may be megabytes of binary): outside strings up to
    the next quote or control byte, then across the string's body.
    """
    pos = 0
    while True:
        m = _OUTSIDE_STRING.search(line, pos)
        if m is None:
            return None
        i = m.start()
        if line[i] != 0x22:  # '"'
            return i, False
        j = _STRING_BODY.match(line, i + 1).end()  # type: ignore[union-attr]
        if j >= len(line):
            return None  # an unterminated string: a JSON error, not a byte problem
        if line[j] == 0x22:
            pos = j + 1
            continue
        if line[j] == 0x5C and j + 1 < len(line):  # '\' before a control byte
            j += 1
        return (j, True) if line[j] < 0x20 else None


def _control_detail(line: bytes, i: int, in_string: bool) -> str:
    b = line[i]
    name = _CONTROL_NAMES.get(b)
    what = f"control byte 0x{b:02x}{f' ({name})' if name else ''} at column {i + 1}"
    if in_string and b in (0x09, 0x0D):
        escape = "\\t" if b == 0x09 else "\\r"
        return f"raw {what} inside a JSON string: a string must escape it (as {escape})"
    binary = "; is this a binary file?" if b == 0 or not in_string else ""
    if in_string:
        return (
            f"raw {what} inside a JSON string: a string cannot hold raw control bytes "
            f"(escape it as \\u00{b:02x}){binary}"
        )
    return f"{what}: JSON text cannot hold raw control bytes{binary}"


def _check_int_list(values: list[Any], bound: int) -> tuple[str, str] | None:
    """Find the first non-int, negative or out-of-range token id, with its index."""
    for i, x in enumerate(values):
        if type(x) is not int:
            if type(x) is float and x.is_integer() and abs(x) >= 2**63:
                return "input_ids_out_of_range", f"input_ids[{i}] = {x:.6g} is not below {bound}"
            return "input_ids_not_int", f"input_ids[{i}] is {type(x).__name__}: {str(x)[:40]}"
        if x < 0:
            return "input_ids_negative", f"input_ids[{i}] = {x}"
        if x >= bound:
            return "input_ids_out_of_range", f"input_ids[{i}] = {str(x)[:40]} is not below {bound}"
    return None


def _validate_obj(obj: Any, limits: _Limits) -> tuple[str, str] | None:
    """The slow, exact check of one parsed record; returns (reason, detail) or None."""
    if not isinstance(obj, dict):
        return "not_object", f"top-level value is {type(obj).__name__}, not an object"
    if "input_ids" not in obj:
        return "missing_input_ids", "no 'input_ids' key"
    ids = obj["input_ids"]
    if not isinstance(ids, list):
        return "input_ids_not_list", f"'input_ids' is {type(ids).__name__}"
    if not ids:
        return "input_ids_empty", "'input_ids' is an empty list"
    problem = _check_int_list(ids, limits.vocab_bound)
    if problem is not None:
        return problem
    if "loss_mask" not in obj:
        return "missing_loss_mask", "no 'loss_mask' key"
    mask = obj["loss_mask"]
    if not isinstance(mask, list):
        return "loss_mask_not_list", f"'loss_mask' is {type(mask).__name__}"
    if len(mask) != len(ids):
        return "length_mismatch", f"{len(ids)} input_ids vs {len(mask)} loss_mask"
    for i, m in enumerate(mask):
        if type(m) is not int or m not in (0, 1):
            return "loss_mask_not_binary", f"loss_mask[{i}] = {str(m)[:40]}"
    if "id" in obj:
        rid = obj["id"]
        if not ((type(rid) is str and rid) or type(rid) is int):
            return "bad_id", f"'id' must be a non-empty string or an int, got {str(rid)[:40]}"
    return None


def _canonical_id(obj: dict) -> str | None:
    """The id as the chunk files carry it: ints and strings share one namespace."""
    return str(obj["id"]) if "id" in obj else None


def _value_span(buf: bytes, lo: int, hi: int, key: bytes) -> tuple[int, int]:
    """Locate ``key: [ ... ]`` in buf[lo:hi]; (start of '[', index of ']') or (-1, -1)."""
    k = buf.find(key, lo, hi)
    if k < 0:
        return -1, -1
    i = k + len(key)
    while i < hi and buf[i] in _WS:
        i += 1
    if i >= hi or buf[i] != 58:  # ':'
        return -1, -1
    i += 1
    while i < hi and buf[i] in _WS:
        i += 1
    if i >= hi or buf[i] != 91:  # '['
        return -1, -1
    e = buf.find(b"]", i, hi)
    return (i, e) if e > 0 else (-1, -1)


def _join(parts: list[memoryview], allowed: bytes) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """Join spans with a separator after each: (bytes as uint8, each span's end, spaced).

    None when a span holds a byte outside ``allowed`` or a space anywhere but right after
    a comma.  Python's json.dumps writes ``[1, 2]``: that space is insignificant JSON
    whitespace, so a block written that way is joined with ``", "`` (it keeps one stride)
    and the checks step over the spaces where they lie.  Squeezing
    them out instead (a boolean compaction and a count per span) cost as much as all the
    checks of a compact block: half the inputs are written that way.
    """
    # The first span's style picks the separator (a block mixing styles is still checked
    # right, only not in one stride); one join, not a compact one and then a spaced one.
    sep = b", " if b", " in bytes(parts[0][:64]) else b","
    joined = sep.join(parts) + sep
    if joined.translate(None, allowed + b" "):
        return None  # signs, dots, exponents, quotes, tabs ...
    spaced = joined.find(b" ") >= 0
    u = np.frombuffer(joined, np.uint8)
    ends = np.cumsum(np.fromiter((len(p) + len(sep) for p in parts), np.int64, len(parts)))
    if spaced:
        space = u == 32
        if space[0] or (space[1:] & (u[:-1] != 44)).any():
            return None  # "1 2", "1 ,2", "[ 1" ...: let the slow path decide
    return u, ends, spaced


def _token_gaps(u: np.ndarray, spaced: bool) -> tuple[np.ndarray, np.ndarray]:
    """The comma ending each token, and each token's digit count + 1 (a space after the
    comma before it not counted)."""
    commas = np.flatnonzero(u == 44)
    gaps = np.diff(commas, prepend=-1)
    if spaced:
        gaps[1:] -= u[commas[:-1] + 1] == 32
    return commas, gaps


def _check_ids_block(parts: list[memoryview], bound: int) -> np.ndarray | None:
    """Token counts of each span if all are valid non-negative int arrays below bound.

    Works on the digits: after joining, every token ends at a comma, so gaps between
    comma positions are token lengths.  Returns None if any span is not a plain array of
    in-range ints (the caller then checks spans one by one).
    """
    joined = _join(parts, _IDS_CHARS)
    if joined is None:
        return None
    u, ends, spaced = joined
    commas, gaps = _token_gaps(u, spaced)
    bstr = str(bound - 1).encode()
    if gaps.min() < 2 or gaps.max() > len(bstr) + 1:
        return None  # empty token ([], ',,', trailing comma) or too many digits
    # Leading zeros are invalid JSON: a token starting with '0' that is not just "0".  A
    # token starts after a comma, or after the space that may follow one.
    if u[0] == 48 and u[1] != 44:
        return None
    before = u[:-2] == 44
    if spaced:
        before |= u[:-2] == 32
    if (before & (u[1:-1] == 48) & (u[2:] != 44)).any():
        return None
    if not _below_bound(u, commas, gaps, bstr):
        return None
    return np.diff(np.searchsorted(commas, ends - 1, side="right"), prepend=0)


def _below_bound(u: np.ndarray, commas: np.ndarray, gaps: np.ndarray, bstr: bytes) -> bool:
    """Every token with as many digits as bound-1 is <= bound-1.

    Equal-width digit strings compare like big-endian integers, so each candidate's
    digits are read as one uint64 (8 bytes from a strided view, shifted) and compared
    once.  The last few candidates, too close to the end for 8 bytes, go digit by digit.
    """
    width = len(bstr)
    cand = commas[gaps == width + 1] - width  # first digit of each full-width token
    if cand.size == 0:
        return True
    if width > 8 or len(u) < 8:  # int32 bound (vocab unknown) or a tiny block
        return _below_bound_wide(u, cand, bstr)
    near_end = cand > len(u) - 8
    if near_end.any() and not _below_bound_wide(u, cand[near_end], bstr):
        return False
    words = np.ndarray((len(u) - 7,), dtype=">u8", buffer=u, strides=(1,))
    vals = words[cand[~near_end]] >> np.uint64(8 * (8 - width))
    return bool((vals <= np.uint64(int.from_bytes(bstr, "big"))).all())


def _below_bound_wide(u: np.ndarray, cand: np.ndarray, bstr: bytes) -> bool:
    """Digit-by-digit version of _below_bound."""
    for k in range(len(bstr)):
        if cand.size == 0:
            return True
        digit = u[cand + k]
        if (digit > bstr[k]).any():
            return False
        cand = cand[digit == bstr[k]]
    return True  # the survivors equal bound-1 exactly, which is allowed


def _check_mask_block(parts: list[memoryview]) -> np.ndarray | None:
    """Lengths of each 0/1 span if all are valid, else None.

    Joined, a valid block is digit, comma (, space) repeated exactly: one stride for a
    block of one style.  A block mixing ``[0,1]`` and ``[0, 1]`` is checked token by
    token: every gap between commas holds one digit.
    """
    joined = _join(parts, _MASK_CHARS)
    if joined is None:
        return None
    u, ends, spaced = joined
    step = 3 if spaced else 2
    if (
        len(u) % step == 0
        and (u[1::step] == 44).all()
        and (u[0::step] >= 48).all()
        and (not spaced or (u[2::step] == 32).all())
    ):
        return np.diff(ends, prepend=0) // step
    if not spaced:
        return None
    commas, gaps = _token_gaps(u, spaced)
    if not (gaps == 2).all():
        return None
    return np.diff(np.searchsorted(commas, ends - 1, side="right"), prepend=0)


@dataclass
class _Candidate:
    """A line whose skeleton parsed; its arrays still need the vectorised check."""

    line: int
    lo: int
    hi: int
    ids: tuple[int, int]
    mask: tuple[int, int]
    rid: str | None


def _try_skeleton(buf: bytes, lo: int, hi: int, line: int) -> _Candidate | None:
    """Parse a line with both arrays swapped for placeholders; None means 'use slow path'."""
    s1, e1 = _value_span(buf, lo, hi, _IDS_KEY)
    if s1 < 0:
        return None
    # Search after the ids first: scanning 50 KB of digits for the key is the costly part.
    s2, e2 = _value_span(buf, e1 + 1, hi, _MASK_KEY)
    if s2 < 0:
        s2, e2 = _value_span(buf, lo, s1, _MASK_KEY)
    if s2 < 0:
        return None
    (a, b, pa), (c, d, pc) = sorted([(s1, e1, _IDS_PH), (s2, e2, _MASK_PH)])
    if c <= b:
        return None
    rest = (buf[lo:a], buf[b + 1 : c], buf[d + 1 : hi])
    # A string equal to a placeholder needs a \u0000 escape; the arrays cannot hold one
    # (they must be digits to pass), so checking the rest makes the placeholders unique.
    if any(_NUL_ESCAPE in part for part in rest):
        return None
    skeleton = b"".join((rest[0], pa, rest[1], pc, rest[2]))
    try:
        obj = orjson.loads(skeleton)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    if obj.get("input_ids") != _IDS_PH_VAL or obj.get("loss_mask") != _MASK_PH_VAL:
        return None  # the arrays we found were not the top-level ones
    if "id" in obj:
        rid = obj["id"]
        if not ((type(rid) is str and rid) or type(rid) is int):
            return None
    return _Candidate(line, lo, hi, (s1 + 1, e1), (s2 + 1, e2), _canonical_id(obj))


def _vector_check(buf: bytes, cands: list[_Candidate], bound: int) -> list[tuple[int, int] | None]:
    """(tokens, loss tokens) per candidate, or None where the slow path must decide."""
    if not cands:
        return []
    view = memoryview(buf)
    ids_parts = [view[c.ids[0] : c.ids[1]] for c in cands]
    mask_parts = [view[c.mask[0] : c.mask[1]] for c in cands]
    ntok = _check_ids_block(ids_parts, bound)
    nmask = _check_mask_block(mask_parts)
    if ntok is None or nmask is None:
        if len(cands) == 1:
            return [None]
        # Rare: something in this block is off.  Check one by one to find who.
        return [r for c in cands for r in _vector_check(buf, [c], bound)]
    out: list[tuple[int, int] | None] = []
    for c, n, m in zip(cands, ntok.tolist(), nmask.tolist(), strict=True):
        out.append((n, buf.count(b"1", c.mask[0], c.mask[1])) if n == m else None)
    return out


def _iter_lines(buf: bytes) -> Iterator[tuple[int, int, bool]]:
    """(start, end, newline follows) of each line in buf."""
    pos, n = 0, len(buf)
    while pos < n:
        end = buf.find(b"\n", pos)
        if end < 0:
            yield pos, n, False
            return
        yield pos, end, True
        pos = end + 1


def _is_blank(buf: bytes, lo: int, hi: int) -> bool:
    return lo == hi or (buf[lo] in _WS and not buf[lo:hi].strip())


def _slow_line(line: bytes, limits: _Limits) -> tuple[dict | None, tuple[str, str] | None]:
    """Parse and check one line exactly: (record, None) or (None, (reason, detail))."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None, _reason_for_parse_error(line)
    problem = _validate_obj(obj, limits)
    return (None, problem) if problem else (obj, None)


def scan_bytes(buf: bytes, base_offset: int, limits: _Limits) -> _RangeResult:
    """Validate every line of buf (whole lines of one file starting at base_offset)."""
    lines = list(_iter_lines(buf))
    blank = 0
    cands: list[_Candidate] = []
    slow: list[int] = []
    for i, (lo, hi, _) in enumerate(lines):
        if _is_blank(buf, lo, hi):
            blank += 1
            continue
        cand = _try_skeleton(buf, lo, hi, i)
        if cand is None:
            slow.append(i)
        else:
            cands.append(cand)
    verdict: dict[int, tuple[int, int, str | None] | None] = {}
    for c, r in zip(cands, _vector_check(buf, cands, limits.vocab_bound), strict=True):
        if r is None:
            slow.append(c.line)
        else:
            verdict[c.line] = (r[0], r[1], c.rid)
    return _assemble(buf, base_offset, lines, blank, verdict, sorted(slow), limits)


def _assemble(
    buf: bytes,
    base_offset: int,
    lines: list[tuple[int, int, bool]],
    blank: int,
    fast: dict[int, tuple[int, int, str | None] | None],
    slow: list[int],
    limits: _Limits,
) -> _RangeResult:
    """Merge fast and slow verdicts in line order and apply the length policy."""
    res = _RangeResult(len(lines), blank, *(np.empty(0) for _ in range(6)), ids=[])
    cols: dict[str, list] = {
        k: [] for k in ("line", "offset", "length", "has_nl", "tokens", "loss")
    }
    objs: dict[int, dict] = {}
    for i in slow:
        lo, hi, _ = lines[i]
        obj, problem = _slow_line(buf[lo:hi], limits)
        if problem is not None:
            res.rejects.append((i, *problem))
            continue
        assert obj is not None
        objs[i] = obj
        fast[i] = (len(obj["input_ids"]), sum(obj["loss_mask"]), _canonical_id(obj))
    for i in sorted(fast):
        ntok, nloss, rid = fast[i]  # type: ignore[misc]
        lo, hi, nl = lines[i]
        if limits.max_seq_len is not None and ntok > limits.max_seq_len:
            if limits.overlength == "drop":
                res.dropped.append((i, ntok))
                continue
            obj = objs.get(i) or orjson.loads(buf[lo:hi])
            obj["input_ids"] = obj["input_ids"][: limits.max_seq_len]
            obj["loss_mask"] = obj["loss_mask"][: limits.max_seq_len]
            res.replaced[len(cols["line"])] = orjson.dumps(obj)
            res.truncated += 1
            ntok, nloss = limits.max_seq_len, sum(obj["loss_mask"])
        for k, v in zip(cols, (i, base_offset + lo, hi - lo, nl, ntok, nloss), strict=True):
            cols[k].append(v)
        res.ids.append(rid)
    res.line = np.asarray(cols["line"], np.int64)
    res.offset = np.asarray(cols["offset"], np.int64)
    res.length = np.asarray(cols["length"], np.int64)
    res.has_nl = np.asarray(cols["has_nl"], bool)
    res.tokens = np.asarray(cols["tokens"], np.int64)
    res.loss_tokens = np.asarray(cols["loss"], np.int64)
    return res


# --------------------------------------------------------------------------- inputs, ranges


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def resolve_inputs(
    inputs: Sequence[str | os.PathLike[str]], base: str | os.PathLike[str] | None = None
) -> list[Path]:
    """Expand globs (sorted, ``**`` recursive) and check literal paths; each file once.

    The one expansion of ``inputs``: the workflow (rules/common.smk), the merge, ``plan``
    and ``verify`` all call it, so they never disagree on which shards there are.  Globs
    are expanded here, not by the caller, so an empty match can name the pattern.  An
    existing file is taken literally even when its name holds ``[`` or ``*``.  Relative
    entries are relative to ``base`` (default: the working directory), and returned as
    written, relative to it.
    """
    root = os.fspath(base) if base is not None else None

    def on_disk(p: str) -> str:
        return os.path.join(root, p) if root is not None else p

    out: list[Path] = []
    seen: set[Path] = set()
    for entry in inputs:
        text = os.fspath(entry)
        pattern = None
        if os.path.isfile(on_disk(text)):
            matches = [text]
        elif glob.has_magic(text):
            pattern = text
            matches = sorted(glob.glob(text, root_dir=root, recursive=True))
            if not matches:
                raise InputError(
                    f"input glob {text!r} matches no file (config key: inputs): it looked "
                    f"in {_glob_dir(on_disk(text))}; fix the pattern or the directory"
                )
        else:
            there = os.path.lexists(on_disk(text))
            problem = _not_a_shard(on_disk(text)) if there else None
            if problem is not None:
                raise InputError(_not_a_shard_message(text, None, problem))
            where = os.path.abspath(on_disk(text))
            raise InputError(
                f"input {text!r} does not exist ({where}; config key: inputs): fix the "
                "path, or write a glob to match several shards"
            )
        for m in matches:
            # Every match must be a shard: a directory, a broken link or an unreadable
            # file in a glob is a mistake to name, not a shard to drop without a word.
            problem = _not_a_shard(on_disk(m))
            if problem is not None:
                raise InputError(_not_a_shard_message(m, pattern, problem))
            key = Path(on_disk(m)).resolve()
            if key not in seen:
                seen.add(key)
                out.append(Path(m))
    if not out:
        raise InputError("no input files (config key: inputs)")
    return out


def _glob_dir(pattern: str) -> str:
    """The directory a glob searched (its part before the first wildcard), absolute, and
    whether it exists: a relative pattern is read from the working directory, which may
    not be where the user thought."""
    fixed: list[str] = []
    for part in Path(pattern).parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    where = os.path.abspath(os.path.join(*fixed)) if fixed else os.getcwd()
    return where if os.path.isdir(where) else f"{where}, which does not exist"


def _not_a_shard(path: str) -> str | None:
    """Why ``path`` cannot be read as a shard (a readable regular file, or a symlink to
    one), in words for the message; None when it can.

    The type is checked before anything is opened: opening a FIFO would block.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            return f"a broken symlink (to {os.readlink(path)!r}, which does not exist)"
        return "gone (removed while the inputs were listed)"
    except OSError as exc:
        return f"not reachable ({exc.strerror})"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket or device file"
        return f"{kind}, not a regular file"
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:
        return f"not readable ({exc.strerror})"
    return None


def _not_a_shard_message(path: str, pattern: str | None, problem: str) -> str:
    """One sentence: the path, the glob that matched it, what it is, what to do."""
    where = f"input glob {pattern!r} matches {path!r}" if pattern else f"input {path!r}"
    fix = (
        "remove it or narrow the glob so that it matches only JSON-lines files"
        if pattern
        else "fix or remove that entry"
    )
    return f"{where}, which is {problem}: {fix} (config key: inputs)"


def input_identity(
    files: Sequence[str | os.PathLike[str]], content: bool = False
) -> list[dict[str, Any]]:
    """Each input's path, size and mtime_ns: one stat each, no read (``content``: and its
    sha256, for the demo's few-KB shards, see :func:`identity_as_made`).

    What the merge records (stats.json) and what the workflow compares on every
    invocation (the merge's settings-file name, rules/common.smk).  Any change of size or
    mtime counts, backwards too: a shard replaced by an older copy (``cp -p``, ``rsync
    -a``, ``tar x``) keeps an mtime older than train.jsonl's, which Snakemake's own
    trigger never sees.
    """
    out = []
    for f in files:
        st = os.stat(f)
        out.append({"path": os.fspath(f), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
        if content:
            out[-1]["sha256"] = _sha256_file(Path(f))
    return out


def identity_as_made(
    files: Sequence[str | os.PathLike[str]], made: Sequence[dict[str, Any]] | None
) -> list[str | dict[str, Any]]:
    """The merge's view of shards this workflow makes (the demo's): each path alone while
    the file is as it was made (or not made yet), its :func:`input_identity` once changed.

    ``made``: what the making stage recorded (demo_data's settings file), compared by
    sha256, not mtime: Snakemake itself touches a job's outputs after the job (seen: the
    shards' mtime moved 25 ms past what demo_data recorded), and the demo's shards are a few
    KB.  A plain stat would not do either: a first run names the merge's settings before the
    shards exist, and a name that changed once they do would rerun the merge for nothing.
    """
    ref = {os.path.normpath(r["path"]): r for r in made or []}
    out: list[str | dict[str, Any]] = []
    for f in files:
        p = os.path.normpath(os.fspath(f))
        rec = ref.get(p)
        if rec is None or not os.path.exists(f) or _sha256_file(Path(f)) == rec.get("sha256"):
            out.append(p)
        else:
            out.append({**input_identity([f], content=True)[0], "path": p})
    return out


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9)) + f".{ns % 10**9:09d}"


def input_changes(
    recorded: Sequence[dict[str, Any]],
    current: Sequence[str | os.PathLike[str]] | None = None,
    *,
    base: str | os.PathLike[str] | None = None,
    content: bool = False,
) -> list[str]:
    """How the inputs differ now from what the merge read (stats.json's ``inputs``).

    One line per shard added, gone or changed, naming it; empty when they are the same.
    ``current``: the shards the config resolves to now (None: check the recorded ones
    only).  A change is a different size or mtime_ns (a stat); with ``content`` and a
    recorded sha256 the bytes decide instead (a touched but unchanged shard is the same
    data; one changed with its size and mtime restored is not): ``hsextract verify``
    reads every input, the workflow and ``hsextract plan`` only stat them.
    """

    def key(p: str | os.PathLike[str]) -> str:
        return os.path.normpath(os.fspath(p))

    def on_disk(p: str) -> Path:
        return Path(base, p) if base is not None else Path(p)

    problems = []
    old = {key(r["path"]): r for r in recorded}
    if current is not None:
        now = [key(p) for p in current]
        for p in now:
            if p not in old:
                problems.append(f"{p}: an input now, not read by the merge")
        for p in old:
            if p not in now:
                problems.append(f"{p}: read by the merge, no longer an input")
        if not problems and now != list(old):
            problems.append(f"inputs: now in another order ({', '.join(now)})")
    for p, rec in old.items():
        if current is not None and p not in now:
            continue
        f = on_disk(p)
        try:
            st = f.stat()
        except OSError as exc:
            problems.append(f"{p}: read by the merge, now unreadable ({exc.strerror})")
            continue
        diff = []
        if st.st_size != rec.get("bytes", st.st_size):
            diff.append(f"{rec['bytes']} -> {st.st_size} bytes")
        if st.st_mtime_ns != rec.get("mtime_ns", st.st_mtime_ns):
            diff.append(f"mtime {_when(rec['mtime_ns'])} -> {_when(st.st_mtime_ns)}")
        if content and rec.get("sha256"):
            got = _sha256_file(f)
            if got == rec["sha256"]:
                continue
            diff.insert(0, f"sha256 {rec['sha256'][:12]}... -> {got[:12]}...")
        if diff:
            problems.append(f"{p}: changed since the merge read it ({', '.join(diff)})")
    return problems


def _plan_ranges(path: Path, target: int) -> list[tuple[int, int]]:
    """Split a file into byte ranges that end just after a newline (or at EOF)."""
    size = path.stat().st_size
    ranges: list[tuple[int, int]] = []
    start = 0
    with open(path, "rb") as f:
        while start < size:
            cut = start + target
            if cut >= size:
                ranges.append((start, size))
                break
            f.seek(cut)
            while True:
                block = f.read(1 << 16)
                if not block:
                    cut = size
                    break
                nl = block.find(b"\n")
                if nl >= 0:
                    cut += nl + 1
                    break
                cut += len(block)
            ranges.append((start, cut))
            start = cut
    return ranges


def _scan_task(task: tuple[str, int, int, _Limits]) -> _RangeResult:
    """Worker entry point: read one byte range and validate its lines."""
    path, start, end, limits = task
    with open(path, "rb") as f:
        buf = os.pread(f.fileno(), end - start, start)
    if len(buf) != end - start:
        raise InputError(f"{path} changed while it was being read (expected {end} bytes)")
    return scan_bytes(buf, start, limits)


def _tune_malloc() -> None:
    """Keep freed buffers in the heap instead of returning them to the OS.

    Fresh pages cost microseconds each to fault in on a VM; with 8 MB ranges that was a
    third of the validation time.  Memory stays bounded by the largest range's buffers.
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD


#: prctl(2) option: the signal the kernel sends a process when its parent dies.
_PR_SET_PDEATHSIG = 1
#: Where a merge's (or split's) pool workers register, inside its output dir, one empty
#: file each, ``<parent pid>-<parent start>-<worker pid>-<worker start>`` (start: clock
#: ticks since boot, so a reused pid is never taken for the original): what lets the next
#: run stop a worker that outlived its killed parent, and nothing else.
WORKERS_DIR = ".pool-workers"
_WORKER_ENTRY = re.compile(r"(\d+)-(\d+)-(\d+)-(\d+)")


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this worker when its parent dies (Linux ``prctl``).

    Why: a fork worker inherits the parent's end of the task pipe, so when the parent is
    SIGKILLed (OOM killer, scheduler, ``kill -9``) no EOF ever reaches it and it waits
    forever: a killed merge left two such orphans.  The parent is checked again after the
    call: it may have died before, and then no signal would come.  Elsewhere (no prctl)
    this does nothing, and the next run's :func:`_stop_orphan_workers` stops survivors.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(
            ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL),
            ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0),
        )  # fmt: skip
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def _init_worker(parent: int, parent_start: str | None, registry: str | None) -> None:
    """Pool worker start-up: die with the parent, register for the next run, tune malloc."""
    _die_with_parent(parent)
    me = os.getpid()
    if registry is not None and parent_start is not None:
        # Best effort: the death signal is what stops a worker; this only backs it up.
        with contextlib.suppress(OSError):
            name = f"{parent}-{parent_start}-{me}-{start_time(me)}"
            os.close(os.open(Path(registry, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    _tune_malloc()


def _alive_as(pid: int, start: str) -> bool:
    """Whether ``pid`` is still the process that started at ``start`` and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] not in ("Z", "X") and fields[19] == start


def _stop_orphan_workers(registry: Path) -> list[int]:
    """SIGKILL the registered pool workers whose parent is dead; return their pids.

    Only provably ours: a worker registered itself (a file of our uid, of the name we
    write, in our output dir), its parent is no longer the process it registered under,
    and its pid is still the process it registered as (same start time, so never a pid
    reused by someone else).  The entries of dead parents go; a live parent's stay.
    """
    stopped: list[int] = []
    entries: list[os.DirEntry[str]] = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(registry) as it:
        entries = list(it)
    for entry in entries:
        m = _WORKER_ENTRY.fullmatch(entry.name)
        if m is None:
            continue  # not a name we write: left alone
        with contextlib.suppress(FileNotFoundError):
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            parent, parent_start, pid, start = m.groups()
            if _alive_as(int(parent), parent_start):
                continue  # its merge is running
            if _alive_as(int(pid), start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
                    stopped.append(int(pid))
            os.unlink(entry.path)
    with contextlib.suppress(OSError):
        registry.rmdir()  # not empty: a live merge's workers
    if stopped:
        log.info("stopped pool workers %s left running by a killed run (%s)", stopped, registry)
    return stopped


@contextlib.contextmanager
def _pool(
    workers: int, total_bytes: int, registry: Path | None = None
) -> Iterator[ProcessPoolExecutor | None]:
    """A fork pool for big inputs; None (run in-process) for small ones.

    Its workers die with this process (:func:`_die_with_parent`) and register in
    ``registry`` (a dir in the output dir), so the next run can stop any that survived;
    the entries go once the pool has shut down.
    """
    if workers <= 1 or total_bytes < PARALLEL_MIN_BYTES:
        yield None
        return
    me = os.getpid()
    me_start = start_time(me)
    if registry is not None:
        registry.mkdir(mode=0o700, exist_ok=True)
    # fork: the workers need no imports and start in milliseconds; the merge runs in its
    # own script process, with no threads that fork could copy mid-lock.
    pool = ProcessPoolExecutor(
        workers,
        mp_context=get_context("fork"),
        initializer=_init_worker,
        initargs=(me, me_start, str(registry) if registry is not None else None),
    )
    try:
        yield pool
    finally:
        pool.shutdown()
        if registry is not None:
            for entry in _scan_names(registry, f"{me}-{me_start}-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(registry / entry)
            with contextlib.suppress(OSError):
                registry.rmdir()


def _scan_names(path: Path, prefix: str) -> list[str]:
    """Names in ``path`` that start with ``prefix`` (none when it is gone)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return [n for n in os.listdir(path) if n.startswith(prefix)]
    return []


def _remove_dead_temps(out_dir: Path, names: re.Pattern[str]) -> list[str]:
    """Remove the temporary files (``.<name>.tmp-<pid>``, see :func:`_tmp_name`) that a
    killed writer left in ``out_dir``; return their names.

    Only provably ours and dead: ``<name>`` is one this stage writes there (``names``), a
    regular file of our uid, and its writer is gone -- no process has its pid, or the one
    that has it started after the file was last changed (a reused pid), and it is not this
    process.  Anything else stays: a live writer's file, or someone's.
    """
    removed = []
    clock = os.sysconf("SC_CLK_TCK")
    for name in _scan_names(out_dir, "."):
        m = re.fullmatch(r"\.(.+)\.tmp-(\d+)", name)
        if m is None or not names.fullmatch(m.group(1)):
            continue
        path = out_dir / name
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            pid = int(m.group(2))
            if pid == os.getpid():
                continue
            started = start_time(pid)
            if started is not None and _boot_time() + int(started) / clock <= st.st_ctime + 1:
                continue  # that process may have written it: it stays
            os.unlink(path)
            removed.append(name)
    if removed:
        log.info("removed temporary files of a killed run in %s: %s", out_dir, removed)
    return removed


def _boot_time() -> float:
    """The epoch second the system booted (/proc/stat ``btime``): process start times are
    clock ticks since then."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    return 0.0


def _clean_after_killed(out_dir: Path, names: re.Pattern[str]) -> None:
    """What a killed merge or split left in its output dir: its surviving pool workers
    first (they may still write to its temp file), then its temp files."""
    _stop_orphan_workers(out_dir / WORKERS_DIR)
    _remove_dead_temps(out_dir, names)


def _map(pool: ProcessPoolExecutor | None, fn: Any, tasks: list) -> list:
    return list(pool.map(fn, tasks) if pool is not None else map(fn, tasks))


def _map_lazy(pool: ProcessPoolExecutor | None, fn: Any, tasks: Sequence) -> Iterator:
    """Submitted now (a pool) or run when iterated (in-process); results in task order."""
    return pool.map(fn, tasks) if pool is not None else map(fn, tasks)


# --------------------------------------------------------------------------- merge


@dataclass
class _Kept:
    """Columns of the kept records, in canonical (file, line) order."""

    file: list[int] = field(default_factory=list)
    line: list[int] = field(default_factory=list)
    offset: list[int] = field(default_factory=list)
    length: list[int] = field(default_factory=list)
    has_nl: list[bool] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    loss: list[int] = field(default_factory=list)
    assigned: list[str | None] = field(default_factory=list)  # id to splice in, if any
    replaced: dict[int, bytes] = field(default_factory=dict)  # re-serialised records


def _id_labels(files: list[Path]) -> list[str]:
    """Basenames for assigned ids, or paths relative to the common parent if those clash."""
    names = [p.name for p in files]
    if len(set(names)) == len(names):
        return names
    common = os.path.commonpath([str(p.resolve().parent) for p in files])
    return [os.path.relpath(p.resolve(), common) for p in files]


def _reject(path: str, line: int, reason: str, detail: str) -> dict[str, Any]:
    return {"file": path, "line": line, "reason": reason, "detail": detail}


class _Collector:
    """Folds range results, in canonical order, into kept records, rejects and counts.

    Ids are checked here, not in the workers: a duplicate is the *later* occurrence in
    (file, line) order, whichever worker saw it.
    """

    def __init__(self, files: list[Path], limits: _Limits) -> None:
        self.files, self.limits = files, limits
        self.labels = _id_labels(files)
        self.kept = _Kept()
        self.rejects: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()
        self.line_base = [0] * len(files)
        self.seen: dict[str, tuple[str, int]] = {}

    def add(self, fi: int, res: _RangeResult) -> None:
        path, base = str(self.files[fi]), self.line_base[fi]
        self.line_base[fi] += res.n_lines
        self.counts["lines"] += res.n_lines
        self.counts["blank_lines"] += res.blank
        for ln, reason, detail in res.rejects:
            self.rejects.append(_reject(path, base + ln + 1, reason, detail))
        for ln, ntok in res.dropped:
            detail = f"{ntok} tokens > max_seq_len {self.limits.max_seq_len}"
            self.rejects.append(_reject(path, base + ln + 1, "over_length_dropped", detail))
        for j, rid in enumerate(res.ids):
            self._keep(fi, path, base + int(res.line[j]) + 1, j, rid, res)

    def _keep(
        self, fi: int, path: str, line_no: int, j: int, rid: str | None, res: _RangeResult
    ) -> None:
        assigned = None
        if rid is None:
            rid = assigned = f"{self.labels[fi]}:{line_no}"
        if rid in self.seen:
            first = self.seen[rid]
            detail = f"id {rid!r} already at {first[0]}:{first[1]}"
            self.rejects.append(_reject(path, line_no, "duplicate_id", detail))
            return
        self.seen[rid] = (path, line_no)
        k = self.kept
        if j in res.replaced:
            k.replaced[len(k.file)] = res.replaced[j]
            self.counts["truncated"] += 1
        k.file.append(fi)
        k.line.append(line_no)
        k.offset.append(int(res.offset[j]))
        k.length.append(int(res.length[j]))
        k.has_nl.append(bool(res.has_nl[j]))
        k.tokens.append(int(res.tokens[j]))
        k.loss.append(int(res.loss_tokens[j]))
        k.assigned.append(assigned)


def _splice_prefix(rid: str) -> bytes:
    return b'"id":' + orjson.dumps(rid) + b","


def _splice_id(data: bytes, rid: str) -> bytes:
    """Insert ``"id": ...`` as the first member; the rest of the record stays as it was."""
    brace = data.index(b"{")
    return data[: brace + 1] + _splice_prefix(rid) + data[brace + 1 :]


# One output record: (file index, offset, length, newline follows, id to splice, new bytes).
_Item = tuple[int, int, int, bool, "str | None", "bytes | None"]


def _out_len(item: _Item) -> int:
    _, _, n, _, rid, rep = item
    size = (len(rep) if rep is not None else n) + 1
    return size + (len(_splice_prefix(rid)) if rid is not None else 0)


def _write_task(task: tuple[str, list[str], int, list[_Item]]) -> int:
    """Write a contiguous slice of the output at its offset; returns the bytes written.

    Unchanged lines (the common case) are copied file-to-file by the kernel, newline
    included, without passing through Python.
    """
    out_path, files, pos, items = task
    fds = [os.open(p, os.O_RDONLY) for p in files]
    out = os.open(out_path, os.O_WRONLY)
    start = pos
    try:
        for fi, off, n, nl, rid, rep in items:
            if rep is None and rid is None and nl:
                pos += _copy_range(fds[fi], out, off, n + 1, pos)
                continue
            data = rep if rep is not None else os.pread(fds[fi], n, off)
            if rid is not None:
                data = _splice_id(data, rid)
            pos += _pwrite_all(out, data + b"\n", pos)
    finally:
        for fd in (*fds, out):
            os.close(fd)
    return pos - start


def _copy_range(src: int, dst: int, offset: int, count: int, dst_offset: int) -> int:
    """copy_file_range with a read/write fallback (other filesystems, older kernels)."""
    done = 0
    with contextlib.suppress(OSError):
        while done < count:
            n = os.copy_file_range(src, dst, count - done, offset + done, dst_offset + done)
            if n == 0:
                break
            done += n
    if done < count:
        data = os.pread(src, count - done, offset + done)
        if len(data) != count - done:
            raise InputError("an input file shrank while the merge was writing; rerun it")
        done += _pwrite_all(dst, data, dst_offset + done)
    return done


def _pwrite_all(fd: int, data: bytes, pos: int) -> int:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n
    return len(data)


def _write_records(
    pool: ProcessPoolExecutor | None,
    out_path: Path,
    files: list[Path],
    kept: _Kept,
    order: np.ndarray,
    parts: int,
    final: Path | None = None,
    while_syncing: Callable[[], Any] | None = None,
) -> int:
    """Write kept records in ``order`` as ``parts`` slices at known offsets, then fsync.

    ``final``: the name ``out_path`` (a temp file) becomes, for a full disk's message.
    ``while_syncing``: called once the slices are written, before the fsync; what it
    submits to the pool runs while this process waits on the disk.
    """
    items: list[_Item] = [
        (
            kept.file[k],
            kept.offset[k],
            kept.length[k],
            kept.has_nl[k],
            kept.assigned[k],
            kept.replaced.get(k),
        )
        for k in order.tolist()
    ]
    sizes = np.fromiter((_out_len(it) for it in items), np.int64, len(items))
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(items) else 0
    # Equal-byte slices; the boundaries do not change a single output byte.
    cuts = np.searchsorted(ends, [total * i / parts for i in range(1, parts)], side="right")
    bounds = [0, *cuts.tolist(), len(items)]
    names = [str(p) for p in files]
    tasks = [
        (str(out_path), names, int(ends[a - 1]) if a else 0, items[a:b])
        for a, b in zip(bounds, bounds[1:], strict=False)
        if b > a
    ]
    with _disk_full_is_an_error(final or out_path, total):
        with open(out_path, "wb") as f:
            f.truncate(total)
        # A worker's OSError comes back here with its errno (it is pickled whole).
        written = sum(_map(pool, _write_task, tasks))
        if written != total:
            raise InputError(
                f"wrote {written} bytes to {out_path}, planned {total}; inputs changed?"
            )
        if while_syncing is not None:
            while_syncing()
        fd = os.open(out_path, os.O_RDONLY)
        try:
            os.fsync(fd)  # NFS and quotas may report a full disk only here
        finally:
            os.close(fd)
    return total


#: errnos of a full filesystem: out of space, over the user's quota.
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def _disk_full_is_an_error(path: Path, planned: int) -> Iterator[None]:
    """Turn a full disk while writing ``path`` into a :class:`DiskFullError` that says so.

    Why: it is the user's to fix (free space, another output_root), not a bug, and the
    traceback named only a worker's pwrite.  The caller removes the temp file.
    """
    try:
        yield
    except OSError as exc:
        if exc.errno not in _DISK_FULL:
            raise
        try:
            free = human(shutil.disk_usage(Path(path).parent).free)
        except OSError:
            free = "unknown"
        what = "disk quota exceeded" if exc.errno == errno.EDQUOT else "no space left on device"
        raise DiskFullError(
            f"{what} while writing {path} ({human(planned)} to write, {free} free on its "
            "filesystem; nothing of it was kept): free space there or set output_root to a "
            "larger filesystem, then rerun"
        ) from None


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _write_tmp(path: Path, data: bytes) -> Path:
    """``data`` under ``path``'s temp name, fsync'ed; the temp name, for the caller to
    rename into place.  Nothing is left on failure (a full disk: :class:`DiskFullError`)."""
    tmp = _tmp_name(path)
    try:
        with _disk_full_is_an_error(path, len(data)), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return tmp


def _write_atomic(path: Path, data: bytes) -> None:
    """Write a small file under a temp name, fsync, rename: never a partial final file."""
    tmp = _write_tmp(path, data)
    try:
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def publish(staged: Sequence[Path], published: Sequence[Path]) -> None:
    """Put each staged file under its published name: a hard link (no copy of a ~80 GB
    train.jsonl, no second disk's worth) made under a temp name and renamed over the old.

    Why a stage writes to one name and its readers read another: Snakemake removes a job's
    outputs before it runs and a failed job's after, so a merge that fails on a bad input
    (too many rejects) took the finished run's train.jsonl and stats.json with it, and a
    trainer reading the run broke until the input was fixed.  The published files are no
    job's output but this one's, which runs only after a merge succeeded.  A filesystem
    without hard links gets a copy (same temp name, fsync'ed, renamed).  Temp files a
    killed publish left go first.

    Every file ends with one modification time, now: a published file is its staged one
    (the same inode), so it kept the merge's time of writing it, and Snakemake fails a job
    whose output is older than any of its inputs ("clock skew"): train.jsonl, written
    first, was older than rejects.jsonl, written a millisecond later (seen in CI).
    """
    for src, dst in zip(staged, published, strict=True):
        src, dst = Path(src), Path(dst)
        _remove_dead_temps(dst.parent, _MERGE_OUTPUTS)
        tmp = _tmp_name(dst)
        try:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            try:
                os.link(src, tmp)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, *_DISK_FULL):
                    raise
                # EPERM, EXDEV, EMLINK, ENOTSUP ...: links not to be had here.
                with _disk_full_is_an_error(dst, src.stat().st_size):
                    shutil.copyfile(src, tmp)
                    fd = os.open(tmp, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            os.replace(tmp, dst)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    now = time.time_ns()
    for dst in published:
        os.utime(dst, ns=(now, now))


def _histogram(lengths: np.ndarray, max_seq_len: int) -> list[dict[str, int]]:
    """Power-of-two bins capped at max_seq_len: [1,1], [2,3], [4,7], ..., [.., max]."""
    edges = [1]
    while edges[-1] <= max_seq_len:
        edges.append(edges[-1] * 2)
    edges[-1] = max_seq_len + 1
    counts, _ = np.histogram(lengths, bins=edges)
    return [{"lo": edges[i], "hi": edges[i + 1] - 1, "count": int(c)} for i, c in enumerate(counts)]


def _stats(inputs: list[dict[str, Any]], col: _Collector, params: dict[str, Any]) -> dict[str, Any]:
    """stats.json: what went in, what came out, and why anything did not.

    numpy and Counter only: importing pandas cost ~0.3 s of a ~3 s merge for two counts.
    """
    kept = col.kept
    lengths = np.asarray(kept.tokens, np.int64)
    dropped = sum(r["reason"] == "over_length_dropped" for r in col.rejects)
    malformed = [r for r in col.rejects if r["reason"] != "over_length_dropped"]
    records_in = col.counts["lines"] - col.counts["blank_lines"]
    pct = np.percentile(lengths, [50, 90, 99]).tolist() if len(lengths) else [0.0] * 3
    return {
        "params": params,
        # What the merge read (input_identity, and each file's sha256): plan and verify
        # name a shard that changed since.
        "inputs": inputs,
        "records_in": records_in,
        "blank_lines": col.counts["blank_lines"],
        "records_out": len(lengths),
        "tokens_out": int(lengths.sum()),
        "loss_tokens_out": int(sum(kept.loss)),
        "records_with_assigned_id": sum(a is not None for a in kept.assigned),
        "truncated": col.counts["truncated"],
        "dropped_over_length": dropped,
        "rejected": len(malformed),
        "reject_fraction": len(malformed) / records_in if records_in else 0.0,
        "rejected_by_reason": dict(Counter(r["reason"] for r in malformed).most_common()),
        "rejected_by_file": dict(Counter(r["file"] for r in malformed).most_common()),
        "length": {
            "mean": float(lengths.mean()) if len(lengths) else 0.0,
            "min": int(lengths.min()) if len(lengths) else 0,
            "p50": pct[0],
            "p90": pct[1],
            "p99": pct[2],
            "max": int(lengths.max()) if len(lengths) else 0,
        },
        "length_histogram": _histogram(lengths, params["max_seq_len"]),
    }


def _dump_json(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


def merge_and_shuffle(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: Path,
    *,
    max_seq_len: int,
    overlength: str,
    seed: int,
    vocab_size: int | None,
    max_reject_fraction: float,
    workers: int | None = None,
    failed_rejects: Path | None = None,
) -> dict[str, Any]:
    """Validate every input line, drop or truncate over-long records, shuffle, write.

    Writes ``train.jsonl``, ``stats.json`` and ``rejects.jsonl`` in ``out_dir`` and returns
    the stats.  ``inputs`` holds paths and globs, expanded here (sorted).  When more than
    ``max_reject_fraction`` of the records are malformed it writes stats and rejects (also
    to ``failed_rejects``, default ``out_dir/``:data:`FAILED_REJECTS`), not train.jsonl,
    and raises RejectFractionError.  The three
    outputs are renamed into place only once all are written: a full disk raises
    :class:`DiskFullError` and leaves none of them new, and no temp file.  What a merge
    killed earlier left here (its temp files, pool workers that outlived it) goes first.
    ``workers`` defaults to the CPU count.
    """
    if overlength not in OVERLENGTH_POLICIES:
        raise InputError(f"merge.overlength must be one of {OVERLENGTH_POLICIES}: {overlength!r}")
    if max_seq_len < 1:
        raise InputError(f"max_seq_len must be >= 1, got {max_seq_len}")
    files = resolve_inputs(inputs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A merge killed mid-write (SIGKILL: no finally ran) left a full-size temp file and
    # maybe pool workers: they go before this merge writes anything.
    _clean_after_killed(out_dir, _MERGE_OUTPUTS)
    failed_rejects = Path(failed_rejects or out_dir / FAILED_REJECTS)
    if failed_rejects.parent != out_dir:
        _remove_dead_temps(failed_rejects.parent, _MERGE_OUTPUTS)
    limits = _Limits(vocab_size or INT32_BOUND, max_seq_len, overlength)
    workers = workers or min(os.cpu_count() or 1, 8)
    read = input_identity(files)
    tasks = [(str(p), a, b, limits) for p in files for a, b in _plan_ranges(p, RANGE_BYTES)]
    file_of = {str(p): i for i, p in enumerate(files)}
    params = {
        "max_seq_len": max_seq_len,
        "overlength": overlength,
        "seed": seed,
        "vocab_size": vocab_size,
        "max_reject_fraction": max_reject_fraction,
    }
    with _pool(workers, sum(r["bytes"] for r in read), out_dir / WORKERS_DIR) as pool:
        col = _Collector(files, limits)
        for task, res in zip(tasks, _map_lazy(pool, _scan_task, tasks), strict=True):
            col.add(file_of[task[0]], res)
        # Each input's sha256, for `hsextract verify` (the workflow itself compares only
        # sizes and mtimes, which cost no read): hashed by the pool while this process
        # waits for train.jsonl's fsync, when the cores are otherwise idle (bench/merge.py:
        # queued behind the scans it cost ~0.4 s of a ~3 s merge).  stats["inputs"] is
        # ``read`` itself, so the digests land in it.
        hashing: list[Iterator[str]] = []
        stats = _stats(read, col, params)
        rejects = b"".join(orjson.dumps(r) + b"\n" for r in col.rejects)

        def hash_inputs() -> None:
            hashing.append(_map_lazy(pool, _sha256_file, files))

        def add_digests() -> None:
            for rec, digest in zip(read, hashing.pop(), strict=True):
                rec["sha256"] = digest

        if _fails(stats):
            hash_inputs()
            add_digests()
        _check_fraction(stats, out_dir, len(files), col.rejects, rejects, failed_rejects)
        # A permutation of canonical (file, line) order: a function of seed and kept set.
        order = np.random.Generator(np.random.PCG64(seed)).permutation(len(col.kept.file))
        train = out_dir / "train.jsonl"
        # All three outputs are written under temp names and renamed only once all are
        # complete: a full disk (or any failure) midway leaves none of them half-new.
        tmps = {train: _tmp_name(train)}
        try:
            stats["bytes_out"] = _write_records(
                pool, tmps[train], files, col.kept, order, workers, train, hash_inputs
            )
            add_digests()
            if input_changes(read):
                raise InputError("input files changed during the merge; rerun it")
            tmps[out_dir / "rejects.jsonl"] = _write_tmp(out_dir / "rejects.jsonl", rejects)
            tmps[out_dir / "stats.json"] = _write_tmp(out_dir / "stats.json", _dump_json(stats))
            for final, tmp in tmps.items():
                os.replace(tmp, final)
        finally:
            for tmp in tmps.values():
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
    # A failed merge's rejects are of inputs that have since been fixed.
    failed_rejects.unlink(missing_ok=True)
    return stats


def reject_examples(
    rejects: Sequence[dict[str, Any]], limit: int = 3, total: int | None = None
) -> str:
    """The first few rejects as ``file:line: reason: detail``, for a message a person reads
    (rejects.jsonl holds them all): the counts alone do not say what to fix.  ``total``:
    how many malformed lines there are when ``rejects`` holds only the first ones."""
    malformed = [r for r in rejects if r["reason"] != "over_length_dropped"]
    shown = [f"{r['file']}:{r['line']}: {r['reason']}: {r['detail']}" for r in malformed[:limit]]
    total = len(malformed) if total is None else total
    more = f" (and {total - len(shown)} more)" if total > len(shown) else ""
    return "; ".join(shown) + more


def _fails(stats: dict[str, Any]) -> bool:
    """Whether :func:`_check_fraction` will fail this merge."""
    return (
        stats["records_in"] == 0
        or stats["reject_fraction"] > stats["params"]["max_reject_fraction"]
    )


def _check_fraction(
    stats: dict[str, Any],
    out_dir: Path,
    n_files: int,
    rejects: Sequence[dict[str, Any]],
    rejects_bytes: bytes,
    failed_rejects: Path,
) -> None:
    """Fail (after writing stats.json) on no records or too many malformed ones.

    The rejects of a failed merge also go to ``failed_rejects``, which the message names:
    Snakemake deletes a failed job's outputs, rejects.jsonl with them.
    """
    if stats["records_in"] == 0:
        _write_atomic(out_dir / "rejects.jsonl", rejects_bytes)
        _write_atomic(out_dir / "stats.json", _dump_json(stats))
        raise InputError(f"no records in {n_files} input file(s) (config key: inputs)")
    bound = stats["params"]["max_reject_fraction"]
    if _fails(stats):
        _write_atomic(out_dir / "rejects.jsonl", rejects_bytes)
        _write_atomic(out_dir / "stats.json", _dump_json(stats))
        _write_atomic(failed_rejects, rejects_bytes)
        reasons = ", ".join(f"{k}: {v}" for k, v in stats["rejected_by_reason"].items())
        raise RejectFractionError(
            f"{stats['rejected']} of {stats['records_in']} records rejected "
            f"({stats['reject_fraction']:.2%}) > merge.max_reject_fraction={bound} "
            f"({reasons}); first: {reject_examples(rejects)}. All are in "
            f"{failed_rejects}; fix the inputs or raise merge.max_reject_fraction"
        )


# --------------------------------------------------------------------------- chunks


#: How records are assigned to chunks; recorded in the index (a change re-extracts all).
ASSIGNMENT = "sha256(id)[:8] mod n_chunks; within a chunk by (hash, id)"


def id_hash(rid: str) -> int:
    """A stable 64-bit hash of a record id: the same on every machine and Python."""
    return int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "big")


def record_digest(rid: str, input_ids: Any, loss_mask: Any) -> bytes:
    """What a record contributes to its chunk's numbers: its id, tokens and loss mask.

    Defined on values (int32 ids, uint8 mask), not on JSON bytes, so the same digest comes
    from a JSON line (split, verify) and from a chunk file's own tensors (plan, verify).
    Other keys a record carries do not change the hidden states and are left out.
    """
    ids = np.ascontiguousarray(input_ids, dtype="<i4")
    mask = np.ascontiguousarray(loss_mask, dtype=np.uint8)
    b = rid.encode()
    h = hashlib.sha256(len(b).to_bytes(4, "little"))
    h.update(b)
    h.update(len(ids).to_bytes(4, "little"))
    h.update(ids.tobytes())
    h.update(mask.tobytes())
    return h.digest()


def content_digest(record_digests: Sequence[bytes]) -> str:
    """A chunk's content digest: its records' digests in chunk order."""
    h = hashlib.sha256(b"hsextract-chunk-content-v1")
    for d in record_digests:
        h.update(d)
    return h.hexdigest()


def _digest_task(task: tuple[str, int, int]) -> tuple[list[str], list[int], list[bytes]]:
    """Worker: ids, id hashes and record digests of every line of one byte range."""
    path, start, end = task
    with open(path, "rb") as f:
        buf = os.pread(f.fileno(), end - start, start)
    ids: list[str] = []
    hashes: list[int] = []
    digests: list[bytes] = []
    for lo, hi, _ in _iter_lines(buf):
        obj = orjson.loads(buf[lo:hi])
        rid = str(obj["id"])
        ids.append(rid)
        hashes.append(id_hash(rid))
        digests.append(record_digest(rid, obj["input_ids"], obj["loss_mask"]))
    return ids, hashes, digests


def split_chunks(
    merged: Path, outputs: Sequence[Path], index_out: Path, *, workers: int | None = None
) -> list[dict[str, Any]]:
    """Split train.jsonl into exactly len(outputs) chunk files and an index describing them.

    A record goes to chunk ``id_hash(id) % n_chunks`` and a chunk lists its records by
    (hash, id): a chunk's content depends only on which records exist, not on the merge's
    shuffle or on any other chunk, so adding or removing a few records changes a few
    chunks and a new ``seed`` changes none.  The index carries each chunk's content digest
    (see :func:`record_digest`), which is what decides whether its hidden states are
    current.  The merged file is re-validated (structure only) so a hand-edited
    train.jsonl fails here, not in the middle of extraction.  Chunk lines are the merged
    lines, byte for byte.
    """
    merged, outputs = Path(merged), [Path(p) for p in outputs]
    if not outputs:
        raise InputError("split_chunks needs at least one output (config key: n_chunks)")
    limits = _Limits(INT32_BOUND, None, "truncate")
    ranges = _plan_ranges(merged, RANGE_BYTES)
    tasks = [(str(merged), a, b, limits) for a, b in ranges]
    home = Path(index_out).parent  # chunks/: the pool registers there
    home.mkdir(parents=True, exist_ok=True)
    for d in {home, *(p.parent for p in outputs)}:
        _clean_after_killed(d, _SPLIT_OUTPUTS)
    workers = workers or min(os.cpu_count() or 1, 8)
    with _pool(workers, merged.stat().st_size, home / WORKERS_DIR) as pool:
        results = _map(pool, _scan_task, tasks)
        base = 0
        for res in results:
            if res.rejects or res.blank:
                line, reason = (res.rejects[0][:2]) if res.rejects else (-1, "blank line")
                raise ChunkInputError(
                    f"{merged}: line {base + line + 1 if line >= 0 else '?'} is not a valid "
                    f"record ({reason}); it changed after merge_and_shuffle: delete it and "
                    "rerun merge_and_shuffle"
                )
            base += res.n_lines
        digested = _map(pool, _digest_task, [(str(merged), a, b) for a, b in ranges])
    offsets = np.concatenate([r.offset for r in results]).tolist() if results else []
    lengths = np.concatenate([r.length for r in results]).tolist() if results else []
    tokens = np.concatenate([r.tokens for r in results]).tolist() if results else []
    rids = [i for d in digested for i in d[0]]
    hashes = [h for d in digested for h in d[1]]
    digests = [g for d in digested for g in d[2]]
    dup = next((r for r, c in Counter(rids).items() if c > 1), None)
    if dup is not None:
        raise ChunkInputError(
            f"{merged}: record id {dup!r} appears more than once; it changed after "
            "merge_and_shuffle: delete it and rerun merge_and_shuffle"
        )
    n = len(outputs)
    members: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(rids)), key=lambda i: (hashes[i], rids[i])):
        members[hashes[i] % n].append(i)
    buf = merged.read_bytes()
    source_sha = hashlib.sha256(buf).hexdigest()
    chunks = []
    for path, member in zip(outputs, members, strict=True):
        data = b"".join(buf[offsets[i] : offsets[i] + lengths[i]] + b"\n" for i in member)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, data)
        lens = [tokens[i] for i in member]
        chunks.append(
            {
                "path": path.name,
                "records": len(member),
                "tokens": sum(lens),
                "max_len": max(lens, default=0),
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "content_digest": content_digest([digests[i] for i in member]),
                # Where each line sits in train.jsonl: a lost chunk file is rebuilt from
                # these (restore_chunk) without re-splitting, and verify re-reads them.
                "lines": [[offsets[i], lengths[i]] for i in member],
            }
        )
    _remove_orphan_chunks(outputs)
    index = {
        "format": INDEX_FORMAT,
        "source": merged.name,
        "source_sha256": source_sha,
        "source_records": len(rids),
        "assignment": ASSIGNMENT,
        "n_chunks": n,
        "chunks": chunks,
    }
    _write_atomic(Path(index_out), _dump_json(index))
    return chunks


def _remove_orphan_chunks(outputs: Sequence[Path]) -> None:
    """Chunk files of a larger n_chunks left beside these: a fresh split has none."""
    names = {p.name for p in outputs}
    for d in {p.parent for p in outputs}:
        for old in d.glob("chunk_*.jsonl"):
            if old.name not in names and re.fullmatch(r"chunk_\d{5}\.jsonl", old.name):
                old.unlink(missing_ok=True)


def restore_chunk(path: Path, index: Path, merged: Path) -> None:
    """Rebuild a missing chunk file from train.jsonl and the index, byte for byte.

    The split is recorded as line offsets, so one chunk comes back without re-splitting
    (which would restamp every chunk and make Snakemake redo finished extractions).  The
    result must hash to the index's sha256, else train.jsonl itself changed.
    """
    path, merged = Path(path), Path(merged)
    entry = index_entry(path, index)
    if "lines" not in entry:
        raise ChunkInputError(
            f"{index} predates line offsets; rerun split_chunks to rebuild {path}"
        )
    parts = []
    try:
        with open(merged, "rb") as f:
            for offset, length in entry["lines"]:
                f.seek(offset)
                parts.append(f.read(length) + b"\n")
    except OSError as e:
        raise ChunkInputError(f"cannot rebuild {path} from {merged}: {e}") from e
    data = b"".join(parts)
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise ChunkInputError(
            f"cannot rebuild {path}: {merged} changed after split_chunks (its lines no longer "
            f"hash to the index's sha256); rerun merge_and_shuffle and split_chunks"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, data)


def index_entry(path: Path, index: Path) -> dict[str, Any]:
    try:
        entries = orjson.loads(Path(index).read_bytes())["chunks"]
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as e:
        raise ChunkInputError(
            f"cannot read chunk index {index} ({e}); rerun split_chunks to rebuild it"
        ) from e
    for entry in entries:
        if entry.get("path") == path.name:
            return entry
    raise ChunkInputError(f"{path.name} is not listed in {index}; rerun split_chunks")


def read_index(index: Path) -> dict[str, Any]:
    """chunks/index.json of the current layout, or a ChunkInputError saying what to rerun."""
    try:
        data = orjson.loads(Path(index).read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise ChunkInputError(f"cannot read chunk index {index} ({e}); rerun split_chunks") from e
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
        raise ChunkInputError(
            f"{index} has layout {data.get('format') if isinstance(data, dict) else '?'}, "
            f"this hsextract writes {INDEX_FORMAT}; rerun split_chunks (snakemake does)"
        )
    return data


def records_digest(records: Sequence[Record]) -> str:
    """The content digest of records as the client loaded them (see :func:`record_digest`)."""
    return content_digest([record_digest(r.id, r.input_ids, r.loss_mask) for r in records])


def load_chunk(
    path: Path,
    index: Path | None,
    *,
    max_seq_len: int | None = None,
    vocab_size: int | None = None,
    merged: Path | None = None,
) -> list[Record]:
    """Read a chunk for the extraction client, refusing anything changed since the split.

    With an index the file's sha256 must match (a truncated or edited chunk fails naming
    the file).  Every line is re-validated; ``max_seq_len`` (the config's one value)
    makes an over-long record an error instead of a silently clipped request.  A missing
    chunk file is rebuilt from ``merged`` (train.jsonl) when given.
    """
    path = Path(path)
    if not path.exists() and merged is not None and index is not None:
        restore_chunk(path, index, merged)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ChunkInputError(f"cannot read chunk {path}: {e}; rerun split_chunks") from e
    if index is not None:
        entry = index_entry(path, index)
        got = hashlib.sha256(data).hexdigest()
        if got != entry.get("sha256"):
            raise ChunkInputError(
                f"chunk {path} changed after split_chunks: sha256 {got[:16]}... != "
                f"{str(entry.get('sha256'))[:16]}... in {index} ({len(data)} bytes, index "
                f"says {entry.get('bytes')}); delete {path} and rerun: the next run rebuilds "
                "it from merged/train.jsonl"
            )
    limits = _Limits(vocab_size or INT32_BOUND, None, "truncate")
    records = []
    for n, (lo, hi, _) in enumerate(_iter_lines(data), start=1):
        obj, problem = _slow_line(data[lo:hi], limits)
        if problem is None and (obj is None or "id" not in obj):
            problem = ("missing_id", "chunk records carry the id merge_and_shuffle gave them")
        if problem is None and max_seq_len is not None and len(obj["input_ids"]) > max_seq_len:
            problem = ("over_length", f"{len(obj['input_ids'])} tokens > max_seq_len {max_seq_len}")
        if problem is not None:
            raise ChunkInputError(
                f"{path}:{n}: {problem[0]} ({problem[1]}); rerun merge_and_shuffle and "
                "split_chunks with the current config"
            )
        records.append(Record(str(obj["id"]), obj["input_ids"], obj["loss_mask"], n))
    return records
