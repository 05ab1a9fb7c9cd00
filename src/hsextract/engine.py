"""The reference engine: an HF-transformers forward behind SGLang's HTTP API subset.

It stands in for SGLang wherever a GPU node or a live SGLang cannot be had (CI, laptops,
the embedded default) and it is a real engine, not a mock: requests are scheduled the way
SGLang schedules them -- *chunked prefill* (a long prompt goes through several EXTEND
passes, its KV cache carried between them) and *continuous batching* (several requests'
extend segments padded into one batched forward) -- and every EXTEND pass hands its
per-request slices to :mod:`hsextract.capture`, the same code the SGLang patch calls.
DECODE passes (``max_new_tokens`` > 0) capture nothing, as in the patch.

API (what the hsextract client uses): ``GET /health``, ``GET /get_model_info``,
``POST /generate`` with ``input_ids``, ``rid`` and ``sampling_params.max_new_tokens``.

Data parallel (``--dp-size N``), as SGLang 0.5.14 runs it (``data_parallel_controller.py``):
N worker processes, each a model copy with its own scheduler and its own capture writer,
behind the one HTTP port; a controller in the front process hands each request to one
worker (``--load-balance-method``: round robin, SGLang's default, or fewest requests) and
sends ``/abort_request`` to every worker, as SGLang's controller does with every message
that is not a request (its dispatcher's fallback, ``send_control_message``).  Like
SGLang's controller it never checks that a worker is alive: a request handed to a dead
worker is never answered (``hsextract.dp`` explains what notices instead).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection, wait

import torch

from hsextract import __version__, faults
from hsextract.capture import DumpWriter, get_writer
from hsextract.convention import default_aux_layers, prenorm_layer

log = logging.getLogger("hsextract.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RequestAborted(Exception):
    """The request was aborted (/abort_request) before it finished."""


@dataclass
class Request:
    """One /generate call as the scheduler sees it."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    future: Future = field(default_factory=Future)
    prefilled: int = 0
    # Per layer (keys, values), each [1, heads, seq, dim]; MLA keeps compressed latents.
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    output_ids: list[int] = field(default_factory=list)
    last_logits: torch.Tensor | None = None
    #: The DP worker that served it (dp > 1), as the front learns from the worker.
    dp_rank: int | None = None

    @property
    def remaining(self) -> int:
        return len(self.input_ids) - self.prefilled


