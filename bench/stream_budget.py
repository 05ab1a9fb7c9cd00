"""Train while extracting on the H200 (issue 39): one pass of an 8B-shape target with the
disk budget at <= 5 % of the run's bytes and a consumer that keeps up, against the same
run without a budget, in one invocation:

    HSEXTRACT_TIMEOUT=585 HSEXTRACT_RUN="python3 bench/stream_budget.py" bash h200/run.sh

and on this CPU (tiny model, reference engine; what tests/test_stream_budget_bench.py runs):

    python bench/stream_budget.py --quick --engine reference --out /tmp/sb-out

Records, model and workflow config are bench/race.py's (imported, not copied): seeded
token-id records of a ShareGPT-like length mix, the Qwen3-8B shape with SGLang's dummy
weights, ``configs/qwen3-8b-1xh200.yaml`` with the payload's flags.  Then, on the GPU one
after the other (``snakemake -jN extract_all`` each, its own output root):

* ``warm-up`` (SGLang only; ``--no-warmup`` skips it): 8 records, the 4 shortest and the 4
  longest, through the same workflow, so the triton kernels are compiled before either
  measured run (a fresh machine compiles them on the first requests, ~75 s, which would
  land inside whichever run came first);
* ``none``: no budget: the producer alone.  A 5-minute 8B pass writes >100 GB on a 64 GiB
  disk, so finished chunks' states are freed on disk once their sidecar exists (race.py's
  reclaim: the blocks of the largest tensor punched out, size and header kept), all but
  the latest ones whose bytes on disk fit ``--consumer-alone-gb`` (12 GB: ~1/3 of the 8B
  run's 34 GB of lossless chunks, ~35 GB of raw states; with the chunks in flight, well
  inside the GPU host's 64 GiB disk), kept whole for the next step; the disk figure of
  this run is the bytes it wrote (what it would hold without the bench), and what it
  held includes the kept chunks;
* ``consumer alone`` (no GPU): those kept chunks read with no producer running, by the
  very consumer of the budget run (``_consume``, below: the same ``StreamDataset`` in the
  same ``DataLoader``, ``--consumer-workers`` workers, each chunk's sha256 checked before
  its first record).  The reader follows a journal, which a run without a budget has
  not: the bench hard-links the kept chunk files into a run dir of its own and announces
  each there with the stream's own ``hsextract.stream.journal.announce``, from the
  chunk's sidecar (the sha256 the writer took after its fsync, its records and tokens),
  all before the consumer starts: nothing it reads waits for a producer.  What is
  measured: the records and raw-state bytes it got from its first sample to its last
  (the first chunk's hash comes before, as in the stream consumer's figure), stopped at
  ``--consumer-alone-s`` (30) after it starts iterating (worker start included in that
  bound, not in the rate), so its time is bounded whatever the reader's speed; it is
  budgeted inside ``--budget-s``.  Then the kept chunks and the links are removed;
* ``budget``: ``stream.budget_gb`` at ``--budget-frac`` (0.05) of the run's estimated
  bytes (its tokens x the raw bytes per token the gate estimates with), and a consumer
  process (``_consume`` below) that reads every record through
  ``hsextract.stream.reader.StreamDataset`` in a torch ``DataLoader`` with
  ``--consumer-workers`` workers (each chunk's sha256 checked before its first record)
  and acks each chunk as soon as all its records are read.

Both runs get the bench's preflight shim (``bench/reclaim_shim``: the output disk looks 8x
larger to ``preflight_budget``, which sizes the whole run and does not know the stream
budget), so they run the same code; every run has the audit stage off (``unaudited``
below: it comes after what is measured and cannot pass on punched chunks or dummy
weights).  The two runs cannot share one SGLang server: a server belongs to one run dir
(``state/server.<host>.live.json``) and the workflow's onsuccess/onerror stop it, and the
two runs need two run dirs (one would find the other's chunks done); so each pays its own
start, outside the measured phase.

The chunk count: the gate refuses a budget below ``max(window, (window - 1) / low_mark)``
x the largest chunk's raw estimate, window = prefetch_chunks + checkpoint_chunks + 1 =
2 + 1 + 1 = 4 for this consumer (its loader workers take the records one at a time in
turn, but it acks a chunk only once Snakemake saw its job finish, below, so it reads the
next chunk meanwhile: 2 chunks open; it acks at once otherwise: checkpoint_chunks 1, the
least the setting takes).  At 5 % that needs the
largest chunk at <= 1.25 % of the run's tokens: the bench predicts the workflow's split
(``hash(id) % n_chunks``, hsextract.records.id_hash) and takes the least ``n_chunks`` whose
largest chunk passes the gate's own check (hsextract.stream.gate.check_window).

Acks as soon as read: under a budget a chunk job's output is its sidecar (the stream's
receipts, stream/receipts.py), so the payload a gate deletes is no output Snakemake still
checks, and the budget run's manifest lists deleted, acked chunks from their receipts.

Figures: the sending phase's tokens/s of each run (race.py's definition, from the chunks'
sidecars: the first request sent to the last response), their ratio (goal >= 0.95).  Three
rates in GB/s of raw states (tokens x the raw bytes per token, what a reader gets
decoded): the producer alone (the ``none`` run's sending rate), the consumer alone
(aggregate and per worker, and records/s), and the stream (the ``budget`` run's sending
rate); the stream against the smaller of the other two, goal >= 0.95.  A stream goes no
faster than its slower side, so this asks what coupling the two costs: a budget/none ratio
below 0.95 with this goal met says the reader, not the stream, holds the run back.  Disk
in use sampled every ``--period`` s in a thread (bytes of chunk payloads under the run's
hidden/, temp files included, allocated and logical; unacked bytes from the stream's
journal and acks; /dev/shm in use; whether the gate is shut), its peak against budget +
the largest chunk; the consumer's records/s, whether it read every record exactly once,
and whether it kept up (time the gate was shut, the chunk jobs' waits, read-to-ack lag).
``$OUT`` (or ``--out``) gets ``stream_budget.json``, ``disk.csv``, ``disk.png`` and
``stream_budget-logs.tar.xz``.  Last line:
``stream budget: ratio X.XXX peak_GB Y budget_GB Z largest_chunk_GB W producer_GBps P
consumer_GBps C stream_GBps S stream/smaller R.RRR (goal 0.95: met|unmet)`` (one line).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
import race  # noqa: E402 - bench/race.py; it puts the repo's src/ on sys.path

GB = 1e9
#: The budget run's trainer settings (stream.*): acks at once (module docstring).
STREAM = {
    "prefetch_chunks": 2,
    "checkpoint_chunks": 1,
    "low_mark": 0.75,
    # A waiting chunk job looks at the ack file at least this often: the GPU idles
    # no longer than this after the ack that makes room.
    "poll_s": 0.2,
}
MARKER = ".stream_budget_bench"  # the work dir is ours: only then is anything removed in it
#: --quick: the demo's tiny DeepSeek-V3 (config.yaml's demo section), float32, CPU.
QUICK_DEMO = {"seed": 0, "num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 512}
QUICK_MAX_LEN = 96
#: The consumer-alone pass's run dir (under the work dir) and its files' name.
ALONE = "consumer-alone"
#: Beyond --consumer-alone-s, what the plan sets aside for the pass's start: torch's
#: import and the loader workers' (its rate is from the first sample), the links and
#: announcements; and the most it waits beyond before stopping a hung reader.
ALONE_START_S = 10.0
ALONE_OVERHEAD_S = 30.0
WAITED_RE = re.compile(r"stream budget:.*\(waited ([\d.]+) s\)")


# --- setup ---------------------------------------------------------------------------------


def own_work_dir(work: Path) -> None:
    """``race.own_work_dir``, then an earlier call's runs removed."""
    race.own_work_dir(work, MARKER, "bench/stream_budget.py")
    for old in [*work.glob("results-sb-*"), work / ALONE]:  # an earlier call's: they look done
        shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(work / "logs", ignore_errors=True)
    (work / "logs").mkdir()


