"""The extraction client: drive one chunk through the server and assemble its file.

Several requests in flight (the server batches them); after each response the client
waits until the request's dump pieces cover ``[0, len)`` exactly once (an async writer may
land them after the response), checks token parity with what it sent and that every value
is finite, writes the rows into the chunk file at their final offsets, and deletes the
pieces.  Bytes in flight in the dump dir stay under ``dump.shm_budget_gb``.

Transient failures (connection refused/reset, HTTP 5xx, timeouts, a restarting server) are
retried with backoff, re-ensuring the server each time.  Permanent ones (a coverage gap
after the request completed, a parity mismatch, a corrupt piece, a 4xx) fail the chunk at
once with the evidence: chunk, record id, rid, ranges, file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from hsextract.capture import PIECE_SUFFIX
from hsextract.errors import HsextractError


class ExtractionError(HsextractError):
    """A chunk could not be extracted; the message names the chunk, record and cause."""


class TransientError(Exception):
    """Worth retrying: the server may come back."""


@dataclass(frozen=True)
class Geometry:
    """What the model produces per token; read from the model's config.json."""

    hidden_size: int
    num_layers: int
    aux_layers: list[int]
    dtype: torch.dtype

    @property
    def dump_bytes_per_token(self) -> int:
        from hsextract.budget import dump_bytes_per_token

        return dump_bytes_per_token(self.hidden_size, len(self.aux_layers), self.dtype)


def model_geometry(cfg: dict) -> Geometry:
    from hsextract.config import resolve_aux_layers
    from hsextract.engine import DTYPES

    path = Path(cfg["model"]["path"]) / "config.json"
    try:
        mcfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ExtractionError(f"cannot read the model config {path}: {exc} (model.path)") from exc
    mcfg = mcfg.get("text_config", mcfg)
    layers = int(mcfg["num_hidden_layers"])
    return Geometry(
        hidden_size=int(mcfg["hidden_size"]),
        num_layers=layers,
        aux_layers=resolve_aux_layers(cfg, layers),
        dtype=DTYPES[cfg["model"]["dtype"]],
    )