class ModelRunner:
    """Batched EXTEND and DECODE forwards over per-request KV caches, with capture on extend.

    Requests in one EXTEND batch may sit at different prefix lengths.  Their cached K/V are
    left-padded to the longest prefix and their new tokens right-padded to the longest
    segment; a 2-D attention mask hides the pads, explicit position ids keep RoPE exact.
    """

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        device: str = "cpu",
        aux_layers: Sequence[int] | None = None,
        writer: DumpWriter | None = None,
        batch_invariant: bool = True,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.config = self.model.config
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.aux_layers = (
            list(aux_layers) if aux_layers is not None else default_aux_layers(self.num_layers)
        )
        bad = [i for i in self.aux_layers if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"aux layers {bad} outside [0, {self.num_layers}]")
        # Aux index L is the stream leaving the last layer, before the final norm: HF's
        # hidden_states end with the *normed* state, so the norm's input is taken by a hook.
        self._prenorm: torch.Tensor | None = None
        # (tests only: a capture fault storing the pre-norm state as the final one needs it)
        if prenorm_layer(self.num_layers) in self.aux_layers or (
            faults.ACTIVE and faults.capture_needs_prenorm()
        ):
            self.model.model.norm.register_forward_pre_hook(self._take_prenorm)
        self.writer = writer
        self.batch_invariant = batch_invariant
        params = inspect.signature(self.model.model.forward).parameters
        # transformers renamed past_key_values -> cache; accept either release.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def describe(self) -> dict:
        """What the HTTP front needs to know of the model (it may hold no copy itself)."""
        return {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "aux_layers": self.aux_layers,
            "dtype": str(self.dtype).removeprefix("torch."),
            "capture": self.writer is not None,
            "batch_invariant": self.batch_invariant,
            "vocab_size": int(self.config.vocab_size),
        }

    def _take_prenorm(self, module: torch.nn.Module, args: tuple) -> None:
        self._prenorm = args[0]

    @torch.inference_mode()
    def extend(self, reqs: Sequence[Request], lens: Sequence[int]) -> None:
        """Prefill ``lens[j]`` more tokens of each request as one EXTEND batch; capture it.

        Batch-invariant mode computes each request's segment in its own forward, so a
        record's numbers depend only on its tokens and segment boundaries, never on which
        requests happened to share the batch: a rerun reproduces the same bytes.  The
        capture still sees one multi-request batch, exactly as from SGLang.
        """
        prefix = [r.prefilled for r in reqs]
        if self.batch_invariant:
            rows = [self._forward([r], [n])[0] for r, n in zip(reqs, lens, strict=True)]
        else:
            rows = self._forward(reqs, lens)
        if faults.ACTIVE:  # tests only: a capture that is wrong (the audit must catch it)
            rows = [
                (ids, faults.captured(r.rid, hs, self.aux_layers, self.num_layers))
                for r, (ids, hs) in zip(reqs, rows, strict=True)
            ]
        if self.writer is not None:
            flat_ids = torch.cat([ids for ids, _ in rows])
            final = torch.cat([hs[-1] for _, hs in rows])
            aux = [torch.cat([hs[layer] for _, hs in rows]) for layer in self.aux_layers]
            self.writer.write_batch(
                [r.rid for r in reqs], prefix, list(lens), flat_ids, final, aux, self.aux_layers
            )

    def _forward(
        self, reqs: Sequence[Request], lens: Sequence[int]
    ) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """One padded batched forward; per request its new ids and hidden states [n, H]."""
        from transformers import DynamicCache

        b = len(reqs)
        prefix = [r.prefilled for r in reqs]
        p_max, n_max = max(prefix), max(lens)
        ids = torch.zeros((b, n_max), dtype=torch.long)
        pos = torch.zeros((b, n_max), dtype=torch.long)
        mask = torch.zeros((b, p_max + n_max), dtype=torch.long)
        for j, (r, n) in enumerate(zip(reqs, lens, strict=True)):
            p = prefix[j]
            ids[j, :n] = torch.tensor(r.input_ids[p : p + n])
            pos[j] = torch.arange(p, p + n_max)
            mask[j, p_max - p : p_max + n] = 1
        cache = DynamicCache(config=self.config)
        if p_max > 0:
            for layer in range(self.num_layers):
                ks, vs = [], []
                for r in reqs:
                    k, v = r.kv[layer] if r.kv is not None else (None, None)
                    ks.append(_left_pad(k, p_max, like=reqs, layer=layer, idx=0))
                    vs.append(_left_pad(v, p_max, like=reqs, layer=layer, idx=1))
                cache.update(torch.cat(ks), torch.cat(vs), layer)
        out = self.model.model(
            input_ids=ids.to(self.device),
            # Without padding there is nothing to mask; passing no mask keeps the
            # single-request path identical to a plain forward.
            attention_mask=mask.to(self.device) if b > 1 else None,
            position_ids=pos.to(self.device),
            use_cache=True,
            output_hidden_states=True,
            **{self._cache_kw: cache},
        )
        hs = out.hidden_states  # [0] embeddings, [i] entering layer i, [-1] after final norm
        if self._prenorm is not None:  # [L] before the final norm, [L + 1] after it
            hs = (*hs[:-1], self._prenorm, hs[-1])
            self._prenorm = None
        result = []
        for j, r in enumerate(reqs):
            n, p = lens[j], prefix[j]
            r.kv = [
                (
                    cache.layers[layer].keys[j : j + 1, :, p_max - p : p_max + n].clone(),
                    cache.layers[layer].values[j : j + 1, :, p_max - p : p_max + n].clone(),
                )
                for layer in range(self.num_layers)
            ]
            r.prefilled += n
            if r.prefilled == len(r.input_ids):
                r.last_logits = self.model.lm_head(hs[-1][j, n - 1])
            result.append((ids[j, :n], [h[j, :n] for h in hs]))
        return result

    @torch.inference_mode()
    def decode(self, req: Request) -> None:
        """One greedy DECODE step; never captured (EAGLE-3 trains on the prompt's states)."""
        from transformers import DynamicCache

        token = int(torch.argmax(req.last_logits))
        req.output_ids.append(token)
        if len(req.output_ids) >= req.max_new_tokens:
            return
        cache = DynamicCache(config=self.config)
        for layer, (k, v) in enumerate(req.kv or []):
            cache.update(k, v, layer)
        seq = len(req.input_ids) + len(req.output_ids) - 1
        out = self.model.model(
            input_ids=torch.tensor([[token]], device=self.device),
            position_ids=torch.tensor([[seq]], device=self.device),
            use_cache=True,
            **{self._cache_kw: cache},
        )
        req.kv = [(cache.layers[i].keys, cache.layers[i].values) for i in range(self.num_layers)]
        req.last_logits = self.model.lm_head(out.last_hidden_state[0, -1])