def quick_config(work: Path, data: Path, n_chunks: int, tag: str) -> Path:
    """The embedded default (config.yaml) on the bench's records and the demo's tiny model,
    reference engine on the CPU, its own output root and dump dir per run."""
    import yaml

    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(
        inputs=[str(data)],
        output_root=str(work / f"results-{tag}"),
        n_chunks=n_chunks,
        max_seq_len=QUICK_MAX_LEN,
    )
    cfg["demo"]["enabled"] = False
    cfg["model"].update(path=str(work / "model"), revision="stream-budget-quick")
    cfg["server"]["health_timeout_s"] = 120
    cfg["dump"]["dir"] = str(work / tag / "shm")
    (work / tag).mkdir(parents=True, exist_ok=True)
    path = work / tag / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def unaudited(cfg_path: Path) -> Path:
    """No audit stage (``audit.records`` 0): it comes after what is measured, it recomputes
    records with HF's forward of model.path, which the 8B shape's dummy weights do not hold
    on disk, and it checks the chunks' sha256, which the reclaim's punched chunks fail."""
    import yaml

    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["audit"] = {**(cfg.get("audit") or {}), "records": 0}
    cfg_path.write_text(yaml.safe_dump(cfg))
    return cfg_path


def with_budget(cfg_path: Path, budget_bytes: int) -> None:
    import yaml

    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["stream"] = {"budget_gb": budget_bytes / GB, **STREAM}
    cfg_path.write_text(yaml.safe_dump(cfg))


def raw_bytes_per_token(cfg_path: Path) -> int:
    """What the gate estimates a chunk with before one is seen: the uncompressed states."""
    from hsextract.budget import bytes_per_token
    from hsextract.client import model_geometry
    from hsextract.config import read_config

    geo = model_geometry(read_config(cfg_path))
    dtype = str(geo.dtype).removeprefix("torch.")
    return bytes_per_token(geo.hidden_size, len(geo.aux_layers), dtype)


def predicted_chunks(lens: list[int], hashes: list[int], n: int) -> list[int]:
    """Each chunk's tokens as split_chunks will make them: a record goes to chunk
    ``id_hash(id) % n``."""
    out = [0] * n
    for h, t in zip(hashes, lens, strict=True):
        out[h % n] += t
    return out


def choose_chunks(lens: list[int], bpt: int, frac: float, forced: int | None) -> dict:
    """The least n_chunks whose largest chunk the gate accepts under ``frac`` of the run's
    estimated bytes (its own check, hsextract.stream.gate.check_window)."""
    from hsextract.records import id_hash
    from hsextract.stream.gate import BudgetRefused, StreamSettings, check_window

    hashes = [id_hash(f"r{i:06d}") for i in range(len(lens))]  # race.write_records' ids
    total = sum(lens)
    budget = int(frac * total * bpt)
    ss = StreamSettings(budget_gb=budget / GB, **STREAM)
    candidates = [forced] if forced else range(1, len(lens) + 1)
    for n in candidates:
        tokens = predicted_chunks(lens, hashes, n)
        try:
            check_window(ss, max(tokens) * bpt, total * bpt)
        except BudgetRefused as exc:
            if forced:
                raise SystemExit(f"--chunks {forced}: {exc}") from None
            continue
        return {
            "n_chunks": n,
            "budget_bytes": budget,
            "largest_tokens": max(tokens),
            "mean_tokens": round(total / n),
            "min_tokens": min(tokens),
            "window_chunks": ss.window_chunks(),
        }
    raise SystemExit(
        f"no chunk count fits a budget of {frac:g} of the run's {total * bpt / GB:.3g} GB: even "
        "one record per chunk is refused by the gate; raise --budget-frac or --tokens"
    )


def reclaimer(results: Path, stop: threading.Event, ledger: dict, keep_bytes: int) -> None:
    """race.py's reclaimer, but the latest finished chunks whose bytes on disk fit
    ``keep_bytes`` stay whole: each chunk is held back when it finishes, and the oldest
    held is punched once the held bytes pass ``keep_bytes``.  Why the latest: the disk
    holds at most ``keep_bytes`` more at any time, whichever are kept, and the consumer
    alone reads what was just written, as the stream's consumer does."""
    seen: set[Path] = set()
    held: list[tuple[Path, int]] = []  # oldest first
    while True:
        last = stop.is_set()
        for sc in sorted(results.glob("*/hidden/chunk_*.json")):
            if sc in seen:
                continue
            p = sc.with_suffix(".safetensors")
            try:
                json.loads(sc.read_text())
                race._safetensors_extents(p)
                disk = p.stat().st_blocks * 512
            except (OSError, ValueError):
                continue  # being written
            seen.add(sc)
            ledger["disk_bytes"] = ledger.get("disk_bytes", 0) + disk
            held.append((p, disk))
            while held and sum(d for _, d in held) > keep_bytes:
                old, _ = held.pop(0)
                ledger["freed_bytes"] = ledger.get("freed_bytes", 0) + race._punch_largest_tensor(
                    old
                )
                ledger["punched"] = ledger.get("punched", 0) + 1
        ledger["kept"] = [p.stem for p, _ in held]
        ledger["kept_bytes"] = sum(d for _, d in held)
        if last:
            return
        stop.wait(0.5)


