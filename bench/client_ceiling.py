"""Client ceiling (issue 40): the requests/s and GB/s of raw states the client side sustains
on one node when the server costs nothing, and where each request's time goes.

A stub server speaks the subset of SGLang's HTTP API the client uses (``/health``,
``/get_model_info``, ``/get_server_info``, ``/generate`` with ``input_ids``, ``rid`` and
``sampling_params``, ``/abort_request``) and answers at once: no model, no GPU.  It schedules
requests the way the reference engine does (passes of at most ``chunked_prefill_size``
tokens, a long request split over passes), and writes each pass's pieces through the real
``hsextract.capture.DumpWriter`` (``<dump_dir>/<rid>/<start:09d>.safetensors``, temporary
name and rename, its writer threads), bf16 rows of random values.  With ``--pieces before``
(default) a pass's pieces are in place before its requests are answered; ``after``
answers as soon as the pass is handed to the writer (the client then polls for them).
``dp`` N: the client's config says ``sglang.dp_size`` N (so each job keeps
``requests_in_flight x N`` in flight under a ``shm_budget_gb x N`` budget,
``hsextract.dp``); the stub's processes report DP ranks, are named ``hsref::dp<r>`` in one
process group (``dp.workers_alive`` counts them) and each has its own writer.

The chunk jobs are the real ones: ``hsextract.client.extract_chunk`` (what the workflow's
``extract_chunk`` rule calls through ``hsextract.steps``) on chunk files made by the real
merge and split, ``--jobs`` of them at once in separate processes (``snakemake -jN``), with
``client.sending_jobs`` turns.  The processes are started and have imported the client
before the clock starts: Snakemake's own per-job start (~4 s, bench/README "Race") is not in
these figures.  Chunk files and the dump dir are on /dev/shm (the disk is not measured).

Baseline in the same run ("bare"): the same stub and records, driven by a bare sender (as
many processes as sending turns, each the same window, under the same byte budget) that
only waits for each request's pieces, reads their headers and unlinks them: the request
rate the stub itself serves.  client / bare is what the client's own piece handling costs;
a ratio near 1 means the stub, not the client, was the limit (the client figure is then a
lower bound).

Per cell it prints records/s, GB/s of raw states, the CPU cores the chunk jobs and the stub
used, and each request's wall time by phase (timers around the client's own functions,
summed over threads).  Then the client runs once more under cProfile (each thread's CPU
time, every thread of every job): the report ends with that profile, all cells together
and each cell's.  The headline rates are from the unprofiled run.

    python bench/client_ceiling.py --out /tmp/ceiling            # the full matrix
    python bench/client_ceiling.py --quick --out /tmp/ceiling     # seconds: tiny sizes
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import pstats
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

NUM_LAYERS = 32  # the target's depth; the captured layers are spread over it
VOCAB = 32000


# ----------------------------------------------------------------------------- the stub


class _StubRequest:
    __slots__ = ("rid", "ids", "pos", "starts", "done")

    def __init__(self, rid: str, ids: list[int]) -> None:
        self.rid, self.ids, self.pos = rid, ids, 0
        self.starts: list[int] = []  # of its pieces
        self.done = threading.Event()


def _stub_main(a: dict) -> None:
    """One stub process: an HTTP front on the shared port (SO_REUSEPORT) and a pass loop."""
    import ctypes
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import torch

    from hsextract.capture import ABANDONED_DIR, DumpWriter, piece_name

    rank, dp = a["rank"], a["dp"]
    with contextlib.suppress(OSError):
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the bench
        libc.prctl(15, f"hsref::dp{rank % dp}".encode())  # PR_SET_NAME, as dp.py counts
    torch.set_num_threads(1)
    dump = a["dump_dir"] if a["pieces"] != "none" else None
    writer = DumpWriter(dump, a["aux_layers"], threads=a["writer_threads"]) if dump else None
    k, h, cps = len(a["aux_layers"]), a["hidden"], a["chunked_prefill_size"]
    gen = torch.Generator().manual_seed(rank)
    hidden = torch.randn(cps, h, generator=gen).to(torch.bfloat16)
    aux = [torch.randn(cps, h, generator=gen).to(torch.bfloat16) for _ in range(k)]
    inbox: queue.SimpleQueue[_StubRequest] = queue.SimpleQueue()
    landing: queue.SimpleQueue[_StubRequest] = queue.SimpleQueue()

    def passes() -> None:
        """Continuous batching with chunked prefill: each pass takes up to ``cps`` tokens
        of the running requests, in order; a request is answered after its last pass."""
        running: deque[_StubRequest] = deque()
        while True:
            if not running:
                running.append(inbox.get())
            with contextlib.suppress(queue.Empty):
                while True:
                    running.append(inbox.get_nowait())
            rids, starts, lens, ids, room = [], [], [], [], cps
            finished = []
            for r in running:
                if room <= 0:
                    break
                n = min(len(r.ids) - r.pos, room)
                rids.append(r.rid)
                starts.append(r.pos)
                lens.append(n)
                ids.extend(r.ids[r.pos : r.pos + n])
                r.starts.append(r.pos)
                r.pos += n
                room -= n
                if r.pos == len(r.ids):
                    finished.append(r)
            if writer is not None:
                t = len(ids)
                writer.write_batch(
                    rids, starts, lens, torch.tensor(ids, dtype=torch.int64), hidden[:t],
                    [x[:t] for x in aux],
                )  # fmt: skip
            for r in finished:
                running.remove(r)
                if writer is not None and a["pieces"] == "before":
                    landing.put(r)
                else:
                    r.done.set()

    def answers() -> None:
        """``--pieces before``: a request is answered once its pieces are renamed into
        place, while the next passes are staged (a flush per pass would idle the writer
        threads while the pass loop copies the next pass)."""
        while True:
            r = landing.get()
            tomb = os.path.join(dump, ABANDONED_DIR, r.rid)
            for start in r.starts:
                path, delay = os.path.join(dump, r.rid, piece_name(start)), 0.0002
                while not os.path.exists(path) and not os.path.lexists(tomb):
                    time.sleep(delay)
                    delay = min(delay * 2, 0.005)
            r.done.set()

    threading.Thread(target=passes, daemon=True).start()
    threading.Thread(target=answers, daemon=True).start()
    info = {
        "model_path": a["model_path"],
        "is_generation": True,
        "context_length": a["context_length"],
        "engine": "stub",
        "aux_layers": a["aux_layers"],
        "hidden_size": h,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: object) -> None:
            pass

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _send(self, code: int, payload: dict | str) -> None:
            # Status, headers and body in one write: two small writes on a keep-alive
            # connection meet Nagle and the client's delayed ACK (40 ms an answer).
            body = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
            head = (
                f"HTTP/1.1 {code} {'OK' if code == 200 else 'Error'}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            self.wfile.write(head.encode() + body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/health":
                return self._send(200, "ok")
            if self.path == "/get_model_info":
                return self._send(200, info)
            if self.path == "/get_server_info":
                return self._send(200, {"version": "stub", "engine": "stub", "dp_size": dp})
            self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path == "/abort_request":
                return self._send(200, "")
            if self.path != "/generate":
                return self._send(404, {"error": f"no route {self.path}"})
            ids = body["input_ids"]
            req = _StubRequest(str(body["rid"]), ids)
            inbox.put(req)
            req.done.wait()
            meta = {
                "id": req.rid,
                "dp_rank": rank % dp,
                "prompt_tokens": len(ids),
                "completion_tokens": 0,
                "finish_reason": {"type": "length", "length": 0},
            }
            self._send(200, {"text": "", "output_ids": [], "meta_info": meta})

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024

        def server_bind(self) -> None:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            super().server_bind()

    httpd = Server(("127.0.0.1", a["port"]), Handler)
    Path(a["ready"], f"ready-{rank}").touch()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    httpd.serve_forever()


class Stub:
    """The stub's processes (one process group), started and healthy, or stopped."""

    def __init__(self, args: dict, procs: int, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.procs: list[subprocess.Popen] = []
        self.ready = log.parent / "stub-ready"
        self.ready.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        with open(log, "ab") as logf:
            for rank in range(procs):
                spec = json.dumps({**args, "rank": rank, "port": port, "ready": str(self.ready)})
                # One process group of their own (dp.workers_alive counts its members).
                group = {"process_group": self.procs[0].pid if rank else 0}
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "--stub-process", spec],
                        env=env,
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        **group,
                    )  # fmt: skip
                )
        self.pgid = self.procs[0].pid
        self._wait_healthy()

    def _wait_healthy(self, deadline_s: float = 120.0) -> None:
        import requests

        t = time.monotonic()
        # Every process bound: a /health reaches whichever the kernel picks, so each
        # process also says so in a file once it listens.
        while time.monotonic() - t < deadline_s:
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"stub process exited at start: {dead[0]}")
            try:
                up = requests.get(f"{self.url}/health", timeout=2).ok
            except requests.RequestException:
                up = False
            if up and all((self.ready / f"ready-{r}").exists() for r in range(len(self.procs))):
                return
            time.sleep(0.05)
        raise RuntimeError(f"stub not healthy within {deadline_s:.0f} s")

    def cpu_s(self) -> float:
        return sum(_cpu_s(p.pid) for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


# ------------------------------------------------------------------- the chunk-job side

_PHASES: dict[str, list[float]] = {}
_PHASES_LOCK = threading.Lock()
_PROFILES: list = []
_DONE: list[tuple[float, int]] = []  # (wall clock, tokens) of each request's rows written


def _timed(owner: object, name: str, phase: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            dt, dc = time.perf_counter() - t, time.thread_time() - c
            with _PHASES_LOCK:
                cell = _PHASES.setdefault(phase, [0.0, 0, 0.0])
                cell[0] += dt
                cell[1] += 1
                cell[2] += dc  # this thread's CPU in the call (GIL held or not)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def _job_init() -> None:
    """A chunk job's process: the client imported, its phases timed, profiling set up."""
    from hsextract import budget, chunks, client, records

    _timed(client.Client, "_post", "http: POST /generate to its answer")
    _timed(client, "read_pieces", "pieces: wait, open, read ids")
    # Codec none: assemble also writes the rows it checked into the chunk file (row_sink);
    # put_files then writes the ids and mask only.
    _timed(client, "assemble", "checks: parity, shapes, finite, stats, rows written")
    _timed(chunks.ChunkWriter, "put_files", "chunk writer: put_files")
    put = chunks.ChunkWriter.put_files

    def put_files(self, j, ids, *rest, **kw):
        out = put(self, j, ids, *rest, **kw)
        _DONE.append((time.time(), int(ids.numel())))
        return out

    chunks.ChunkWriter.put_files = put_files
    _timed(client.Dump, "close", "close pieces (frees /dev/shm)")
    _timed(client._Window, "acquire", "wait: window")
    _timed(budget.SharedByteBudget, "acquire", "wait: shm budget")
    _timed(budget.SharedByteBudget, "release", "shm budget release")
    # The shared ledger's scan, under its flock (a visit to the ledger).
    scan = "_scan" if hasattr(budget.SharedByteBudget, "_scan") else "_used"
    _timed(budget.SharedByteBudget, scan, "shm ledger: lock held, scan")
    _timed(records, "load_chunk", "per chunk: load records")
    _timed(chunks.ChunkWriter, "finish", "per chunk: finish (fsync, sha256)")
    _timed(chunks, "check_chunk", "per chunk: check_chunk")
    _timed(chunks, "sha256_file", "per chunk: sha256 (its own thread)")
    # What extract_chunk imports on its first call: a process start cost, not a request's.
    import requests  # noqa: F401
    import tqdm  # noqa: F401

    import hsextract.sglang.launch  # noqa: F401
    import hsextract.status  # noqa: F401


def _thread_profile(*_: object) -> None:
    """threading.setprofile hook: the thread's own cProfile, from its first event."""
    import cProfile

    sys.setprofile(None)
    p = cProfile.Profile(time.thread_time)
    try:
        p.enable()
    except ValueError:
        return  # one profiler per process (sys.monitoring): the job's sees every thread
    _PROFILES.append(p)


@contextlib.contextmanager
def _profiled(on: bool):
    """cProfile over this chunk job: its thread and every thread it starts (the client's
    request threads), not the pool worker's idle time between jobs.  Each thread's CPU
    time (``time.thread_time``), not wall: a thread waiting for an answer, a lock or the
    GIL costs nothing here (the phase timers have the wall time)."""
    if not on:
        yield
        return
    import cProfile

    main = cProfile.Profile(time.thread_time)
    main.enable()
    _PROFILES.append(main)
    threading.setprofile(_thread_profile)
    try:
        yield
    finally:
        threading.setprofile(None)
        main.disable()


def _chunk_job(
    cfg: dict, state: dict, chunk: str, index: str, out_dir: str, profile: bool = False
) -> dict:
    """One chunk job, as the workflow's rule runs it; its file removed after."""
    from hsextract.client import extract_chunk
    from hsextract.config import typed

    _PHASES.clear()
    _DONE.clear()
    out = Path(out_dir) / f"{Path(chunk).stem}.safetensors"
    cpu, t = time.process_time(), time.monotonic()
    with _profiled(profile):
        sc = extract_chunk(
            typed(cfg), chunk_path=Path(chunk), index_path=Path(index), out_path=out,
            sidecar_path=out.with_suffix(".json"), ensure=lambda: state, progress=False,
        )  # fmt: skip
    wall, cpu = time.monotonic() - t, time.process_time() - cpu
    out.unlink()
    out.with_suffix(".json").unlink()
    keep = ("records", "tokens", "states_raw_bytes", "bytes", "window", "abandoned_requests")
    return {
        **{k: sc[k] for k in keep},
        "wall_s": wall,
        "cpu_s": cpu,
        "phases": {k: list(v) for k, v in _PHASES.items()},
        "done": list(_DONE),
    }


def _dump_profile(path: str) -> bool:
    if not _PROFILES:
        return False
    stats = None
    for p in _PROFILES:
        with contextlib.suppress(TypeError):  # a profile that saw no call
            if stats is None:
                stats = pstats.Stats(p)
            else:
                stats.add(p)
    if stats is None:
        return False
    stats.dump_stats(path)
    return True


def _bare_chunk(chunk: str, url: str, window: int, dump_dir: str) -> dict:
    """The baseline sender: the chunk's records through /generate, ``window`` in flight;
    each request's pieces waited for (names and headers only) and unlinked."""
    import requests
    from requests.adapters import HTTPAdapter

    session = requests.Session()
    session.mount("http://", HTTPAdapter(pool_connections=1, pool_maxsize=max(10, window)))
    recs = [json.loads(line)["input_ids"] for line in Path(chunk).read_text().splitlines()]
    tag = f"bare{os.getpid()}x{time.monotonic_ns():x}"
    done: list[tuple[float, int]] = []
    cpu, t = time.process_time(), time.monotonic()

    def one(j: int) -> None:
        ids = recs[j]
        rid = f"{tag}-{j:06d}"
        body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 0}}
        session.post(f"{url}/generate", json=body, timeout=600).raise_for_status()
        d = os.path.join(dump_dir, rid)
        delay, covered, seen = 0.001, 0, {}
        while covered < len(ids):
            for name in os.listdir(d) if os.path.isdir(d) else ():
                if name.endswith(".safetensors") and name not in seen:
                    with open(os.path.join(d, name), "rb") as f:
                        n = int.from_bytes(f.read(8), "little")
                        seen[name] = json.loads(f.read(n))["input_ids"]["shape"][0]
                        covered += seen[name]
            if covered < len(ids):
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        for name in seen:
            os.unlink(os.path.join(d, name))
        os.rmdir(d)
        done.append((time.time(), len(ids)))

    if recs:
        with ThreadPoolExecutor(window) as pool:
            list(pool.map(one, range(len(recs))))
    return {
        "records": len(recs),
        "tokens": sum(len(r) for r in recs),
        "wall_s": time.monotonic() - t,
        "cpu_s": time.process_time() - cpu,
        "done": done,
    }