class ByteBudget:
    """A counting semaphore in bytes: throttles requests so dumps fit in /dev/shm."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.used + n <= self.capacity or self.used == 0)
            self.used += n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


def read_pieces(
    rid_dir: Path, length: int, timeout_s: float, *, completed: bool = True
) -> list[dict]:
    """Wait until the pieces of a request cover [0, length) exactly once; load them."""
    from safetensors import safe_open

    deadline = time.monotonic() + timeout_s
    delay = 0.002
    while True:
        names = sorted(p.name for p in rid_dir.glob(f"*{PIECE_SUFFIX}")) if rid_dir.is_dir() else []
        ranges = []
        for name in names:
            try:
                start = int(name.removesuffix(PIECE_SUFFIX))
            except ValueError:
                raise ExtractionError(f"unexpected file {rid_dir / name} in the dump dir") from None
            ranges.append((start, name))
        covered, problem = _coverage(rid_dir, ranges, length)
        if problem:
            raise ExtractionError(problem)
        if covered:
            break
        if time.monotonic() > deadline:
            have = [(s, s + n) for s, n in _known_lengths(rid_dir, ranges)]
            raise ExtractionError(
                f"dump pieces of {rid_dir.name} cover {have} after the request completed, "
                f"not [0, {length}) (waited {timeout_s:.0f}s, client.piece_timeout_s): "
                "the server dropped part of the prefill"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    pieces = []
    for start, name in ranges:
        path = rid_dir / name
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                piece = {
                    k: f.get_tensor(k) for k in ("input_ids", "hidden_states", "aux_hidden_states")
                }
        except Exception as exc:
            raise ExtractionError(f"corrupt dump piece {path}: {exc}") from exc
        piece["start"] = start
        piece["meta"] = meta
        pieces.append(piece)
    return pieces


def _known_lengths(rid_dir: Path, ranges: list[tuple[int, str]]) -> list[tuple[int, int]]:
    from safetensors import safe_open

    out = []
    for start, name in ranges:
        try:
            with safe_open(str(rid_dir / name), framework="pt") as f:
                out.append((start, int((f.metadata() or {}).get("n", -1))))
        except Exception:
            out.append((start, -1))
    return out


def _coverage(rid_dir: Path, ranges: list[tuple[int, str]], length: int) -> tuple[bool, str | None]:
    """(complete?, problem) over the pieces present; overlap is a problem, a gap is 'wait'."""
    pos = 0
    for start, n in _known_lengths(rid_dir, ranges):
        if n < 0:
            return (
                False,
                f"corrupt dump piece {rid_dir / f'{start:09d}{PIECE_SUFFIX}'} (unreadable header)",
            )
        if start < pos:
            return False, f"dump pieces of {rid_dir.name} overlap at token {start} (< {pos})"
        if start > pos:
            return False, None
        pos = start + n
    if pos > length:
        return (
            False,
            f"dump pieces of {rid_dir.name} run to token {pos}, past the request's {length}",
        )
    return pos == length, None


def assemble(
    pieces: list[dict], sent: list[int], geo: Geometry, where: str
) -> tuple[torch.Tensor, ...]:
    """Concatenate pieces; check parity with the sent ids, shapes, dtype, finiteness."""
    ids = torch.cat([p["input_ids"] for p in pieces])
    hidden = torch.cat([p["hidden_states"] for p in pieces])
    aux = torch.cat([p["aux_hidden_states"] for p in pieces])
    sent_t = torch.tensor(sent, dtype=ids.dtype)
    if ids.shape != sent_t.shape or not torch.equal(ids, sent_t):
        bad = (ids != sent_t).nonzero()[:5].flatten().tolist() if ids.shape == sent_t.shape else []
        raise ExtractionError(
            f"{where}: token parity broken: dumped ids differ from the ids sent "
            f"(len {ids.shape[0]} vs {len(sent)}, first differing positions {bad})"
        )
    k = len(geo.aux_layers)
    if hidden.shape != (len(sent), geo.hidden_size) or aux.shape != (
        len(sent),
        k * geo.hidden_size,
    ):
        raise ExtractionError(
            f"{where}: dumped shapes hidden {tuple(hidden.shape)} aux {tuple(aux.shape)}, "
            f"expected [{len(sent)}, {geo.hidden_size}] and [{len(sent)}, {k * geo.hidden_size}]"
        )
    layers = {p["meta"].get("aux_layers") for p in pieces}
    if layers != {json.dumps(geo.aux_layers)}:
        raise ExtractionError(
            f"{where}: server captured aux layers {layers}, expected {geo.aux_layers}"
        )
    if hidden.dtype != geo.dtype or aux.dtype != geo.dtype:
        raise ExtractionError(
            f"{where}: dumped dtype {hidden.dtype}, expected {geo.dtype} (model.dtype)"
        )
    if not (torch.isfinite(hidden).all() and torch.isfinite(aux).all()):
        raise ExtractionError(f"{where}: non-finite values in the dumped hidden states")
    return ids, hidden, aux


class Client:
    """One chunk's worth of requests against a server described by its live state."""

    def __init__(self, cfg: dict, geo: Geometry, ensure: Callable[[], dict]) -> None:
        import requests

        self.cfg = cfg
        self.geo = geo
        self.ensure = ensure
        self.state = ensure()
        self.session = requests.Session()
        key = cfg["server"].get("api_key")
        if key:
            self.session.headers["Authorization"] = f"Bearer {key}"
        c = cfg["client"]
        self.timeout = float(c["request_timeout_s"])
        self.piece_timeout = float(c["piece_timeout_s"])
        self.retries = int(c["retries"])
        self.backoff = float(c["backoff_s"])
        self.dump_dir = Path(self.state["spec"]["dump_dir"])
        self._lock = threading.Lock()

    def _post(self, rid: str, ids: list[int]) -> dict:
        import requests

        body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 0}}
        try:
            resp = self.session.post(
                f"{self.state['url']}/generate", json=body, timeout=self.timeout
            )
        except requests.Timeout as exc:
            raise TransientError(
                f"no answer within {self.timeout:.0f}s (client.request_timeout_s)"
            ) from exc
        except requests.ConnectionError as exc:
            raise TransientError(f"connection failed: {exc}") from exc
        if resp.status_code >= 500:
            raise TransientError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        if resp.status_code != 200:
            raise ExtractionError(
                f"server refused the request: HTTP {resp.status_code}: {resp.text[:300]}"
            )
        return resp.json()

    def extract(self, rid_prefix: str, record_id: str, ids: list[int]) -> tuple[torch.Tensor, ...]:
        where = f"record {record_id!r}"
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            rid = f"{rid_prefix}-{uuid.uuid4().hex[:8]}"
            rid_dir = self.dump_dir / rid
            try:
                self._post(rid, ids)
                pieces = read_pieces(rid_dir, len(ids), self.piece_timeout)
                return assemble(pieces, ids, self.geo, f"{where} (rid {rid})")
            except TransientError as exc:
                last = exc
                if attempt == self.retries:
                    break
                time.sleep(self.backoff * 2**attempt)
                with self._lock:  # one relaunch for all threads, under ensure()'s file lock
                    self.state = self.ensure()
                    self.dump_dir = Path(self.state["spec"]["dump_dir"])
            except ExtractionError as exc:
                raise ExtractionError(f"{where} (rid {rid}): {exc}") from None
            finally:
                shutil.rmtree(rid_dir, ignore_errors=True)
        raise ExtractionError(
            f"{where}: gave up after {self.retries + 1} attempts (client.retries): {last}"
        )