# --- sampling disk in use ------------------------------------------------------------------


def jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSON-lines file (the stream's journal and acks, DESIGN.md:
    a torn last line is not a line yet)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for raw in data.split(b"\n")[:-1]:
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    return out


class DiskSampler:
    """Every ``period`` s: chunk payload bytes under hidden/ (temp files too; allocated and
    logical size), unacked bytes (announced chunks no ack line covers, their size on disk),
    /dev/shm in use over the start, and whether the gate is shut."""

    FIELDS = [
        "run",
        "t",
        "alloc_bytes",
        "logical_bytes",
        "unacked_bytes",
        "announced",
        "acked",
        "gate_paused",
        "shm_bytes",
    ]

    def __init__(self, run: str, run_dir: Path, period: float) -> None:
        self.run, self.rd, self.period = run, run_dir, period
        self.rows: list[dict] = []
        self.base_shm = self._shm()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def _shm() -> int:
        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def sample(self) -> dict:
        alloc = logical = 0
        for p in (self.rd / "hidden").glob("*chunk_*.safetensors*"):
            try:
                s = p.stat()
            except FileNotFoundError:
                continue  # deleted (acked) or renamed while measured
            alloc += s.st_blocks * 512
            logical += s.st_size
        sdir = self.rd / "stream"
        chunks = {
            int(c["seq"]): c for c in jsonl(sdir / "journal.jsonl") if c.get("type") == "chunk"
        }
        acked = {
            int(s) for a in jsonl(sdir / "acks.jsonl") if a.get("type") == "ack" for s in a["seqs"]
        }
        unacked = 0
        for seq, c in chunks.items():
            if seq not in acked:
                try:
                    unacked += (self.rd / c["path"]).stat().st_size
                except FileNotFoundError:
                    pass
        try:
            paused = bool(json.loads((sdir / "gate.json").read_text()).get("paused"))
        except (OSError, ValueError):
            paused = False
        return {
            "run": self.run,
            "t": round(time.time(), 3),
            "alloc_bytes": alloc,
            "logical_bytes": logical,
            "unacked_bytes": unacked,
            "announced": len(chunks),
            "acked": len(acked & set(chunks)),
            "gate_paused": int(paused),
            "shm_bytes": max(0, self._shm() - self.base_shm),
        }

    def _loop(self) -> None:
        while True:
            self.rows.append(self.sample())
            if self._stop.wait(self.period):
                self.rows.append(self.sample())
                return

    def __enter__(self) -> DiskSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    def figures(self, since: float | None) -> dict:
        rows = [r for r in self.rows if since is None or r["t"] >= since - self.period]
        rows = rows or self.rows
        shut = sum(self.period for r in rows if r["gate_paused"])
        # Before anything is announced the gate estimates chunks at their raw size, so it
        # shuts at the start whatever the consumer does; after the first ack it shuts only
        # while the consumer is behind.
        behind = sum(self.period for r in rows if r["gate_paused"] and r["acked"])
        return {
            "peak_disk_bytes": max(r["alloc_bytes"] for r in rows),
            "peak_logical_bytes": max(r["logical_bytes"] for r in rows),
            "peak_unacked_bytes": max(r["unacked_bytes"] for r in rows),
            "peak_shm_bytes": max(r["shm_bytes"] for r in rows),
            "gate_shut_s": round(shut, 1),
            "gate_shut_after_first_ack_s": round(behind, 1),
            "samples": len(rows),
        }


# --- the consumer --------------------------------------------------------------------------


def consume(args: argparse.Namespace) -> None:
    """Inside the consumer process: every record of the run through StreamDataset, each
    chunk acked as soon as all its records are read; the consumer alone's too, where
    ``--stop-after-s`` bounds its time (the samples after it are not counted).

    A plain torch DataLoader, not torchdata's StatefulDataLoader: this consumer acks
    what it has read, not what a checkpoint covers (``consumed_seqs`` is for that), so it
    needs no loader state -- a chunk is read when its records are all in, counted here.
    """
    import torch
    from torch.utils.data import DataLoader

    from hsextract.stream.journal import AckWriter
    from hsextract.stream.reader import StreamDataset

    run_dir = Path(args.run_dir)
    sdir = run_dir / "stream"
    ds = StreamDataset(run_dir, rank=0, world=1, seed=0, layout="raw", poll_s=0.05)
    # Workers split a chunk's records (decoding in parallel; one sha256 per chunk, shared);
    # torch's default prefetch (2 samples a worker): an 8k-token record is ~270 MB raw.
    dl = DataLoader(ds, batch_size=None, num_workers=args.workers)
    acker = AckWriter(run_dir)
    read_at: dict[int, float] = {}  # seq -> when its last record came in
    acked_at: dict[int, float] = {}
    ids: list[str] = []
    counts: Counter = Counter()
    records_of: dict[int, int] = {}
    tokens = raw_bytes = 0
    first = last_t = None
    stop_at = time.time() + args.stop_after_s if args.stop_after_s else None
    stopped = False
    for sample in dl:
        now = time.time()
        if stop_at is not None and now >= stop_at:
            stopped = True  # the consumer alone: its time is bounded, not its chunks
            break
        first = first or now
        last_t = now
        seq = int(sample["seq"])
        ids.append(sample["id"])
        tokens += int(sample["input_ids"].numel())
        raw_bytes += sum(
            v.numel() * v.element_size() for v in sample.values() if isinstance(v, torch.Tensor)
        )
        counts[seq] += 1
        if seq not in records_of:
            for c in jsonl(sdir / "journal.jsonl"):
                if c.get("type") == "chunk":
                    records_of[int(c["seq"])] = int(c["records"])
        if counts[seq] == records_of[seq]:
            read_at[seq] = now
            acker.ack([seq], step=len(acked_at))
            acked_at[seq] = time.time()
    span = (last_t - first) if first and last_t and last_t > first else None
    Path(args.out).write_text(
        json.dumps(
            {
                "records": len(ids),
                "ids": ids,
                "tokens": tokens,
                "raw_bytes": raw_bytes,
                "first_at": first,
                "last_at": last_t,
                "workers": args.workers,
                "stopped_at_limit": stopped,
                "records_per_s": round(len(ids) / span, 1) if span else None,
                "tokens_per_s": round(tokens / span) if span else None,
                "raw_gb_per_s": round(raw_bytes / span / GB, 3) if span else None,
                "read_at": read_at,
                "acked_at": acked_at,
            }
        )
    )