def _left_pad(t: torch.Tensor | None, width: int, *, like, layer: int, idx: int) -> torch.Tensor:
    """Left-pad a [1, h, s, d] cache tensor to ``width`` along the sequence axis."""
    if t is None:
        ref = next(r.kv[layer][idx] for r in like if r.kv is not None)
        return ref.new_zeros((1, ref.shape[1], width, ref.shape[3]))
    pad = width - t.shape[2]
    if pad == 0:
        return t
    return torch.cat([t.new_zeros((1, t.shape[1], pad, t.shape[3])), t], dim=2)


class Scheduler:
    """SGLang-like scheduling: a token budget per EXTEND batch, a cap on running requests."""

    def __init__(self, runner: ModelRunner, chunked_prefill_size: int, max_running: int) -> None:
        self.runner = runner
        self.budget = chunked_prefill_size if chunked_prefill_size > 0 else sys.maxsize
        self.max_running = max_running
        self.waiting: queue.Queue[Request] = queue.Queue()
        self.running: list[Request] = []
        self._stop = threading.Event()
        self._abort_lock = threading.Lock()
        self._aborted: set[str] = set()
        self.aborts: list[dict] = []  # what was aborted, and how far it had got
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    def submit(self, req: Request) -> Future:
        self.waiting.put(req)
        return req.future

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def load(self) -> dict:
        """Requests running and waiting, and the last aborts (for /get_server_info)."""
        return {
            "running": len(self.running),
            "waiting": self.waiting.qsize(),
            "aborted": self.aborts[-100:],
        }

    def abort(self, rid: str) -> None:
        """SGLang's /abort_request: the request runs no further pass (waiting or running)."""
        with self._abort_lock:
            self._aborted.add(rid)

    def _take_aborted(self, req: Request) -> bool:
        with self._abort_lock:
            if req.rid not in self._aborted:
                return False
            self._aborted.discard(req.rid)
        self.aborts.append({"rid": req.rid, "prefilled": req.prefilled, "of": len(req.input_ids)})
        log.info("aborted %s after %d of %d tokens", req.rid, req.prefilled, len(req.input_ids))
        req.kv = None
        if not req.future.done():
            req.future.set_exception(RequestAborted(req.rid))
        return True

    def _admit(self, block: bool) -> None:
        while len(self.running) < self.max_running:
            try:
                req = self.waiting.get(block=block and not self.running, timeout=0.05)
            except queue.Empty:
                return
            if not self._take_aborted(req):
                self.running.append(req)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._admit(block=True)
            if not self.running:
                continue
            try:
                self.step()
            except Exception as exc:  # a failed forward fails its batch, not the server
                log.exception("forward failed")
                for r in self.running:
                    if not r.future.done():
                        r.future.set_exception(exc)
                self.running = []

    def step(self) -> None:
        """Run one EXTEND batch, or DECODE steps when nothing is left to prefill.

        SGLang fills the token budget and chunks whichever request overflows it, so chunk
        boundaries depend on what else is running.  Batch-invariant mode instead cuts every
        request at multiples of the budget and batches whole segments, so boundaries (and
        with them the numbers) depend on the request alone.
        """
        self.running = [r for r in self.running if not self._take_aborted(r)]
        batch, lens, left = [], [], self.budget
        for r in self.running:
            if r.remaining <= 0 or left <= 0:
                continue
            if self.runner.batch_invariant:
                n = min(r.remaining, self.budget)
                if n > left and batch:
                    continue
            else:
                n = min(r.remaining, left)
            batch.append(r)
            lens.append(n)
            left -= n
        if batch:
            self.runner.extend(batch, lens)
            if faults.ACTIVE:  # tests only: a pass that takes long (the client times out)
                faults.after_extend([r.rid for r in batch])
        else:
            for r in self.running:
                self.runner.decode(r)
        done = [
            r for r in self.running if r.remaining == 0 and len(r.output_ids) >= r.max_new_tokens
        ]
        for r in done:
            self.running.remove(r)
            r.kv = None
            r.future.set_result(r)


