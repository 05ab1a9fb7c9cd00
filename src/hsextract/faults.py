"""Test-only fault injection: make the reference engine and the chunk writer misbehave.

Off unless the environment variable ``HSEXTRACT_FAULTS`` holds a JSON spec; then
:data:`ACTIVE` is true and the hooks below fire.  With the variable unset every hook site
costs one attribute read (``if faults.ACTIVE``).  The variable flows the ordinary way: a
test sets it in the environment of ``snakemake``, jobs inherit it, and the server a job
launches inherits it from the job.  Production runs never set it.

Spec (every key optional)::

    {
      "once": "/tmp/x/fired",        # fire in one process only: a process that starts while
                                     # this file exists injects nothing; the first fault
                                     # that fires creates it.  So a relaunched server, or
                                     # the rerun, is clean.
      "log": "/tmp/x/faults.jsonl",  # every fault that fires is appended here (one JSON
                                     # object per line: what, rid, file, pid)
      "generate": [                  # per POST /generate, before it is scheduled
        {"rid": "chunk_00001", "nth": [3], "do": "500" | "hang" | "kill" | "cut"}
      ],
      "piece": [                     # per finished request, once its pieces are on disk
        {"rid": "chunk_00001", "nth": [2], "do": "truncate" | "bad_header" | "drop"
                                                | "flip_id", "index": -1}
      ],
      "chunk_write": [               # in the workflow's chunk writer (ChunkWriter.put)
        {"chunk": "chunk_00001", "nth": [3], "do": "enospc" | "kill_group"}
      ],
      "announce": [                  # in a chunk job, right after its chunk's announcement
        {"chunk": "chunk_00001", "do": "kill_group"}   # (stream.budget_gb: the journal line)
      ],
      "ack": [                       # in a trainer's AckWriter.ack (stream.journal)
        {"when": "before" | "after" | "after_last", "nth": [2], "do": "kill_group"}
      ],
      "load": [                      # in the engine, before it loads its model and binds
        {"do": "wait", "gate": "/tmp/x/loaded", "timeout_s": 600},
        {"do": "exit", "code": 3}
      ],
      "capture": [                   # what the engine captures of a matching request
        {"rid": "chunk_00001-000003", "do": "layer_off_by_one" | "final_prenorm"
                                            | "shift_positions", "layer": 4}
      ],
      "extend": [                    # after each extend pass holding a matching request
        {"rid": "chunk_00001", "nth": [1], "do": "slow" | "kill", "seconds": 3},
        {"rid": "chunk_00001", "nth": [1], "do": "wait", "gate": "/tmp/x/go",
         "timeout_s": 600}
      ]
    }

A rule matches a request whose rid (or a chunk file whose name) contains ``rid``
(``chunk``), and fires on the ``nth`` matching occurrences *in this process* (1-based; a
list, or ``"all"``, the default).  Actions:

- ``500``: answer HTTP 500 (the client retries: transient);
- ``hang``: accept the request and never answer (the client times out: transient);
- ``kill``: SIGKILL the server process (the client relaunches it: transient);
- ``cut``: answer the status line and headers of a 200, then close the connection with no
  body, as a server that dies mid-answer does (another request's kill, an OOM) (transient);
- ``truncate`` / ``bad_header``: corrupt one piece of the request (``index`` into its
  pieces sorted by start; default 0) -- half its bytes, or garbage in the JSON header;
- ``drop``: delete one piece (default: the last) -- a coverage gap after completion;
- ``flip_id``: change the first token id stored in one piece -- broken token parity;
- ``enospc``: raise ``OSError(ENOSPC)`` from the chunk writer, as a full disk would;
- ``kill_group``: SIGKILL the chunk job's process group -- the whole workflow, as a
  ``kill -9`` of it, a node lost or a cancelled allocation would -- mid-chunk (its
  partial file on disk) or right after its announcement (before Snakemake saw it end); in
  a trainer, its ranks and loader workers, before an ack (its checkpoint committed, the
  ack not written), after one, or ``after_last``: after the ack that leaves every chunk
  of the pass acknowledged (the trainer's last checkpoint);
- ``slow``: the scheduler sleeps ``seconds`` after the pass, as a slow forward would, so a
  request outlives the client's timeout with passes still to run;
- extend ``kill``: SIGKILL the process that ran the pass -- with ``--dp-size`` > 1 one DP
  worker, mid-chunk, the others living on;
- load ``wait``: the engine loads its model (and answers /health) only once the file
  ``gate`` exists -- a slow model load, on an event; load ``exit``: it exits with ``code``
  (default 3) before loading, as a server refusing a flag or out of memory would;
- capture ``layer_off_by_one``: aux layer ``layer`` (default: the first captured) is
  stored from the stream entering the next layer; ``final_prenorm``: the final state is
  stored before the final norm instead of after it; ``shift_positions``: the request's
  states are stored one position late (row t holds token t-1's; a pass's first row its
  last's; on SGLang, through ``hsextract.sglang.hooks``, the only capture action).
  Wrong at capture time, every check of the
  capture passes them (token parity, shapes, finite values, sha256): the audit's subject;
- ``wait``: the scheduler stops after the pass until the file ``gate`` exists (the fault
  is logged when the wait begins, so a test sees the server held mid-request and releases
  it by creating the file).  A test holds a run on this event, never on a duration a slow
  machine may outlast; ``timeout_s`` (default 600) only bounds a test that forgot to
  release it, and is logged as ``wait_timeout``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

ENV = "HSEXTRACT_FAULTS"
_GENERATE_ACTIONS = {"500", "hang", "kill", "cut"}
_PIECE_ACTIONS = {"truncate", "bad_header", "drop", "flip_id"}
_WRITE_ACTIONS = {"enospc", "kill_group"}
_ANNOUNCE_ACTIONS = {"kill_group"}
_ACK_ACTIONS = {"kill_group"}
_EXTEND_ACTIONS = {"slow", "kill", "wait"}
_LOAD_ACTIONS = {"wait", "exit"}
_CAPTURE_ACTIONS = {"layer_off_by_one", "final_prenorm", "shift_positions"}


class FaultSpecError(ValueError):
    """The spec in ``HSEXTRACT_FAULTS`` is malformed (a test bug, never a user's)."""


def load(raw: str | None) -> dict[str, Any] | None:
    """Parse and check a spec; ``None`` when there is none or its ``once`` file exists."""
    if not raw:
        return None
    try:
        spec = json.loads(raw)
    except ValueError as exc:
        raise FaultSpecError(f"{ENV} is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise FaultSpecError(f"{ENV} must be a JSON object")
    for key, actions in (
        ("generate", _GENERATE_ACTIONS),
        ("piece", _PIECE_ACTIONS),
        ("chunk_write", _WRITE_ACTIONS),
        ("announce", _ANNOUNCE_ACTIONS),
        ("ack", _ACK_ACTIONS),
        ("extend", _EXTEND_ACTIONS),
        ("load", _LOAD_ACTIONS),
        ("capture", _CAPTURE_ACTIONS),
    ):
        for rule in spec.get(key, []):
            if rule.get("do") not in actions:
                raise FaultSpecError(f"{ENV}: {key} rule {rule}: 'do' must be one of {actions}")
            if rule["do"] == "wait" and not rule.get("gate"):
                raise FaultSpecError(f"{ENV}: {key} rule {rule}: 'wait' needs a 'gate' file")
    once = spec.get("once")
    if once and os.path.exists(once):
        return None
    return spec


SPEC: dict[str, Any] | None = load(os.environ.get(ENV))
#: True when a spec is armed in this process; every hook site checks this first.
ACTIVE: bool = SPEC is not None

_lock = threading.Lock()
_seen: dict[tuple[str, int], int] = {}


def _match(kind: str, key: str, name: str) -> dict[str, Any] | None:
    """The first rule of ``kind`` that fires for this occurrence of ``name``, if any.

    Every matching rule counts the occurrence, whether or not an earlier rule fires.
    """
    if SPEC is None:
        return None
    fired = None
    for i, rule in enumerate(SPEC.get(kind, [])):
        if rule.get(key, "") not in name:
            continue
        with _lock:
            count = _seen.get((kind, i), 0) + 1
            _seen[(kind, i)] = count
        nth = rule.get("nth", "all")
        if fired is None and (nth == "all" or count in nth):
            fired = rule
    return fired


def _fired(what: str, **info: Any) -> None:
    """Record a fault: the ``once`` file (so later processes stay clean) and the log."""
    assert SPEC is not None
    once = SPEC.get("once")
    if once:
        Path(once).touch()
    entry = {"fault": what, "pid": os.getpid(), "time": time.time(), **info}
    log = SPEC.get("log")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())


# -- reference engine ------------------------------------------------------------------


#: The payload of a ``cut`` answer: the engine sends its headers and closes, no body.
CUT = {"cut": True}


def before_generate(rid: str) -> tuple[int, dict] | None:
    """Called by the engine per /generate; returns a response to send instead, or None."""
    rule = _match("generate", "rid", rid)
    if rule is None:
        return None
    _fired(rule["do"], rid=rid)
    if rule["do"] == "500":
        return 500, {"error": f"injected fault: HTTP 500 for rid {rid}"}
    if rule["do"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if rule["do"] == "cut":
        return 200, CUT
    threading.Event().wait()  # "hang": the connection stays open, no answer ever comes
    return None  # pragma: no cover


def after_extend(rids: list[str]) -> None:
    """Called by the engine's scheduler after each extend pass: make it a slow one, or hold
    it until the test opens the gate.  Every request of the pass meets its own ``wait``
    rule: a pass batching two chunks' requests is held by either chunk's closed gate."""
    for rid in rids:
        rule = _match("extend", "rid", rid)
        if rule is None:
            continue
        if rule["do"] == "kill":
            _fired("kill", rid=rid)
            os.kill(os.getpid(), signal.SIGKILL)
        if rule["do"] == "slow":
            _fired("slow", rid=rid, seconds=rule.get("seconds", 1))
            time.sleep(float(rule.get("seconds", 1)))
            return
        _wait_for_gate(Path(rule["gate"]), float(rule.get("timeout_s", 600)), rid)


def on_load() -> None:
    """Called by the engine before it loads its model: a load held on a gate, or one that
    fails (the server exits before ever answering /health)."""
    rule = _match("load", "engine", "engine")
    if rule is None:
        return
    if rule["do"] == "exit":
        code = int(rule.get("code", 3))
        _fired("load_exit", code=code)
        sys.stderr.write(f"injected fault: the engine exits with code {code} while loading\n")
        sys.stderr.flush()
        os._exit(code)
    _wait_for_gate(Path(rule["gate"]), float(rule.get("timeout_s", 600)), "(load)", "load_wait")


def _wait_for_gate(gate: Path, timeout_s: float, rid: str, what: str = "wait") -> None:
    # ``closed``: whether this pass is held at all (a test waits on a held one).
    _fired(what, rid=rid, gate=str(gate), closed=not gate.exists())
    deadline = time.monotonic() + timeout_s
    while not gate.exists():
        if time.monotonic() > deadline:
            _fired("wait_timeout", rid=rid, gate=str(gate))
            return
        time.sleep(0.05)


def _capture_rules(rid: str, do: str) -> list[dict[str, Any]]:
    """Every capture rule of action ``do`` matching ``rid``: they hold for every pass of
    the request (no ``nth``: a wrong capture is wrong each time)."""
    if SPEC is None:
        return []
    return [r for r in SPEC.get("capture", []) if r["do"] == do and r.get("rid", "") in rid]


def capture_needs_prenorm() -> bool:
    """Whether a ``final_prenorm`` rule is armed: the engine then takes the norm's input."""
    return any(r["do"] == "final_prenorm" for r in (SPEC or {}).get("capture", []))


def captured(rid: str, hs: list, aux_layers: list[int], num_layers: int) -> list:
    """Called by the engine per request and pass with its states (``hs[i]`` entering layer
    i, ``hs[num_layers]`` the norm's input, ``hs[-1]`` the final state): what is captured
    instead, wrong as the rules say."""
    out = list(hs)
    for rule in _capture_rules(rid, "layer_off_by_one"):
        layer = int(rule.get("layer", aux_layers[0]))
        out[layer] = hs[layer + 1]
        _fired("layer_off_by_one", rid=rid, layer=layer)
    if _capture_rules(rid, "final_prenorm"):
        out[-1] = hs[num_layers]
        _fired("final_prenorm", rid=rid)
    if _capture_rules(rid, "shift_positions"):
        # Rows, not position ids: RoPE sees only relative positions, so a forward run at
        # positions all shifted by one computes the same states (up to rounding).
        out = [h.roll(1, dims=0) for h in out]
        _fired("shift_positions", rid=rid)
    return out


def captured_batch(rids: list, extend_lens: list, hidden: Any, aux: list) -> tuple[Any, list]:
    """SGLang's side of :func:`captured` (``hsextract.sglang.hooks``, patch and hooks alike),
    on a flat extend batch: each matching request's rows stored one position late, as
    ``shift_positions`` says.  Only that action: the other layers' states are not at hand
    where a live forward hands its batch over."""
    hit = {i for i, rid in enumerate(rids) if _capture_rules(str(rid), "shift_positions")}
    if not hit:
        return hidden, aux
    hidden, aux = hidden.clone(), [a.clone() for a in aux]
    row = 0
    for j, n in enumerate(int(n) for n in extend_lens):
        if j in hit:
            for t in (hidden, *aux):
                t[row : row + n] = t[row : row + n].roll(1, dims=0)
            _fired("shift_positions", rid=str(rids[j]))
        row += n
    return hidden, aux


def after_generate(rid: str, length: int, dump_dir: str | None, timeout_s: float = 60) -> None:
    """Called by the engine once a request is done, before it answers: tamper with pieces."""
    rule = _match("piece", "rid", rid)
    if rule is None or not dump_dir:
        return
    rid_dir = Path(dump_dir) / rid
    pieces = _wait_for_pieces(rid_dir, length, timeout_s)
    action = rule["do"]
    path = pieces[int(rule.get("index", -1 if action == "drop" else 0))]
    if action == "truncate":
        size = path.stat().st_size
        os.truncate(path, size // 2)
    elif action == "bad_header":
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(b"\xff\xfe not json \x00")
    elif action == "drop":
        path.unlink()
    elif action == "flip_id":
        _flip_first_id(path)
    _fired(action, rid=rid, file=str(path))


def _piece_len(path: Path) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return int(header["__metadata__"]["n"])


def _wait_for_pieces(rid_dir: Path, length: int, timeout_s: float) -> list[Path]:
    """The request's pieces (sorted by start) once they cover ``length`` tokens."""
    deadline = time.monotonic() + timeout_s
    while True:
        pieces = sorted(rid_dir.glob("*.safetensors")) if rid_dir.is_dir() else []
        try:
            if sum(_piece_len(p) for p in pieces) >= length:
                return pieces
        except (OSError, ValueError):
            pass  # a piece renamed away under us: look again
        if time.monotonic() > deadline:
            raise RuntimeError(f"fault injection: pieces of {rid_dir} never covered {length}")
        time.sleep(0.01)


def _flip_first_id(path: Path) -> None:
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        start = 8 + n + int(header["input_ids"]["data_offsets"][0])
        f.seek(start)
        (token,) = struct.unpack("<q", f.read(8))
        f.seek(start)
        f.write(struct.pack("<q", token ^ 1))  # stays inside the vocabulary


# -- workflow side ---------------------------------------------------------------------


def on_chunk_put(path: str | os.PathLike[str]) -> None:
    """Called by ``ChunkWriter.put`` per record: raise ENOSPC as a full disk would."""
    name = Path(path).name
    rule = _match("chunk_write", "chunk", name)
    if rule is None:
        return
    _fired(rule["do"], file=str(path))
    if rule["do"] == "kill_group":
        _kill_group()
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def after_announce(chunk: str) -> None:
    """Called by a chunk job right after its chunk's announcement (stream.producer)."""
    rule = _match("announce", "chunk", chunk)
    if rule is not None:
        _fired(rule["do"], chunk=chunk)
        _kill_group()


def around_ack(when: str) -> None:
    """Called by a trainer's ``AckWriter.ack``: ``before`` its line, ``after`` it, or
    ``after_last`` (after the line that leaves the whole pass acknowledged; a rule
    ``after`` matches it too)."""
    rule = _match("ack", "when", when)
    if rule is not None:
        _fired(rule["do"], when=when)
        _kill_group()


def _kill_group() -> None:
    """SIGKILL this process's group: the workflow a test started in a session of its own
    (Snakemake's jobs share it; the server runs in a session of its own, as in production)."""
    os.killpg(os.getpgrp(), signal.SIGKILL)