def start_consumer(
    run_dir: Path, work: Path, workers: int, name: str = "consumer", stop_after_s: float = 0
):
    out = work / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "_consume",
        "--run-dir",
        str(run_dir),
        "--workers",
        str(workers),
        "--out",
        str(out),
        "--stop-after-s",
        str(stop_after_s),
    ]
    log = open(work / "logs" / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out, log


# --- one workflow run ----------------------------------------------------------------------


def sidecars_of(run_dir: Path) -> list[dict]:
    """Every finished chunk's sidecar: they stay when the stream deletes a payload."""
    out = []
    for p in sorted((run_dir / "hidden").glob("chunk_*.json")):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # Snakemake's onerror stops the server
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_workflow(
    work: Path,
    tag: str,
    cfg_path: Path,
    *,
    jobs: int,
    timeout_s: float,
    reclaim: bool,
    env: dict,
    period: float,
    consumer: dict | None = None,
    keep_bytes: int = 0,
) -> dict:
    """``snakemake -jN extract_all`` on ``cfg_path``: disk sampled, the consumer alongside
    (budget run), the sending phase from the sidecars."""

    from hsextract.config import read_config, run_dir

    rd = run_dir(read_config(cfg_path))
    smk_log = work / "logs" / f"snakemake-{tag}.log"
    cons = None
    if consumer is not None:
        cons = start_consumer(rd, work, consumer["workers"])
    out: dict = {"run_dir": str(rd), "config": str(cfg_path)}
    t_start = time.time()
    with DiskSampler(tag, rd, period) as disk, race.Sampler() as smp:
        with open(smk_log, "w") as log:
            proc = subprocess.Popen(
                race._snakemake_cmd(cfg_path, jobs),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
            ledger: dict = {}
            stop_reclaim = threading.Event()
            reclaim_t = threading.Thread(
                target=reclaimer,
                args=(race.results_dir(cfg_path), stop_reclaim, ledger, keep_bytes),
            )
            if reclaim:
                reclaim_t.start()
            try:
                out["rc"] = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                stop_group(proc)
                out["rc"] = f"timed out after {timeout_s:.0f} s"
            except BaseException:  # SIGTERM (the harness's limit), Ctrl-C: stop what we started
                stop_group(proc, 10)
                if cons is not None:
                    stop_group(cons[0], 5)
                raise
            out["snakemake_s"] = round(time.time() - t_start, 1)
            stop_reclaim.set()
            if reclaim:
                reclaim_t.join()
                out["reclaim"] = ledger
        if cons is not None:
            proc_c, path_c, log_c = cons
            # It ends at the pass's end; a run that never announced it never ends it.
            ended = any(x.get("type") == "end_pass" for x in jsonl(rd / "stream" / "journal.jsonl"))
            try:
                out["consumer_rc"] = proc_c.wait(timeout=60 if ended else 5)
            except subprocess.TimeoutExpired:
                stop_group(proc_c, 5)
                out["consumer_rc"] = "stopped: it had not read the whole pass"
            log_c.close()
            out["consumer"] = json.loads(path_c.read_text()) if path_c.exists() else None
    out.update(smp.report())
    side = sidecars_of(rd)
    out["chunks"] = len(side)
    out["records"] = sum(s["records"] for s in side)
    out["tokens"] = sum(s["tokens"] for s in side)
    index = rd / "chunks" / "index.json"
    if index.exists():
        planned = json.loads(index.read_text())["chunks"]
        out["planned_chunks"] = len(planned)
        out["largest_chunk_tokens"] = max(int(c["tokens"]) for c in planned)
    if side:
        out["stored_bytes"] = sum(s["states_stored_bytes"] for s in side)
        out["largest_chunk_bytes"] = (
            max(s["bytes"] for s in side if "bytes" in s)
            if any("bytes" in s for s in side)
            else None
        )
        out.update(race.sending_figures(side, jobs_n=jobs, n_turns=race.turns_used(side)))
    out.update(disk.figures(out.get("first_sent_at")))
    out["disk_rows"] = disk.rows
    waits = [
        float(m)
        for p in (rd / "logs").glob("extract_chunk_*.log")
        for m in WAITED_RE.findall(p.read_text(errors="replace"))
    ]
    if waits:
        out["gate_waits"] = {
            "chunks": len(waits),
            "waited": sum(1 for w in waits if w > 0.05),
            "total_s": round(sum(waits), 1),
            "max_s": round(max(waits), 1),
        }
    if out["rc"] != 0:
        out["log_tail"] = smk_log.read_text(errors="replace")[-2500:]
    return out


def check_consumer(r: dict, run_dir: Path) -> dict:
    """Every record of the run read exactly once; each chunk acked, and how soon."""
    c = r.get("consumer")
    if not c:
        return {"every_record_once": False, "why": "the consumer wrote no figures"}
    want: Counter = Counter()
    for line in (run_dir / "merged" / "train.jsonl").open("rb"):
        want[json.loads(line)["id"]] += 1
    got = Counter(c["ids"])
    journal = {
        int(x["seq"]): x
        for x in jsonl(run_dir / "stream" / "journal.jsonl")
        if x.get("type") == "chunk"
    }
    lag = [
        float(c["acked_at"][str(s)]) - float(x["at"])
        for s, x in journal.items()
        if str(s) in c["acked_at"]
    ]
    read_lag = [
        float(c["read_at"][str(s)]) - float(x["at"])
        for s, x in journal.items()
        if str(s) in c["read_at"]
    ]
    return {
        "every_record_once": got == want,
        "records_expected": sum(want.values()),
        "records_read": sum(got.values()),
        "read_twice": sum(1 for v in got.values() if v > 1),
        "missing": sum(1 for k in want if k not in got),
        "unexpected": sum(1 for k in got if k not in want),
        "chunks_announced": len(journal),
        "chunks_acked": sum(1 for s in journal if str(s) in c["acked_at"]),
        "announce_to_read_s": {
            "median": round(statistics.median(read_lag), 2),
            "max": round(max(read_lag), 2),
        }
        if read_lag
        else None,
        "announce_to_ack_s": {"median": round(statistics.median(lag), 2), "max": round(max(lag), 2)}
        if lag
        else None,
        "records_per_s": c["records_per_s"],
        "tokens_per_s": c["tokens_per_s"],
        # Not the consumer's own rounded figure: the CPU run's ~1e-4 GB/s rounds to 0.
        "raw_gb_per_s": sig(c["raw_bytes"] / (c["last_at"] - c["first_at"]) / GB)
        if c.get("first_at") and c.get("last_at") and c["last_at"] > c["first_at"]
        else None,
        "workers": c["workers"],
    }


def consumer_alone(work: Path, none: dict, *, workers: int, limit_s: float) -> dict:
    """The budget run's consumer (``_consume``) over the chunks the ``none`` run kept whole,
    with no producer: announced up front in a run dir of the bench's own (module
    docstring), read for at most ``limit_s``; then whether it read every record it was
    given exactly once, each chunk's bytes checked against its sidecar's sha256."""
    from hsextract.stream.journal import announce

    rd = Path(none["run_dir"])
    side = {s["chunk"]: s for s in sidecars_of(rd)}
    given = [side[c] for c in (none.get("reclaim") or {}).get("kept", []) if c in side]
    if not given:
        return {"why": "the run without a budget kept no chunk whole (--consumer-alone-gb)"}
    replay = work / ALONE
    shutil.rmtree(replay, ignore_errors=True)
    (replay / "hidden").mkdir(parents=True)
    want: Counter = Counter()
    try:
        for s in given:
            # A hard link: the very file the run wrote (same inode, same page cache), no copy.
            os.link(rd / "hidden" / s["path"], replay / "hidden" / s["path"])
            for line in (rd / "chunks" / f"{s['chunk']}.jsonl").open("rb"):
                want[json.loads(line)["id"]] += 1
        for s in given:
            # shapes=None: they shape the end-of-pass padding of a rank short of the others,
            # and one rank has none.
            announce(
                replay,
                chunk=s["chunk"],
                path=f"hidden/{s['path']}",
                sha256=s["sha256"],
                records=int(s["records"]),
                tokens=int(s["tokens"]),
                content_digest=str(s.get("content_digest", "")),
                n_chunks=len(given),
            )
        proc, path, log = start_consumer(replay, work, workers, ALONE, stop_after_s=limit_s)
        try:
            # Its own bound is limit_s from its first look; torch's import and the workers'
            # start come before, a hung reader after: both bounded here.
            rc: int | str = proc.wait(timeout=limit_s + ALONE_OVERHEAD_S)
        except subprocess.TimeoutExpired:
            stop_group(proc, 5)
            rc = "stopped: it outran its time bound"
        except BaseException:  # SIGTERM (the harness's limit), Ctrl-C: stop what we started
            stop_group(proc, 5)
            raise
        finally:
            log.close()
    finally:
        shutil.rmtree(replay / "hidden", ignore_errors=True)
    c = json.loads(path.read_text()) if path.exists() else None
    if not c:
        return {"rc": rc, "why": "the consumer alone wrote no figures", "chunks_given": len(given)}
    got = Counter(c["ids"])
    sdir = replay / "stream"
    journal = {int(x["seq"]): x for x in jsonl(sdir / "journal.jsonl") if x.get("type") == "chunk"}
    acks = jsonl(sdir / "acks.jsonl")
    acked = {int(q) for a in acks if a.get("type") == "ack" for q in a["seqs"]}
    # A chunk whose bytes missed the announced sha256 is nacked, never read: no nack and
    # every record read means every chunk read hashed to the sha256 its writer took.
    nacks = sum(1 for a in acks if a.get("type") == "nack")
    span = (c["last_at"] - c["first_at"]) if c.get("first_at") and c.get("last_at") else 0
    gbs = c["raw_bytes"] / span / GB if span > 0 else None
    return {
        "rc": rc,
        "chunks_given": len(given),
        "records_given": sum(want.values()),
        "stored_bytes_given": sum(int(s["bytes"]) for s in given),
        "raw_bytes_given": sum(int(s["states_raw_bytes"]) for s in given),
        "stopped_at_limit": bool(c.get("stopped_at_limit")),
        "records_read": sum(got.values()),
        "tokens_read": c["tokens"],
        "raw_bytes_read": c["raw_bytes"],
        "every_record_once": got == want,
        "none_twice_none_foreign": all(v == 1 for v in got.values()) and got.keys() <= want.keys(),
        "chunks_read": len(acked & set(journal)),
        "sha256_as_sidecar": all(
            journal[q]["sha256"] == side[journal[q]["chunk"]]["sha256"]
            for q in acked & set(journal)
        ),
        "nacks": nacks,
        "span_s": round(span, 3),
        "workers": c["workers"],
        "records_per_s": round(len(c["ids"]) / span, 2) if span > 0 else None,
        "tokens_per_s": round(c["tokens"] / span, 1) if span > 0 else None,
        "raw_gb_per_s": sig(gbs),
        "raw_gb_per_s_per_worker": sig(gbs / c["workers"]) if gbs else None,
    }


def sig(x: float | None, n: int = 4) -> float | None:
    """``n`` significant digits: the CPU run's rates are ~1e-4 GB/s, where round(x, 3) is 0."""
    return None if x is None else float(f"{x:.{n}g}")


# --- output --------------------------------------------------------------------------------


def write_csv(path: Path, runs: dict) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*DiskSampler.FIELDS, "t_rel_s"])
        w.writeheader()
        for r in runs.values():
            t0 = r.get("first_sent_at") or (r["disk_rows"][0]["t"] if r["disk_rows"] else 0)
            for row in r["disk_rows"]:
                w.writerow({**row, "t_rel_s": round(row["t"] - t0, 2)})