# ------------------------------------------------------------------------- the matrix


def _aux_layers(k: int) -> list[int]:
    """k layers spread like EAGLE-3's [2, L//2, L-3] over a NUM_LAYERS-deep target."""
    if k == 1:
        return [2]
    return sorted({round(2 + i * (NUM_LAYERS - 5) / (k - 1)) for i in range(k)})


def make_records(root: Path, length: int, n: int, chunk_tokens: int) -> tuple[list[Path], Path]:
    """n records of ``length`` tokens through the real merge and split; chunks of about
    ``chunk_tokens`` tokens.  Returns (chunk files, index)."""
    import numpy as np

    from hsextract.records import merge_and_shuffle, split_chunks

    root.mkdir(parents=True)
    rng = np.random.default_rng(length)
    data = root / "data.jsonl"
    with open(data, "w") as f:
        for i in range(n):
            ids = rng.integers(2, VOCAB, length).tolist()
            f.write(json.dumps({"id": f"r{i:07d}", "input_ids": ids, "loss_mask": [1] * length}))
            f.write("\n")
    merge_and_shuffle([data], root / "merged", max_seq_len=length, overlength="truncate", seed=0,
                      vocab_size=VOCAB, max_reject_fraction=0.0)  # fmt: skip
    n_chunks = max(1, round(n * length / chunk_tokens))
    chunks = [root / "chunks" / f"chunk_{i:05d}.jsonl" for i in range(n_chunks)]
    split_chunks(root / "merged" / "train.jsonl", chunks, root / "chunks" / "index.json")
    data.unlink()
    return [c for c in chunks if c.stat().st_size], root / "chunks" / "index.json"