class _HttpServer(ThreadingHTTPServer):
    """The engine's HTTP front.  A listen backlog like SGLang's (uvicorn: 2048), not
    socketserver's 5: a chunk job opens a connection per request in flight at once, and
    past the backlog a connection's SYN is dropped and retried a second later (seen: a
    record's first attempt a second late, after its neighbours had given up)."""

    daemon_threads = True
    request_queue_size = 1024


class EngineServer:
    """The HTTP front: validates requests like SGLang and hands them to the scheduler (at
    dp > 1 the :class:`DataParallelController`, which has the same four methods)."""

    def __init__(
        self,
        info: dict,
        scheduler: Scheduler | DataParallelController,
        *,
        context_length: int,
        model_path: str,
        api_key: str | None,
    ) -> None:
        self.info = info  # ModelRunner.describe()
        self.scheduler = scheduler
        self.context_length = context_length
        self.model_path = model_path
        self.api_key = api_key
        # Requests and tokens between arrival and answer, and their most at once: what
        # the client's window (client._Window) let through, seen from the server's side.
        self._load_lock = threading.Lock()
        self._in_flight = {"requests": 0, "tokens": 0}
        self.peak_in_flight = {"requests": 0, "tokens": 0}

    def _arrived(self, tokens: int, sign: int) -> None:
        with self._load_lock:
            self._in_flight["requests"] += sign
            self._in_flight["tokens"] += sign * tokens
            for k, v in self._in_flight.items():
                self.peak_in_flight[k] = max(self.peak_in_flight[k], v)

    def model_info(self) -> dict:
        return {
            "model_path": self.model_path,
            "is_generation": True,
            "context_length": self.context_length,
            "engine": "reference",
            "engine_version": __version__,
            **{k: v for k, v in self.info.items() if k != "vocab_size"},
        }

    def server_info(self) -> dict:
        """The subset of SGLang's /get_server_info the client records."""
        load = self.scheduler.load()
        return {"version": __version__, "engine": "reference", **load,
                "peak_in_flight": dict(self.peak_in_flight)}  # fmt: skip

    def generate(self, body: dict) -> tuple[int, dict]:
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            if len(ids) != 1:
                return 400, {"error": "batched input_ids are not supported; send one request"}
            ids = ids[0]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return 400, {"error": "input_ids must be a non-empty list of ints"}
        if len(ids) > self.context_length:
            return 400, {
                "error": f"input length {len(ids)} exceeds context length {self.context_length}"
            }
        vocab = int(self.info["vocab_size"])
        if any(t < 0 or t >= vocab for t in ids):
            return 400, {"error": f"token id outside [0, {vocab})"}
        rid = str(body.get("rid") or f"ref-{time.monotonic_ns():x}")
        if faults.ACTIVE and (injected := faults.before_generate(rid)):  # tests only
            return injected
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 0) or 0)
        req = Request(rid=rid, input_ids=ids, max_new_tokens=max_new)
        self._arrived(len(ids), 1)
        try:
            self.scheduler.submit(req).result()
        except RequestAborted:
            # As SGLang answers an aborted request: 200, finish reason "abort".
            return 200, {
                "text": "",
                "output_ids": [],
                "meta_info": {"id": rid, "finish_reason": {"type": "abort"}},
            }
        finally:
            self._arrived(len(ids), -1)
        if faults.ACTIVE:  # tests only: tamper with this request's dump pieces
            faults.after_generate(rid, len(ids), os.environ.get("SGLANG_HS_DUMP_DIR"))
        return 200, {
            "text": "",
            "output_ids": req.output_ids,
            "meta_info": {
                "id": rid,
                **({"dp_rank": req.dp_rank} if req.dp_rank is not None else {}),
                "prompt_tokens": len(ids),
                "completion_tokens": len(req.output_ids),
                "finish_reason": {"type": "length", "length": max_new},
            },
        }

    def handler(self) -> type[BaseHTTPRequestHandler]:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # An answer goes out as two writes (headers, body); on a kept-alive connection
            # Nagle holds the second until the client's delayed ACK of the first: ~40 ms a
            # request (seen by bench/client_ceiling.py's stub).  SGLang's server sends at once.
            disable_nagle_algorithm = True

            def log_message(self, fmt: str, *args: object) -> None:
                log.debug("%s " + fmt, self.address_string(), *args)

            def _send(self, code: int, payload: dict | str) -> None:
                body = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
                self.send_response(code)
                ctype = "text/plain" if isinstance(payload, str) else "application/json"
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if faults.ACTIVE and payload is faults.CUT:  # tests only: die mid-answer
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def _authorized(self) -> bool:
                if not engine.api_key:
                    return True
                return self.headers.get("Authorization") == f"Bearer {engine.api_key}"

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if not self._authorized():
                    return self._send(HTTPStatus.UNAUTHORIZED, {"error": "bad api key"})
                if self.path == "/health":
                    return self._send(200, "ok")
                if self.path == "/get_model_info":
                    return self._send(200, engine.model_info())
                if self.path == "/get_server_info":
                    return self._send(200, engine.server_info())
                self._send(404, {"error": f"no route {self.path}"})

            def do_POST(self) -> None:  # noqa: N802
                if not self._authorized():
                    return self._send(HTTPStatus.UNAUTHORIZED, {"error": "bad api key"})
                if self.path not in ("/generate", "/abort_request"):
                    return self._send(404, {"error": f"no route {self.path}"})
                try:
                    length = int(self.headers.get("Content-Length", 0))
                    body = json.loads(self.rfile.read(length) or b"{}")
                    if self.path == "/abort_request":
                        engine.scheduler.abort(str(body.get("rid") or ""))
                        return self._send(200, "")
                    code, payload = engine.generate(body)
                except Exception as exc:
                    log.exception("generate failed")
                    code, payload = 500, {"error": f"{type(exc).__name__}: {exc}"}
                self._send(code, payload)

        return Handler