def write_png(path: Path, runs: dict, budget: int, largest: int | None, title: str) -> None:
    """Top: what each run holds on disk over its sending phase.  Bottom: the budget run
    alone, with what the trainer has not acknowledged and when the gate was shut."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(run: str, key: str) -> tuple[list[float], list[float]]:
        r = runs.get(run) or {}
        rows = r.get("disk_rows") or []
        t0 = r.get("first_sent_at") or (rows[0]["t"] if rows else 0)
        return [row["t"] - t0 for row in rows], [row[key] / GB for row in rows]

    fig, (top, low) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    top.plot(
        *series("none", "logical_bytes"),
        "--",
        color="tab:gray",
        label="no budget: chunk bytes written",
    )
    top.plot(
        *series("budget", "alloc_bytes"), color="tab:blue", label="budget: chunk bytes on disk"
    )
    low.plot(*series("budget", "alloc_bytes"), color="tab:blue", label="chunk bytes on disk")
    low.plot(
        *series("budget", "unacked_bytes"),
        color="tab:orange",
        label="not yet acknowledged by the consumer",
    )
    xs, shut = series("budget", "gate_paused")
    for x, s in zip(xs, shut, strict=True):
        if s:
            low.axvspan(x - 0.25, x + 0.25, color="tab:red", alpha=0.15, lw=0)
    for ax in (top, low):
        ax.axhline(budget / GB, color="tab:green", lw=1, label="stream.budget_gb")
        ax.set_ylabel("GB")
    if largest:
        low.axhline(
            (budget + largest) / GB, color="tab:green", lw=1, ls=":", label="budget + largest chunk"
        )
    low.set_xlabel("seconds since the run's first request (red: the gate shut)")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8, loc="upper left")
    low.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gb(x: float | None) -> str:
    return "-" if x is None else f"{x / GB:.3g}"


# --- main ----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--engine",
        choices=["sglang", "reference"],
        default=None,
        help="sglang (the device; default) or reference (--quick, CPU)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the demo's tiny model on the reference engine, a few records (CPU)",
    )
    ap.add_argument("--model", choices=sorted(race.MODELS), default="qwen3-8b")
    ap.add_argument("--aux-layers", default=None, help="as race.py (default: EAGLE-3's three)")
    ap.add_argument("--lengths", choices=["sharegpt", "bimodal"], default="sharegpt")
    ap.add_argument("--tokens", default=None, help="records up to this many tokens (3M; quick 4k)")
    ap.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="n_chunks (default: the least the gate accepts at --budget-frac)",
    )
    ap.add_argument(
        "--budget-frac",
        type=float,
        default=None,
        help="stream.budget_gb as a fraction of the run's estimated bytes (0.05; quick 0.75)",
    )
    ap.add_argument("--jobs", type=int, default=None, help="snakemake -j (12; quick 2)")
    ap.add_argument("--consumer-workers", type=int, default=3, help="its DataLoader workers")
    ap.add_argument(
        "--consumer-alone-gb",
        type=float,
        default=12.0,
        help="the latest chunks of the run without a budget kept whole up to this many GB on "
        "disk, for the consumer alone (12: safe on the GPU host's 64 GiB disk)",
    )
    ap.add_argument(
        "--consumer-alone-s",
        type=float,
        default=30.0,
        help="the consumer alone reads for at most this long (inside --budget-s)",
    )
    ap.add_argument("--period", type=float, default=0.5, help="disk sampling period (s)")
    ap.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the warm-up run (a kernel cache for these shapes is carried)",
    )
    ap.add_argument("--budget-s", type=float, default=540, help="the whole run's time limit")
    ap.add_argument("--work", default="/tmp/hsextract-stream-budget")
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT"),
        help="where the figures go (default $OUT, which h200/run.sh returns)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="records, configs and the plan only")
    args = ap.parse_args()
    engine = args.engine or ("reference" if args.quick else "sglang")
    if (engine == "reference") != args.quick:
        ap.error(
            "--quick runs the reference engine and --engine reference needs --quick: the "
            "8B shape is served by SGLang only"
        )
    frac = args.budget_frac if args.budget_frac is not None else (0.75 if args.quick else 0.05)
    jobs = args.jobs or (2 if args.quick else 12)
    t_begin = time.monotonic()
    deadline = t_begin + args.budget_s
    # h200/run.sh's `timeout` sends SIGTERM: the figures so far are still written (finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(args.work).resolve()
    own_work_dir(work)
    out_dir = Path(args.out or work / "out").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    data = work / "data.jsonl"
    env = dict(os.environ)
    if args.quick:
        from hsextract.demo import build_demo_model

        if not (work / "model" / "config.json").exists():
            build_demo_model(work / "model", QUICK_DEMO)
        tokens = race.parse_tokens(args.tokens or "4k")
        lens = [min(x, QUICK_MAX_LEN) for x in race.lengths(4096, args.seed)]
        lens = lens[: next(k for k in range(1, len(lens) + 1) if sum(lens[:k]) >= tokens)]
        vocab = QUICK_DEMO["vocab_size"]

        def make_config(n: int, tag: str, path: Path = data) -> Path:
            return unaudited(quick_config(work, path, n, tag))

        aux = None
    else:
        shape = race.MODELS[args.model]
        (work / "model").mkdir(exist_ok=True)
        (work / "model" / "config.json").write_text(json.dumps(shape, indent=1))
        aux = race.aux_layer_list(args.aux_layers, shape["num_hidden_layers"])
        lens = race.lengths_for_tokens(
            race.parse_tokens(args.tokens or "3M"), args.seed, args.lengths
        )
        vocab = shape["vocab_size"]

        def make_config(n: int, tag: str, path: Path = data) -> Path:
            return race.hsx_config(work, path, n, tag, aux)  # the audit off, as race's

        # The preflight sizes the whole run's raw states against the disk and knows nothing
        # of the stream budget (nor of the reclaim): both runs see an 8x larger disk.
        shim = str(BENCH / "reclaim_shim")
        env.update(
            HSEXTRACT_BENCH_FREE_FACTOR="8",
            PYTHONPATH=os.pathsep.join(filter(None, [shim, env.get("PYTHONPATH")])),
        )
    race.write_records(data, lens, args.seed, vocab)
    total = sum(lens)
    probe = make_config(1, "sb-none")
    bpt = raw_bytes_per_token(probe)
    plan = choose_chunks(lens, bpt, frac, args.chunks)
    n = plan["n_chunks"]
    budget = plan["budget_bytes"]
    configs = {"none": make_config(n, "sb-none"), "budget": make_config(n, "sb-budget")}
    with_budget(configs["budget"], budget)
    print(
        f"{'quick: demo model, reference engine' if args.quick else args.model}, aux "
        f"{aux or 'default'}: {len(lens)} records, {total:,} tokens (mean "
        f"{statistics.mean(lens):.0f}, max {max(lens)}); raw {bpt:,} B/token, the run "
        f"~{total * bpt / GB:.3g} GB raw",
        flush=True,
    )
    print(
        f"n_chunks {n}: ~{plan['mean_tokens']:,} tokens each, largest {plan['largest_tokens']:,} "
        f"({plan['largest_tokens'] * bpt / GB:.3g} GB raw); stream.budget_gb "
        f"{budget / GB:.4g} = {frac:g} of the run's raw bytes (the gate's window: "
        f"{plan['window_chunks']} chunks, low mark {STREAM['low_mark']}); -j{jobs}, consumer "
        f"{args.consumer_workers} workers",
        flush=True,
    )
    if args.dry_run:
        return
    if not args.quick:
        # Matplotlib's font cache is built on a machine's first import: not in a window.
        subprocess.run([sys.executable, "-c", "import matplotlib.pyplot"], check=False)
    results: dict = {
        "argv": sys.argv,
        "engine": engine,
        "model": "demo" if args.quick else args.model,
        "records": len(lens),
        "tokens": total,
        "raw_bytes_per_token": bpt,
        "run_raw_bytes": total * bpt,
        "budget_frac": frac,
        "plan": plan,
        "stream": STREAM,
        "jobs": jobs,
        "runs": {},
    }

    def save() -> None:
        slim = {
            **results,
            "runs": {
                k: {x: y for x, y in v.items() if x != "disk_rows"}
                for k, v in results["runs"].items()
            },
        }
        (out_dir / "stream_budget.json").write_text(json.dumps(slim, indent=1, default=str))

    runs = results["runs"]
    try:
        if not args.quick and not args.no_warmup:
            warm = work / "warm.jsonl"
            pick = sorted(lens)
            race.write_records(warm, pick[:4] + pick[-4:], args.seed + 7, vocab)
            print("== warm-up (kernels compiled outside both runs)", flush=True)
            r = run_workflow(
                work,
                "warm",
                make_config(1, "sb-warm", warm),
                jobs=2,
                timeout_s=min(300.0, deadline - time.monotonic() - 60),
                reclaim=False,
                env=env,
                period=args.period,
            )
            results["warmup"] = {k: r.get(k) for k in ("rc", "snakemake_s", "log_tail")}
            print(json.dumps(results["warmup"]), flush=True)
            if r["rc"] != 0:
                raise SystemExit("the warm-up run failed; see its log tail above")
            race.wait_gpu_free()
        alone_s = args.consumer_alone_s + ALONE_START_S
        for tag in ("none", "budget"):
            left = deadline - time.monotonic()
            # Both runs do the same work: the first gets half of what is left once the
            # consumer alone's time is set aside.
            limit = (left - 20 - alone_s) / 2 if tag == "none" else left - 15
            print(f"== {tag} ({limit:.0f} s at most)", flush=True)
            r = run_workflow(
                work,
                tag,
                configs[tag],
                jobs=jobs,
                timeout_s=max(30.0, limit),
                # On the CPU too (its chunks fit any disk): the chunks the consumer alone
                # reads are chosen the one way.
                reclaim=tag == "none",
                env=env,
                period=args.period,
                consumer={"workers": args.consumer_workers} if tag == "budget" else None,
                keep_bytes=int(args.consumer_alone_gb * GB),
            )
            runs[tag] = r
            if tag == "budget":
                r["consumer_check"] = check_consumer(r, Path(r["run_dir"]))
            save()
            brief = {k: v for k, v in r.items() if k not in ("disk_rows", "consumer")}
            print(json.dumps(brief, default=str), flush=True)
            race.wait_gpu_free()
            if tag == "none":
                print(
                    f"== consumer alone ({args.consumer_alone_s:.0f} s of reading at most)",
                    flush=True,
                )
                try:
                    ca = consumer_alone(
                        work, r, workers=args.consumer_workers, limit_s=args.consumer_alone_s
                    )
                finally:  # its payloads (punched or kept) make room for the budget run
                    for p in (Path(r["run_dir"]) / "hidden").glob("chunk_*.safetensors"):
                        p.unlink()
                results["consumer_alone"] = ca
                save()
                print(json.dumps(ca, default=str), flush=True)
    finally:
        save()
        subprocess.run(
            [
                "tar",
                "-cJf",
                str(out_dir / "stream_budget-logs.tar.xz"),
                "-C",
                str(work),
                "logs",
                *[str(p.relative_to(work)) for p in work.glob("results-sb-*/*/logs")],
            ],
            check=False,
        )
        # What was measured is summed up even when a run failed or time ran out.
        summarize(results, out_dir, time.monotonic() - t_begin)


def summarize(results: dict, out_dir: Path, elapsed: float) -> None:
    runs = results["runs"]
    a, b = runs.get("none", {}), runs.get("budget", {})
    budget = results["plan"]["budget_bytes"]
    largest = b.get("largest_chunk_bytes")
    ra, rb = a.get("sending_tok_s"), b.get("sending_tok_s")
    ratio = rb / ra if ra and rb else None
    peak = b.get("peak_disk_bytes")
    cc = b.get("consumer_check") or {}
    ca = results.get("consumer_alone") or {}
    # The three rates in one unit, raw states a second: a sending rate's tokens x the raw
    # bytes a token (what the consumer gets per token, ids and mask included).
    bpt = results["raw_bytes_per_token"]
    prod = ra * bpt / GB if ra else None
    cons = ca.get("raw_gb_per_s")
    stream = rb * bpt / GB if rb else None
    smaller = min(prod, cons) if prod and cons else None
    of_smaller = stream / smaller if stream and smaller else None
    figures = {
        "producer_alone": {"tok_s": ra, "raw_gb_s": sig(prod)},
        "consumer_alone": {
            "raw_gb_s": cons,
            "raw_gb_s_per_worker": ca.get("raw_gb_per_s_per_worker"),
            "records_s": ca.get("records_per_s"),
            "tok_s": ca.get("tokens_per_s"),
            "workers": ca.get("workers"),
        },
        "stream": {
            "tok_s": rb,
            "raw_gb_s": sig(stream),
            # Its consumer's own rate over the run, waits for the producer included.
            "consumer_raw_gb_s": cc.get("raw_gb_per_s"),
        },
        "smaller": None if smaller is None else ("producer" if smaller == prod else "consumer"),
        "stream_of_smaller": sig(of_smaller),
        "goal": 0.95,
        "met": of_smaller is not None and of_smaller >= 0.95,
    }
    checks = {
        "ratio_ge_0.95": ratio is not None and ratio >= 0.95,
        "stream_ge_0.95_of_smaller": figures["met"],
        "consumer_alone_read_once": bool(ca.get("none_twice_none_foreign"))
        and ca.get("nacks") == 0
        and bool(ca.get("sha256_as_sidecar"))
        and (bool(ca.get("every_record_once")) or bool(ca.get("stopped_at_limit"))),
        "peak_le_budget_plus_largest": peak is not None
        and largest is not None
        and peak <= budget + largest,
        "every_record_read_once": bool(cc.get("every_record_once")),
        "same_tokens_both_runs": a.get("tokens") == b.get("tokens") == results["tokens"],
    }
    stored = b.get("stored_bytes")
    results["summary"] = {
        "ratio": round(ratio, 4) if ratio else None,
        "budget_bytes": budget,
        "budget_of_raw_run": results["budget_frac"],
        "budget_of_stored_run": round(budget / stored, 4) if stored else None,
        "peak_disk_bytes": peak,
        "largest_chunk_bytes": largest,
        "rates": figures,
        "checks": checks,
        "elapsed_s": round(elapsed, 1),
    }
    slim = {
        **results,
        "runs": {k: {x: y for x, y in v.items() if x != "disk_rows"} for k, v in runs.items()},
    }
    (out_dir / "stream_budget.json").write_text(json.dumps(slim, indent=1, default=str))
    if runs:
        write_csv(out_dir / "disk.csv", runs)
        title = (
            f"{results['model']}, {results['tokens']:,} tokens, "
            f"{results['plan']['n_chunks']} chunks; budget {budget / GB:.3g} GB "
            f"({results['budget_frac']:g} of raw); sending rate budget/none "
            + (f"{ratio:.3f}" if ratio else "n/a")
        )
        write_png(out_dir / "disk.png", runs, budget, largest, title)
    print(
        "\nrun      rc  chunks  tokens      send tok/s  send s   peak disk GB  peak unacked GB  "
        "gate shut s  shm GB"
    )
    for tag, r in runs.items():
        print(
            f"{tag:7s} {str(r.get('rc')):>3} {r.get('chunks', '-'):>7} {r.get('tokens', 0):>10,} "
            f"{r.get('sending_tok_s') or '-':>11} {r.get('sending_s') or '-':>7} "
            f"{gb(r.get('peak_disk_bytes')):>13} {gb(r.get('peak_unacked_bytes')):>16} "
            f"{r.get('gate_shut_s', '-'):>12} {gb(r.get('peak_shm_bytes')):>7}"
        )
    if a.get("peak_logical_bytes"):
        print(
            f"no budget: {gb(a['peak_logical_bytes'])} GB of chunk files written, freed as "
            f"they finished by the bench's reclaim but the latest "
            f"{gb((a.get('reclaim') or {}).get('kept_bytes'))} GB, kept for the consumer alone"
        )
    if ca:
        print(
            f"consumer alone: {ca.get('records_read')} of {ca.get('records_given')} records of "
            f"{ca.get('chunks_given')} chunks ({gb(ca.get('raw_bytes_given'))} GB raw) read "
            f"in {ca.get('span_s')} s"
            + (" (stopped at --consumer-alone-s)" if ca.get("stopped_at_limit") else "")
            + f", every one once: {ca.get('every_record_once')}, sha256 checked: "
            f"{ca.get('sha256_as_sidecar')} ({ca.get('nacks')} nacks); "
            f"{ca.get('records_per_s')} records/s, {ca.get('raw_gb_per_s')} GB/s of raw states, "
            f"{ca.get('raw_gb_per_s_per_worker')} a worker of {ca.get('workers')}"
            + (f" ({ca['why']})" if ca.get("why") else "")
        )
    if b.get("rc") not in (0, None):
        print(
            "budget run: extract_all rc",
            b.get("rc"),
            "(the manifest refuses deleted, acked "
            "payloads until the stream's receipts land: DESIGN.md, Left)",
        )
    if cc:
        print(
            f"consumer: {cc.get('records_read')} of {cc.get('records_expected')} records read, "
            f"every one once: {cc.get('every_record_once')}; {cc.get('records_per_s')} "
            f"records/s, {cc.get('raw_gb_per_s')} GB/s of raw states, {cc.get('workers')} "
            f"workers; announce -> read {cc.get('announce_to_read_s')}, -> ack "
            f"{cc.get('announce_to_ack_s')} s"
        )
        print(
            f"kept up: gate shut {b.get('gate_shut_s')} s of the sending phase, "
            f"{b.get('gate_shut_after_first_ack_s')} s after the first ack; chunk jobs' waits "
            f"{b.get('gate_waits')}"
        )
    if stored:
        print(
            f"budget {gb(budget)} GB = {results['budget_frac']:g} of the run's raw bytes, "
            f"{budget / stored:.3g} of its stored bytes ({gb(stored)} GB); peak disk "
            f"{gb(peak)} GB vs budget + largest chunk {gb(budget + (largest or 0))} GB"
        )
    print(
        f"rates, GB/s of raw states: producer alone {fmt(prod)} ({ra} tok/s), consumer alone "
        f"{fmt(cons)} ({ca.get('raw_gb_per_s_per_worker')} a worker), stream {fmt(stream)} "
        f"({rb} tok/s); stream / the smaller ({figures['smaller']}) "
        f"{fmt(of_smaller, '.3f')}, goal 0.95"
    )
    print("checks:", json.dumps(checks), f"({elapsed:.0f} s)")
    print(
        f"stream budget: ratio {fmt(ratio, '.3f')} peak_GB {gb(peak)} budget_GB {gb(budget)} "
        f"largest_chunk_GB {gb(largest)} producer_GBps {fmt(prod)} consumer_GBps {fmt(cons)} "
        f"stream_GBps {fmt(stream)} stream/smaller {fmt(of_smaller, '.3f')} (goal 0.95: "
        f"{'met' if figures['met'] else 'unmet'})"
    )


def fmt(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_consume":
        p = argparse.ArgumentParser()
        for k in ("--run-dir", "--out"):
            p.add_argument(k, required=True)
        p.add_argument("--workers", type=int, default=3)
        p.add_argument("--stop-after-s", type=float, default=0, help="0: the whole pass")
        consume(p.parse_args(sys.argv[2:]))
    else:
        main()