def make_config(work: Path, a: argparse.Namespace, length: int, k: int, dp: int) -> dict:
    import yaml

    from hsextract.config import load_config

    model = work / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": a.hidden,
                "num_hidden_layers": NUM_LAYERS,
                "vocab_size": VOCAB,
                "torch_dtype": "bfloat16",
            }
        )  # fmt: skip
    )
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(
        engine="reference", inputs=[str(work / "none.jsonl")], output_root=str(work / "results"),
        n_chunks=1, max_seq_len=max(length, 16), aux_layers=_aux_layers(k),
        model={"path": str(model), "dtype": "bfloat16"},
    )  # fmt: skip
    cfg["demo"] = {"enabled": False}
    # Per DP worker: what the client's window may reach, so it is never the limit here.
    cfg["server"].update(
        chunked_prefill_size=a.piece_tokens, max_running_requests=a.in_flight * a.sending
    )
    cfg["client"].update(requests_in_flight=a.in_flight, sending_jobs=a.sending)
    cfg["dump"] = {"dir": str(work / "dump"), "shm_budget_gb": a.shm_budget_gb}
    cfg["storage"] = {"codec": a.codec}
    cfg["sglang"] = {"dp_size": dp}
    (work / "none.jsonl").touch()
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)


def _state(cfg: dict, stub: Stub, work: Path) -> dict:
    """The live state a chunk job gets from ``ensure()``: the stub as the server."""
    from dataclasses import asdict

    from hsextract import server
    from hsextract.config import typed

    spec = server.build_spec(typed(cfg), run_dir=work, log_path=work / "stub.log")
    spec.port = int(stub.url.rsplit(":", 1)[1])
    return {
        "pid": stub.pgid,
        "pgid": stub.pgid,
        "url": stub.url,
        "host": socket.gethostname(),
        "started_at": time.time(),
        "healthy_at": time.time(),
        "server_version": "stub",
        "spec": asdict(spec),
    }