def extract_chunk(
    cfg: dict,
    *,
    chunk_path: Path,
    index_path: Path | None,
    out_path: Path,
    sidecar_path: Path,
    ensure: Callable[[], dict],
    progress: bool = True,
) -> dict:
    """Extract every record of a chunk into the contract's chunk file plus its sidecar."""
    from hsextract.chunks import ChunkWriter, check_chunk
    from hsextract.config import fingerprint
    from hsextract.records import load_chunk

    name = Path(chunk_path).stem
    t0 = time.monotonic()
    records = load_chunk(Path(chunk_path), Path(index_path) if index_path else None)
    max_len = int(cfg["max_seq_len"])
    for r in records:
        if len(r.input_ids) > max_len:
            raise ExtractionError(
                f"{chunk_path}:{r.line}: record {r.id!r} has {len(r.input_ids)} tokens > "
                f"max_seq_len {max_len}; the merge stage should have handled it: rerun merge"
            )
    geo = model_geometry(cfg)
    budget_bytes = int(float(cfg["dump"]["shm_budget_gb"]) * 2**30)
    longest = max((len(r.input_ids) for r in records), default=0)
    if longest * geo.dump_bytes_per_token > budget_bytes:
        raise ExtractionError(
            f"{name}: the longest record ({longest} tokens) needs "
            f"{longest * geo.dump_bytes_per_token / 2**30:.3f} GiB of dump space, more than "
            f"dump.shm_budget_gb={cfg['dump']['shm_budget_gb']}; raise it"
        )
    client = Client(cfg, geo, ensure)
    fp = fingerprint(cfg)
    meta = {
        "record_ids": json.dumps([r.id for r in records]),
        "aux_layers": json.dumps(geo.aux_layers),
        "hidden_size": str(geo.hidden_size),
        "model": str(cfg["model"]["path"]),
        "fingerprint": fp,
        "engine": cfg["engine"],
        "format_version": "1",
        "dtype": cfg["model"]["dtype"],
        "chunk": name,
    }
    writer = ChunkWriter(
        out_path,
        [len(r.input_ids) for r in records],
        hidden_size=geo.hidden_size,
        n_aux=len(geo.aux_layers),
        dtype=geo.dtype,
        metadata=meta,
    )
    shm = ByteBudget(budget_bytes)
    total_tokens = sum(len(r.input_ids) for r in records)
    bar = _progress(name, total_tokens, len(records), progress)

    def one(j: int) -> None:
        rec = records[j]
        need = len(rec.input_ids) * geo.dump_bytes_per_token
        shm.acquire(need)
        try:
            ids, hidden, aux = client.extract(f"{name}-{j:06d}", rec.id, rec.input_ids)
        finally:
            shm.release(need)
        writer.put(j, ids, torch.tensor(rec.loss_mask, dtype=torch.uint8), hidden, aux)
        bar.update(len(rec.input_ids))

    pool = ThreadPoolExecutor(max_workers=int(cfg["client"]["requests_in_flight"]))
    try:
        futures = [pool.submit(one, j) for j in range(len(records))]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f.done() and f.exception() is not None:
                for g in futures:
                    g.cancel()
                exc = f.exception()
                if isinstance(exc, HsextractError):
                    raise ExtractionError(f"chunk {name}: {exc}") from exc
                raise ExtractionError(f"chunk {name}: {type(exc).__name__}: {exc}") from exc
        sha = writer.finish()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        writer.abort()
        raise
    finally:
        bar.close()
    pool.shutdown(wait=True)
    check = check_chunk(out_path, expect_records=len(records))
    seconds = time.monotonic() - t0
    sidecar = {
        "chunk": name,
        "path": Path(out_path).name,
        "records": check["records"],
        "tokens": check["tokens"],
        "bytes": os.path.getsize(out_path),
        "sha256": sha,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(total_tokens / seconds, 1) if seconds > 0 else math.inf,
        "fingerprint": fp,
        "aux_layers": geo.aux_layers,
        "engine": cfg["engine"],
        "server_url": client.state["url"],
    }
    from hsextract.server import write_json

    write_json(Path(sidecar_path), sidecar)
    return sidecar


def _progress(name: str, tokens: int, records: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=tokens,
        unit="tok",
        unit_scale=True,
        desc=f"{name} ({records} records)",
        file=sys.stderr,
        disable=not enabled,
        mininterval=1.0,
    )