class DataParallelController:
    """SGLang's data-parallel controller for the reference engine: ``n`` worker processes,
    each a :class:`ModelRunner` and :class:`Scheduler` of its own (spawned: a fork of a
    process holding torch threads is not safe), one pipe each.

    ``round_robin`` (SGLang's ``auto`` without disaggregation) hands requests out in turn;
    ``total_requests`` to the worker with the fewest unanswered ones.  Aborts go to every
    worker: the controller does not know which holds a rid (SGLang's does not either).
    """

    def __init__(self, args: argparse.Namespace, n: int, method: str = "round_robin") -> None:
        ctx = mp.get_context("spawn")
        self.n, self.method = n, method
        self.procs: list = []
        self.conns: list[Connection] = []
        for rank in range(n):
            parent, child = ctx.Pipe()
            # By its module's name, also when this runs as __main__ (python -m).
            from hsextract.engine import _worker_main as target

            proc = ctx.Process(target=target, args=(vars(args), rank, child), daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self.info: dict = {}
        for rank, conn in enumerate(self.conns):
            try:
                kind, info = conn.recv()
            except EOFError:
                raise RuntimeError(
                    f"DP worker {rank} (pid {self.procs[rank].pid}) died while loading"
                ) from None
            self.info = self.info or info
            log.info("DP worker %d up (pid %d)", rank, self.procs[rank].pid)
        self._lock = threading.Lock()
        self._send_locks = [threading.Lock() for _ in range(n)]
        self._next = 0
        self.pending: dict[str, tuple[Request, int]] = {}
        self.served = [0] * n
        self.aborts: list[dict] = []
        self._reader = threading.Thread(target=self._read, name="dp-reader", daemon=True)

    def start(self) -> None:
        self._reader.start()

    def stop(self) -> None:
        for rank in range(self.n):
            self._send(rank, ("stop",))

    def _send(self, rank: int, msg: tuple) -> bool:
        try:
            with self._send_locks[rank]:
                self.conns[rank].send(msg)
            return True
        except OSError:
            return False  # a dead worker: like SGLang's zmq PUSH, nothing is reported

    def _pick(self) -> int:
        if self.method == "total_requests":
            load = [0] * self.n
            for _, rank in self.pending.values():
                load[rank] += 1
            return load.index(min(load))
        rank, self._next = self._next, (self._next + 1) % self.n
        return rank

    def submit(self, req: Request) -> Future:
        with self._lock:
            rank = self._pick()
            self.pending[req.rid] = (req, rank)
        if not self._send(rank, ("generate", req.rid, req.input_ids, req.max_new_tokens)):
            log.warning("request %s went to DP worker %d, which is gone", req.rid, rank)
        return req.future

    def abort(self, rid: str) -> None:
        for rank in range(self.n):
            self._send(rank, ("abort", rid))

    def load(self) -> dict:
        with self._lock:
            running = [0] * self.n
            for _, rank in self.pending.values():
                running[rank] += 1
            return {
                "running": sum(running),
                "waiting": 0,
                "aborted": self.aborts[-100:],
                "dp_size": self.n,
                "dp_running": running,
                "dp_served": list(self.served),
                "dp_alive": [p.is_alive() for p in self.procs],
            }

    def _read(self) -> None:
        """Answers from every worker; a worker that died is dropped from the wait list
        and its pending requests stay unanswered (SGLang's controller does the same)."""
        live = {conn: rank for rank, conn in enumerate(self.conns)}
        while live:
            for conn in wait(list(live)):
                rank = live[conn]
                try:
                    kind, rid, payload = conn.recv()
                except (EOFError, OSError):
                    del live[conn]
                    self.procs[rank].join(timeout=1)
                    log.error(
                        "DP worker %d (pid %d) exited with code %s",
                        rank, self.procs[rank].pid, self.procs[rank].exitcode,
                    )  # fmt: skip
                    continue
                with self._lock:
                    req, _ = self.pending.pop(rid, (None, rank))
                    if kind == "done":
                        self.served[rank] += 1
                    elif kind == "aborted":
                        self.aborts.append(payload)
                if req is None or req.future.done():
                    continue
                req.dp_rank = rank
                if kind == "done":
                    req.output_ids = payload
                    req.future.set_result(req)
                elif kind == "aborted":
                    req.future.set_exception(RequestAborted(rid))
                else:
                    req.future.set_exception(RuntimeError(payload))


def _die_with_parent(rank: int) -> None:
    """Linux: SIGKILL this worker when the front dies (SGLang's
    ``kill_itself_when_parent_died``), and name it so ``hsextract.dp`` can count it."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    libc.prctl(15, f"hsref::dp{rank}".encode())  # PR_SET_NAME (comm, 15 bytes)


def _worker_main(argv: dict, rank: int, conn: Connection) -> None:
    """One DP worker: load the model, schedule what the front sends, answer on ``conn``."""
    _die_with_parent(rank)
    args = argparse.Namespace(**argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s DP{rank} %(name)s %(message)s", force=True
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    writer = get_writer()
    runner = ModelRunner(
        args.model_path, args.dtype, args.device, args.aux_layers, writer, args.batch_invariant
    )
    scheduler = Scheduler(runner, args.chunked_prefill_size, args.max_running_requests)
    scheduler.start()
    send_lock = threading.Lock()

    def reply(msg: tuple) -> None:
        try:
            with send_lock:
                conn.send(msg)
        except OSError:
            pass  # the front is gone; PDEATHSIG ends us

    def answer(future: Future) -> None:
        req = future_req[future]
        exc = future.exception()
        if exc is None:
            reply(("done", req.rid, req.output_ids))
        elif isinstance(exc, RequestAborted):
            record = next((a for a in scheduler.aborts if a["rid"] == req.rid), {"rid": req.rid})
            reply(("aborted", req.rid, record))
        else:
            reply(("error", req.rid, f"{type(exc).__name__}: {exc}"))

    future_req: dict[Future, Request] = {}
    reply(("ready", runner.describe()))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "generate":
                _, rid, ids, max_new = msg
                req = Request(rid=rid, input_ids=ids, max_new_tokens=max_new)
                future_req[req.future] = req
                scheduler.submit(req).add_done_callback(answer)
            elif msg[0] == "abort":
                scheduler.abort(msg[1])
            elif msg[0] == "stop":
                break
    finally:
        scheduler.stop()
        if writer is not None:
            writer.close()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    # Flag names mirror sglang.launch_server's, so both engines read alike in server.json.
    p = argparse.ArgumentParser(prog="python -m hsextract.engine", description=__doc__)
    p.add_argument("--model-path", required=True)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--context-length", type=int, required=True)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--max-running-requests", type=int, default=8, help="per DP worker")
    p.add_argument("--dp-size", type=int, default=1, help="data-parallel worker processes")
    p.add_argument(
        "--load-balance-method",
        default="round_robin",
        choices=["round_robin", "total_requests"],
        help="how the DP controller picks a worker (SGLang's names)",
    )
    p.add_argument("--aux-layers", type=json.loads, default=None, help="JSON list")
    p.add_argument("--api-key", default=os.environ.get("HSEXTRACT_API_KEY"))
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    p.add_argument(
        "--no-batch-invariant",
        dest="batch_invariant",
        action="store_false",
        help="one padded forward per batch (SGLang-like numerics, not bit-reproducible)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if faults.ACTIVE:  # tests only: a model load that is slow, or fails
        faults.on_load()
    if args.threads:
        torch.set_num_threads(args.threads)
    writer = None
    if args.dp_size > 1:
        # The workers load the model and write the pieces; the front holds neither.
        scheduler: Scheduler | DataParallelController = DataParallelController(
            args, args.dp_size, args.load_balance_method
        )
        info = scheduler.info
    else:
        writer = get_writer()
        runner = ModelRunner(
            args.model_path, args.dtype, args.device, args.aux_layers, writer, args.batch_invariant
        )
        scheduler = Scheduler(runner, args.chunked_prefill_size, args.max_running_requests)
        info = runner.describe()
    scheduler.start()
    engine = EngineServer(
        info,
        scheduler,
        context_length=args.context_length,
        model_path=args.model_path,
        api_key=args.api_key,
    )
    httpd = _HttpServer((args.host, args.port), engine.handler())
    log.info(
        "reference engine up on %s:%d (capture %s, aux layers %s, %d DP worker(s))",
        args.host,
        args.port,
        "on" if info["capture"] else "off",
        info["aux_layers"],
        args.dp_size,
    )
    try:
        httpd.serve_forever()
    finally:
        scheduler.stop()
        if writer is not None:
            writer.close()


if __name__ == "__main__":
    main()