def run_rounds(pool, fn, items: list, deadline: float) -> dict:
    """Submit ``items`` one per free worker until the deadline.  Returns the results, the
    wall time, and the steady window: from the start (wall clock) to the first moment a
    worker had nothing left to take (``drain_at``), when fewer jobs run than -j says."""
    todo, running, out = deque(items), set(), []
    t, start = time.monotonic(), time.time()
    drain_at = None
    workers = pool._max_workers  # noqa: SLF001 - the pool's size, as given
    while todo or running:
        # Past the deadline nothing new starts (once something finished): the jobs under way
        # finish, so the figure is whole chunks over the time they took.
        if out and time.monotonic() >= deadline:
            todo.clear()
        while todo and len(running) < workers:
            running.add(pool.submit(fn, todo.popleft()))
        if drain_at is None and not todo and running and out:
            drain_at = time.time()
        if running:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            out.extend(f.result() for f in done)
    end = time.time()
    return {"results": out, "wall": time.monotonic() - t, "start": start,
            "drain_at": drain_at or end}  # fmt: skip


def _bare_window(a: argparse.Namespace, length: int, k: int, dp: int) -> int:
    """Requests in flight per bare process: the client's window, and no more bytes in the
    dump dir than the client's budget lets in (``shm_budget_gb x dp`` over the sending
    processes): 2k-token records at dp 8 would otherwise fill /dev/shm."""
    import torch

    from hsextract.budget import dump_bytes_for_request

    need = dump_bytes_for_request(length, a.hidden, k, torch.bfloat16, a.piece_tokens)
    room = int(a.shm_budget_gb * 2**30 * dp) // a.sending
    return max(1, min(a.in_flight * dp, room // need))


def _steady(done: list[tuple[float, int]], start: float, until: float) -> tuple[float, int, float]:
    """(requests, tokens, seconds) finished in [start, until]."""
    inside = [n for at, n in done if start <= at <= until]
    return len(inside), sum(inside), max(until - start, 1e-9)


def one_cell(a, work: Path, chunks, index, length: int, k: int, dp: int, pools, share_s: float):
    """The client and the bare baseline on one (length, layers, dp): two dicts of figures."""
    from functools import partial

    from hsextract import dp as dpmod
    from hsextract.server import prepare_dump_dir

    cell = work / f"L{length}-k{k}-dp{dp}"
    cell.mkdir()
    cfg = make_config(cell, a, length, k, dp)
    dump = cell / "dump"
    prepare_dump_dir(dump, owner=str(cell))
    procs = max(dp, a.stub_procs)
    stub_args = {
        "dp": dp, "dump_dir": str(dump), "aux_layers": _aux_layers(k), "hidden": a.hidden,
        "chunked_prefill_size": a.piece_tokens, "pieces": a.pieces,
        "writer_threads": a.writer_threads, "model_path": str(cell / "model"),
        "context_length": max(length, 16),
    }  # fmt: skip
    stub = Stub(stub_args, procs, cell / "stub.log")
    rows = {}
    try:
        state = _state(cfg, stub, cell)
        alive = dpmod.workers_alive({**state, "spec": {"extra": {"workers": dp}}})
        out_dir = cell / "hidden"
        out_dir.mkdir()
        per_token = 2 * a.hidden * (k + 1)
        for name in a.order:
            before, t0 = stub.cpu_s(), time.monotonic()
            until = t0 + share_s * SHARES[name] / sum(SHARES[n] for n in a.order)
            if name == "bare":
                window = _bare_window(a, length, k, dp)
                job = partial(_bare_chunk, url=stub.url, window=window, dump_dir=str(dump))
            else:
                job = partial(_chunk_job, cfg, state, index=str(index), out_dir=str(out_dir),
                              profile=name == "profiled")  # fmt: skip
            run = run_rounds(
                pools["bare" if name == "bare" else "client"], job, [str(c) for c in chunks], until
            )
            res, wall = run["results"], run["wall"]
            stub_cpu = stub.cpu_s() - before
            recs = sum(r["records"] for r in res)
            toks = sum(r["tokens"] for r in res)
            done = [d for r in res for d in r["done"]]
            n_s, tok_s, secs = _steady(done, run["start"], run["drain_at"])
            row = {
                "length": length, "layers": k, "dp": dp, "mode": name,
                "chunks": len(res), "records": recs, "tokens": toks, "wall_s": round(wall, 3),
                # While every job ran (the tail, fewer jobs than -j, left out) ...
                "requests_per_s": round(n_s / secs, 1),
                "states_gb_per_s": round(tok_s * per_token / secs / 1e9, 3),
                "steady_s": round(secs, 3),
                # ... and over the whole round, tail included.
                "requests_per_s_whole": round(recs / wall, 1),
                "states_gb_per_s_whole": round(toks * per_token / wall / 1e9, 3),
                "client_cores": round(sum(r["cpu_s"] for r in res) / wall, 2),
                "stub_cores": round(stub_cpu / wall, 2),
                "stub_procs": procs, "stub_pids": [p.pid for p in stub.procs],
                "dp_workers_seen": alive,
            }  # fmt: skip
            if name != "bare":
                phases: dict[str, list[float]] = {}
                for r in res:
                    for p, (s, c, cpu) in r["phases"].items():
                        cur = phases.setdefault(p, [0.0, 0, 0.0])
                        cur[0] += s
                        cur[1] += c
                        cur[2] += cpu
                row["phase_ms_per_request"] = {
                    p: round(s / max(recs, 1) * 1e3, 3) for p, (s, _, _) in phases.items()
                }
                # CPU, not wall: what each phase costs the job's cores (each thread's own
                # time in the call), and the whole process's CPU per request beside it.
                row["phase_cpu_ms_per_request"] = {
                    p: round(cpu / max(recs, 1) * 1e3, 3) for p, (_, _, cpu) in phases.items()
                }
                row["phase_calls_per_request"] = {
                    p: round(c / max(recs, 1), 3) for p, (_, c, _) in phases.items()
                }
                row["cpu_ms_per_request"] = round(
                    sum(r["cpu_s"] for r in res) / max(recs, 1) * 1e3, 3
                )
                row["abandoned"] = sum(r["abandoned_requests"] for r in res)
                row["stored_bytes_ratio"] = round(
                    sum(r["bytes"] for r in res) / max(1, sum(r["states_raw_bytes"] for r in res)),
                    3,
                )
            left = [p.name for p in dump.iterdir() if not p.name.startswith(".")]
            row["leftover_request_dirs"] = len(left)
            rows[name] = row
    finally:
        stub.stop()
    return rows


#: A cell's time: the client unprofiled (its figures), the bare baseline, then the client
#: again under cProfile (the profile; its rate is reported, not the headline: cProfile slows
#: Python down, requests' and urllib3's per-request calls most).
SHARES = {"client": 0.4, "bare": 0.3, "profiled": 0.3}


def _make_pool(n: int, client: bool) -> ProcessPoolExecutor:
    ctx = multiprocessing.get_context("spawn")
    init = _job_init if client else None
    pool = ProcessPoolExecutor(n, mp_context=ctx, initializer=init)
    # Every worker started and imported before any clock.
    list(pool.map(_warm_sleep, [0.5] * n))
    return pool


def _warm_sleep(s: float) -> None:
    time.sleep(s)


def _dump_own_profile(where: str) -> int:
    """This worker's profile since the last call to ``<where>/prof-<pid>.pstats`` (then
    started afresh: one cell's profile at a time); its pid."""
    _dump_profile(os.path.join(where, f"prof-{os.getpid()}.pstats"))
    _PROFILES.clear()
    time.sleep(0.05)  # let the other workers take the other tasks
    return os.getpid()


def _collect_profiles(pool: ProcessPoolExecutor, n: int, where: Path) -> list[Path]:
    """Every worker's profile of the cell just run, once its work is done."""
    where.mkdir()
    want = set(pool._processes)  # noqa: SLF001 - the workers' pids
    seen: set[int] = set()
    for _ in range(50):
        seen |= set(pool.map(_dump_own_profile, [str(where)] * n))
        if want <= seen:
            break
    return sorted(where.glob("prof-*.pstats"))


#: C calls that release the GIL while they run (syscalls, hashing, socket I/O, waits, torch
#: kernels, zstd): their own time is not the GIL's (``gil_held_s``).  Not separable: numpy's
#: ufuncs (``storage.split_planes``' shifts) release it too, but cProfile counts their time
#: in the Python function that calls them, so the estimate keeps it.
_GIL_FREE = re.compile(
    r"posix\.(splice|preadv|pwrite|close|listdir|unlink|rmdir|open|fstat|read|write|fdatasync"
    r"|fsync)\b|'update' of '_hashlib|'acquire' of '_thread|_socket\.socket|time\.sleep"
    r"|'(compress|decompress)' of 'zstandard"
    r"|select\.poll|method 'poll'|torch\._C\._linalg|torch\.isfinite"
    r"|'(sum|amax|abs|square|item|float)' of 'torch"
)


def gil_held_s(files: list[Path]) -> float | None:
    """Seconds of the profiles' own time (each thread's CPU) outside the calls that release
    the GIL: Python code and the C calls that keep it.  A job's threads share one GIL, so
    per request this bounds one job's requests/s.  An estimate: cProfile's own overhead is
    in it.  None where the profile has negative own times: cProfile subtracts a callee's
    time read on one thread from a caller's read on another (thread starts, pool hand-offs),
    which with ~100 threads a job made the sum negative on the 16-core device (issue 40)."""
    if not files:
        return 0.0
    stats = pstats.Stats(*[str(f) for f in files])
    own = [
        (tt, path == "~" and bool(_GIL_FREE.search(name)))
        for (path, _, name), (_, _, tt, _, _) in stats.stats.items()  # type: ignore[attr-defined]
    ]
    if any(tt < 0 for tt, _ in own):
        return None
    return sum(tt for tt, free in own if not free)


def profile_text(files: list[Path], top: int, full: bool = True) -> str:
    if not files:
        return "(no profile)\n"
    stats = pstats.Stats(*[str(f) for f in files])
    buf = io.StringIO()
    stats.stream = buf
    if full:
        stats.sort_stats("cumulative").print_stats(top)
    buf.write("\n--- hsextract's own functions, by cumulative time ---\n")
    stats.sort_stats("cumulative").print_stats("hsextract/", top)
    buf.write("\n--- by own time (tottime) ---\n")
    stats.sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="report dir (JSON + text)")
    ap.add_argument("--lengths", default="128,550,2048", help="record lengths, tokens")
    ap.add_argument("--layers", default="3,6", help="captured aux layers (the final is added)")
    ap.add_argument("--dp", default="1,2,4,8", help="simulated data-parallel workers")
    ap.add_argument("--jobs", type=int, default=8, help="chunk jobs at once (snakemake -jN)")
    ap.add_argument("--sending", type=int, default=0, help="client.sending_jobs (0: jobs/2)")
    ap.add_argument("--in-flight", type=int, default=16, help="client.requests_in_flight")
    ap.add_argument("--codec", default="none", choices=["none", "lossless"])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--piece-tokens", type=int, default=8192, help="chunked prefill size")
    ap.add_argument("--records", type=int, default=0, help="per length (0: from --tokens)")
    ap.add_argument("--tokens", type=float, default=4e6, help="tokens of records per length")
    ap.add_argument("--chunk-tokens", type=int, default=32768, help="tokens per chunk")
    ap.add_argument("--shm-budget-gb", type=float, default=2.0, help="per DP worker")
    ap.add_argument("--pieces", default="before", choices=["before", "after"],
                    help="the stub's pieces land before its answer, or after")  # fmt: skip
    ap.add_argument("--stub-procs", type=int, default=0, help="stub processes (0: cores/4)")
    ap.add_argument("--writer-threads", type=int, default=4, help="per stub process")
    ap.add_argument("--baseline", default="bare", choices=["bare", "none"])
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="whole run, setup included (a cell may overrun by a chunk)")  # fmt: skip
    ap.add_argument("--top", type=int, default=25, help="profile lines")
    ap.add_argument("--work-root", default="/dev/shm",
                    help="where its work dir (records, chunk files, dump dir) is made")  # fmt: skip
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, every cell: seconds")
    a = ap.parse_args()
    if a.quick:  # tiny sizes, where not given
        quick = {
            "lengths": "128", "layers": "1", "dp": "1,2", "hidden": 256, "jobs": 2,
            "in_flight": 4, "records": 96, "chunk_tokens": 128 * 12, "budget_s": 6.0,
            "stub_procs": 1, "writer_threads": 2,
        }  # fmt: skip
        argv = sys.argv[1:]
        given = {
            act.dest
            for act in ap._actions  # noqa: SLF001 - which flags the command line names
            for opt in act.option_strings
            if any(x == opt or x.startswith(f"{opt}=") for x in argv)
        }
        for key, value in quick.items():
            if key not in given:
                setattr(a, key, value)
    a.sending = a.sending or max(1, a.jobs // 2)
    a.stub_procs = a.stub_procs or max(1, (os.cpu_count() or 4) // 4)
    a.order = ["client"] + (["bare"] if a.baseline == "bare" else [])
    a.order += [] if a.no_profile else ["profiled"]
    lengths = [int(x) for x in a.lengths.split(",")]
    layers = [int(x) for x in a.layers.split(",")]
    dps = [int(x) for x in a.dp.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    # Ours alone: a fresh dir, removed at the end; nothing else in /dev/shm is touched.
    work = Path(a.work_root) / f"hsextract-ceiling-{os.getuid()}-{os.getpid()}"
    work.mkdir(mode=0o700)
    # A kill (timeout, Ctrl-C) still removes it; the stub dies with us (PDEATHSIG).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: list[dict] = []
    pools: dict[str, ProcessPoolExecutor] = {}
    text: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        text.append(line)

    try:
        pools["client"] = _make_pool(a.jobs, True)
        if a.baseline == "bare":
            pools["bare"] = _make_pool(a.sending, False)
        say(f"client ceiling: -j{a.jobs}, {a.sending} sending, {a.in_flight} in flight per job "
            f"per DP worker, hidden {a.hidden}, bf16, codec {a.codec}, pieces {a.pieces} the "
            f"answer, chunked prefill {a.piece_tokens}, stub {a.stub_procs}+ processes x "
            f"{a.writer_threads} writer threads, {os.cpu_count()} CPUs")  # fmt: skip
        cells = [(L, k, d) for L in lengths for k in layers for d in dps]
        data: dict[int, tuple] = {}
        for L in lengths:
            n = a.records or max(8, int(a.tokens // L))
            data[L] = make_records(work / f"data-{L}", L, n, a.chunk_tokens)
        setup = time.monotonic() - started
        share = max(0.5, (a.budget_s - setup) / len(cells) - 2.0)  # ~2 s: stub start, config
        say(f"{len(cells)} cells, ~{share:.1f} s each (--budget-s {a.budget_s:.0f}; setup "
            f"{setup:.1f} s)")  # fmt: skip
        hdr = (f"{'len':>5} {'aux':>3} {'dp':>2}  {'client req/s':>12} {'GB/s':>6} "
               f"{'cores':>5}  {'bare req/s':>10} {'GB/s':>6}  {'client/bare':>11}  "
               f"{'stub cores':>10}  {'profiled req/s':>14}")  # fmt: skip
        say(hdr)
        prof_files: list[Path] = []
        per_cell: list[str] = []
        for i, (L, k, d) in enumerate(cells):
            # A cell's rounds can outlast its share (a round is every chunk once): stop at the
            # budget rather than be killed by the caller's limit with nothing reported.
            # --quick runs every cell whatever the clock says: its budget sizes the cells'
            # shares (a loaded machine's setup alone can outlast it: none would run).
            if not a.quick and time.monotonic() - started > a.budget_s:
                say(f"--budget-s {a.budget_s:.0f} spent: {len(cells) - i} cell(s) not run")
                break
            chunks, index = data[L]
            got = one_cell(a, work, chunks, index, L, k, d, pools, share)
            if not a.no_profile:
                files = _collect_profiles(pools["client"], a.jobs, work / f"prof-L{L}-k{k}-dp{d}")
                prof_files += files
                per_cell.append(f"===== L{L} aux{k} dp{d} =====\n" + profile_text(files, 15, False))
            c, b, pr = got["client"], got.get("bare"), got.get("profiled")
            if pr and not a.no_profile:
                held = gil_held_s(files)
                pr["gil_held_ms_per_request_est"] = (
                    None if held is None else round(held / max(pr["records"], 1) * 1e3, 3)
                )
            rows.extend(got.values())
            ratio = f"{c['requests_per_s'] / b['requests_per_s']:.3f}" if b else "-"
            prof_rate = pr["requests_per_s"] if pr else 0.0
            say(f"{L:>5} {k:>3} {d:>2}  {c['requests_per_s']:>12,.1f} "
                f"{c['states_gb_per_s']:>6.2f} {c['client_cores']:>5.1f}  "
                f"{b['requests_per_s'] if b else 0:>10,.1f} "
                f"{b['states_gb_per_s'] if b else 0:>6.2f}  {ratio:>11}  "
                f"{c['stub_cores']:>10.1f}  {prof_rate:>14,.1f}")  # fmt: skip
        say("")
        say("per request, client side: wall ms by phase (summed over threads; 'per chunk' "
            "phases spread over the chunk's requests)")  # fmt: skip
        for r in rows:
            if r["mode"] == "bare":
                continue
            parts = sorted(r["phase_ms_per_request"].items(), key=lambda kv: -kv[1])
            say(f"  L{r['length']} aux{r['layers']} dp{r['dp']} {r['mode']}: "
                + "; ".join(f"{p} {ms:.3f}" for p, ms in parts))  # fmt: skip
        say("")
        say("per request, client side: CPU ms by phase (each thread's own CPU in the call, "
            "GIL held or not), and the chunk jobs' whole CPU per request")  # fmt: skip
        for r in rows:
            if r["mode"] != "client":
                continue
            parts = sorted(r["phase_cpu_ms_per_request"].items(), key=lambda kv: -kv[1])
            cells = [f"{p} {ms:.3f}" for p, ms in parts]
            visits = r["phase_calls_per_request"].get("shm ledger: lock held, scan", 0)
            say(f"  L{r['length']} aux{r['layers']} dp{r['dp']}: total "
                f"{r['cpu_ms_per_request']:.3f}; " + "; ".join(cells)
                + f"; shm ledger visits per request {visits:.3f}")  # fmt: skip
        gil = [r for r in rows if "gil_held_ms_per_request_est" in r]
        if gil:
            say("per request, GIL held (estimate, profiled run: the profile's own time outside "
                "the calls that release the GIL; cProfile's overhead is in it, so it is high): "
                "what bounds one job's requests/s")  # fmt: skip
            for r in gil:
                est = r["gil_held_ms_per_request_est"]
                say(f"  L{r['length']} aux{r['layers']} dp{r['dp']}: "
                    + (f"{est:.3f} ms" if est is not None else "not told: the profile has "
                       "negative own times (cProfile across the job's threads)"))  # fmt: skip
        leftovers = sum(r["leftover_request_dirs"] for r in rows)
        say(f"leftover request dirs in the dump dirs: {leftovers}")
        prof = ""
        if not a.no_profile:
            prof = "===== every cell =====\n" + profile_text(prof_files, a.top)
            if prof_files:  # every cell's profile, for pstats (the work dir is removed)
                pstats.Stats(*[str(f) for f in prof_files]).dump_stats(
                    str(out / "client_ceiling.pstats")
                )
            (out / "client_ceiling.profile.txt").write_text(prof + "\n".join(per_cell))
        best = max((r for r in rows if r["mode"] == "client"), key=lambda r: r["requests_per_s"])
        say(f"client ceiling: best {best['requests_per_s']:,.1f} req/s "
            f"(L{best['length']} aux{best['layers']} dp{best['dp']}), "
            f"{max(r['states_gb_per_s'] for r in rows if r['mode'] == 'client'):.2f} GB/s at "
            f"most; total {time.monotonic() - started:.1f} s")  # fmt: skip
        report = {
            "args": {k: v for k, v in vars(a).items()},
            "cpus": os.cpu_count(),
            "rows": rows,
            "leftover_request_dirs": leftovers,
            "work_dir": str(work),
            "seconds": round(time.monotonic() - started, 1),
        }
        (out / "client_ceiling.json").write_text(json.dumps(report, indent=1))
        (out / "client_ceiling.txt").write_text("\n".join(text) + "\n\n" + prof)
        if prof:
            print("\nprofile of the chunk jobs (top by cumulative time):")
            print(prof.split("\n--- by own time")[0])
    finally:
        for pool in pools.values():
            pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--stub-process":
        _stub_main(json.loads(sys.argv[2]))
    else:
        main()
