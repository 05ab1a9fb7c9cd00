"""Throughput of extraction on a live SGLang: the pipeline with capture vs the same server
without it, same records, same run.  Runs on the H200 (``HSEXTRACT_RUN="python3
bench/sglang_live.py" bash h200/run.sh``), SGLang 0.5.14.

The model has DeepSeek-V3's full width -- hidden 7168, 128 heads, q_lora 1536, kv_lora
512, MLP 18432, vocab 129,280 -- and 8 layers (1 dense + 7 MoE of 16 experts of 2048,
top-2) so it fits one GPU; random weights (``--load-format dummy``: only a config.json).
Records of 8,192 tokens (`--record-tokens`), one extend pass each (chunked prefill 8192,
`--chunked-prefill`), aux layers [2, 4, 5]
+ the final norm: 470 MB of states per pass.

Two servers with the same flags, started at once, measured in alternation (one at a time,
so they never share the GPU while timed):

* off: ``SGLANG_HS_DUMP_DIR`` unset (the patch is inert): the records' ``/generate``
  requests, as many in flight as the on rounds have at most -- what the GPU can do;
* on (``--modes codec@disk|shm[:jobs[/sending[p]]]``): the patch dumping, through the
  real client: ``extract_chunk`` of the same records into chunk files, assembly, fsync
  and sha256 included, ``jobs`` chunks at a time, each worker taking the next chunk when
  its last one is finished -- as ``snakemake -j N`` runs chunk jobs against one server --
  with ``sending`` of them (``client.sending_jobs``) sending requests at once.  Workers are
  threads of this process, or with ``p`` processes (as Snakemake's jobs are: no shared
  GIL; started before the round).  ``disk`` writes the chunk files in the work dir,
  ``shm`` on /dev/shm (tells the disk's share apart).  Each chunk file is deleted once its
  job is done, so a long run fits the disk.

Also the servers' own prefill throughput from their logs (the capture's cost inside the
server), and a storage baseline: the same bytes written, fsynced and hashed with no
extraction (the least finishing the chunk files costs).  A round's last chunks' finish
shows in full (in a real run it shows once), so each on round also reports when its last
record was sent, and how much of the round some job was sending.  Last line:
``capture on/off throughput ratio: X (<first mode>: on Y, off Z tok/s)``.

Measured on 2026-12-01: bench/README.md, "Capture on a live SGLang".
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import re
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

WIDE = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280,
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=8, first_k_dense_replace=1, moe_layer_freq=1,
    num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16,
    n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
    topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
    routed_scaling_factor=1.0, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=16384, rope_theta=10000.0, rope_scaling=None,
    attention_bias=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    torch_dtype="bfloat16", num_nextn_predict_layers=0,
)  # fmt: skip


def _import_client() -> None:
    import hsextract.client  # noqa: F401  (torch and all, before the round's clock starts)


def _chunk_job(cfg: dict, index: Path, dest: Path, tag: str, state: dict, c: Path) -> dict:
    """One chunk job, as ``extract_chunk`` runs it in Snakemake; its file deleted after."""
    from hsextract.client import extract_chunk
    from hsextract.config import typed

    out = dest / f"hidden-{tag}-{c.stem}.safetensors"
    sc = extract_chunk(typed(copy.deepcopy(cfg)), chunk_path=c, index_path=index, out_path=out,
                       sidecar_path=out.with_suffix(".json"), ensure=lambda: state,
                       progress=False)  # fmt: skip
    out.unlink()
    out.with_suffix(".json").unlink()
    return sc


def prefill_rates(log: Path, since: float) -> list[float]:
    """The server's own 'input throughput (token/s)' of prefill batches after ``since``."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", line)
        r = re.search(r"Prefill batch.*?input throughput \(token/s\): ([\d.]+)", line)
        if m and r and time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) >= since - 1:
            out.append(float(r.group(1)))
    return out


def storage_baseline(d: Path, nbytes: int, files: int) -> tuple[float, float]:
    """What finishing a chunk file costs at the least, with the same bytes, on the same
    storage: ``files`` files of ``nbytes`` written at once (8 MiB writes, a thread each),
    then each fsynced while its sha256 is read back (as ``ChunkWriter.finish`` does).
    Returns (seconds writing, seconds finishing)."""
    from hsextract.chunks import sha256_file

    d.mkdir(parents=True, exist_ok=True)
    buf = memoryview(os.urandom(72 << 20))
    paths = [d / f"baseline-{i}.bin" for i in range(files)]
    fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644) for p in paths]

    def write(fd: int) -> None:
        left, k = nbytes, 0
        while left:
            m = min(left, 8 << 20)
            os.write(fd, buf[(k % 8) << 20 : ((k % 8) << 20) + m])
            left, k = left - m, k + 1

    def finish(i: int) -> None:
        with ThreadPoolExecutor(1) as one:
            hashing = one.submit(sha256_file, paths[i])  # ChunkWriter.finish's own hash
            os.fsync(fds[i])
            hashing.result()

    t = time.monotonic()
    with ThreadPoolExecutor(files) as pool:
        list(pool.map(write, fds))
    w = time.monotonic() - t
    t = time.monotonic()
    with ThreadPoolExecutor(files) as pool:
        list(pool.map(finish, range(files)))
    f = time.monotonic() - t
    for fd, p in zip(fds, paths, strict=True):
        os.close(fd)
        p.unlink()
    return w, f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=384)
    ap.add_argument("--chunks", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--jobs",
        type=int,
        default=8,
        help="chunks extracted at once, one after another like snakemake -j N (0: all)",
    )
    ap.add_argument("--in-flight", type=int, default=4, help="per chunk")
    ap.add_argument("--record-tokens", type=int, default=8192, help="tokens per record")
    ap.add_argument("--chunked-prefill", type=int, default=None,
                    help="tokens per extend pass (default: --record-tokens): 1024 measures "
                         "the capture's per-pass cost at short passes")  # fmt: skip
    ap.add_argument(
        "--modes",
        default="lossless@disk:8/4p,lossless@disk:4/4p",
        help="capture-on rounds, codec@disk|shm[:jobs[/sending]] (chunk files on the work "
        "dir's disk or on /dev/shm; jobs: --jobs; sending: client.sending_jobs, default "
        "jobs); the first is the headline",
    )
    ap.add_argument("--mem-fraction", type=float, default=0.4,
                    help="each server's --mem-fraction-static (two share the GPU; an 80 GB "
                         "H100 needs ~0.47)")  # fmt: skip
    ap.add_argument("--work", default="/tmp/hsextract-bench-live")
    args = ap.parse_args()

    import requests
    import yaml

    from hsextract import server
    from hsextract.config import load_config, typed
    from hsextract.records import merge_and_shuffle, split_chunks
    from hsextract.sglang import patching
    from hsextract.steps import _installed_sglang_root

    work = Path(args.work)
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(WIDE))
    import random

    rng = random.Random(0)
    data = work / "data.jsonl"
    n = args.record_tokens
    with open(data, "w") as f:
        for i in range(args.records):
            ids = [rng.randrange(2, WIDE["vocab_size"]) for _ in range(n)]
            f.write(json.dumps({"id": f"b{i:03d}", "input_ids": ids, "loss_mask": [1] * n}) + "\n")
    merge_and_shuffle([data], work / "merged", max_seq_len=n, overlength="truncate", seed=0,
                      vocab_size=WIDE["vocab_size"], max_reject_fraction=0.0)  # fmt: skip
    chunks = [work / "chunks" / f"chunk_{i:05d}.jsonl" for i in range(args.chunks)]
    split_chunks(work / "merged" / "train.jsonl", chunks, work / "chunks" / "index.json")
    records = [json.loads(line) for c in chunks for line in c.read_text().splitlines()]
    jobs = args.jobs or len(chunks)

    def parse_mode(m: str) -> tuple[str, str, int, int, bool]:
        codec, _, where = m.partition("@")
        where, _, js = where.partition(":")
        j, _, sending = js.partition("/")
        procs = sending.endswith("p")
        sending = sending.removesuffix("p")
        return codec, where, int(j or jobs), int(sending or j or jobs), procs

    modes_spec = [parse_mode(m) for m in args.modes.split(",")]
    # The off rounds keep as many requests in flight as the most any on round sends.
    most = max(min(j, sending) for _, _, j, sending, _ in modes_spec)

    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(engine="sglang", inputs=[str(data)], output_root=str(work / "results"),
               n_chunks=args.chunks, max_seq_len=n, capture="patch",
               model={"path": str(work / "model"), "dtype": "bfloat16"})  # fmt: skip
    cfg["demo"] = {"enabled": False}
    cfg["server"].update(
        chunked_prefill_size=args.chunked_prefill or n,
        max_running_requests=args.in_flight * most,
        health_timeout_s=900,
    )
    cfg["client"].update(requests_in_flight=args.in_flight, request_timeout_s=600)
    cfg["dump"] = {"dir": str(Path("/dev/shm") / "hsextract-bench"), "shm_budget_gb": 16}
    cfg["sglang"] = {
        "python": sys.executable, "tp_size": 1, "mem_fraction_static": args.mem_fraction,
        "extra_args": ["--load-format", "dummy", "--attention-backend", "triton",
                       "--sampling-backend", "pytorch", "--skip-tokenizer-init",
                       # A fixed KV pool: two servers can start at once on one GPU.
                       "--max-total-tokens", "262144"],
        "extra_env": {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"},
    }  # fmt: skip
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    os.chdir(work)
    cfg = load_config("config.yaml")  # a dict: each round edits a copy of it
    tcfg = typed(cfg)
    patching.apply(_installed_sglang_root(tcfg))

    on_spec = server.build_spec(tcfg, run_dir=work, log_path=work / "on.log")
    off_spec = server.build_spec(tcfg, run_dir=work, log_path=work / "off.log")
    off_spec.env = {k: v for k, v in off_spec.env.items() if k != "SGLANG_HS_DUMP_DIR"}
    states: dict[str, dict] = {}

    def start(name, spec):
        states[name] = server.start(spec, owner=os.getpid())

    t0 = time.monotonic()
    threads = [threading.Thread(target=start, args=a) for a in (("on", on_spec), ("off", off_spec))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if missing := {"on", "off"} - states.keys():
        sys.exit(f"server(s) {sorted(missing)} did not start: see {work}/on.log, off.log")
    print(f"both servers healthy after {time.monotonic() - t0:.0f} s", flush=True)
    session = requests.Session()

    def generate(url: str, ids: list[int], rid: str) -> None:
        body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 0}}
        session.post(f"{url}/generate", json=body, timeout=900).raise_for_status()

    def off_round(tag: str) -> float:
        t = time.monotonic()
        with ThreadPoolExecutor(args.in_flight * most) as pool:
            list(pool.map(lambda r: generate(states["off"]["url"], r["input_ids"],
                                             f"{tag}-{r['id']}"), records))  # fmt: skip
        return time.monotonic() - t

    def on_round(
        tag: str,
        codec: str,
        dest: Path,
        jobs: int,
        sending: int,
        procs: bool,
        todo: list[Path] = chunks,
    ) -> float:
        run_cfg = copy.deepcopy(cfg)
        run_cfg["storage"]["codec"] = codec
        run_cfg["client"]["sending_jobs"] = sending
        dest.mkdir(parents=True, exist_ok=True)
        job = partial(_chunk_job, run_cfg, work / "chunks" / "index.json", dest, tag, states["on"])
        if procs:
            pool = ProcessPoolExecutor(
                jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_import_client
            )
            list(pool.map(time.sleep, [2.0] * jobs))  # every worker started and imported
        else:
            pool = ThreadPoolExecutor(jobs)
        t, wall = time.monotonic(), time.time()
        with pool:
            sidecars = list(pool.map(job, todo))
        dt = time.monotonic() - t
        # How much of the round some job had records to send (the union of the jobs'
        # [took its turn, sent its last record]): the gaps are where the server got nothing
        # new from us.
        spans = sorted((a - wall, b - wall) for a, b in (sc["sending"] for sc in sidecars))
        covered, end = 0.0, 0.0
        for a, b in spans:
            covered += max(0.0, b - max(a, end))
            end = max(end, b)
        finish = statistics.median(sc["finished_at"] - sc["sending"][1] for sc in sidecars)
        stored = sum(sc["bytes"] for sc in sidecars) / sum(
            sc["states_raw_bytes"] for sc in sidecars
        )
        print(f"  {tag} {codec} -j{jobs}/{sending}{' processes' if procs else ''}: last record "
              f"sent at {end:.2f} s of {dt:.2f} s; some job sending {covered / dt:.1%} of the "
              f"round; median from last record sent to file done {finish:.2f} s; file bytes / "
              f"raw states {stored:.3f}", flush=True)  # fmt: skip
        return dt

    dests = {"disk": work / "out", "shm": Path("/dev/shm/hsextract-bench-out")}
    try:
        # Warm-up: kernels compile on the first requests of each server.
        t = time.monotonic()
        for r in records[:2]:
            generate(states["off"]["url"], r["input_ids"], f"warm-{r['id']}")
        modes = [("off", off_round)]
        for codec, where, j, sending, procs in modes_spec:
            fn = partial(on_round, codec=codec, dest=dests[where], jobs=j, sending=sending,
                         procs=procs)  # fmt: skip
            kind = " (processes)" if procs else ""
            modes.append((f"on {codec}@{where} -j{j}, {sending} sending{kind}", fn))
        modes[1][1]("warm", todo=[c for c in chunks if c.stat().st_size][:2])
        print(f"warm-up {time.monotonic() - t:.0f} s", flush=True)
        tokens = n * len(records)
        rows = []
        since = time.time()
        for k in range(args.rounds):
            for name, fn in modes[:: 1 if k % 2 == 0 else -1]:
                dt = fn(f"r{k}")
                rows.append((name, dt))
                print(f"round {k} {name}: {dt:.2f} s = {tokens / dt:,.0f} tok/s", flush=True)
        rate = {m: statistics.median(tokens / dt for k, dt in rows if k == m) for m, _ in modes}
        for name in ("on", "off"):
            rates = prefill_rates(work / f"{name}.log", since)
            med = f"{statistics.median(rates):,.0f}" if rates else "n/a"
            print(f"server log ({name}): {len(rates)} prefill batches, median {med} tok/s")
        # What the output disk itself does with the same bytes, same run: write + fsync,
        # then sha256 of the file (what finishing a chunk file costs at the least).
        per_token = 2 * WIDE["hidden_size"] * 4  # bf16, 3 aux layers + final
        raw = tokens * per_token
        base = min(raw, 8 << 30)  # the rates, not the whole round: it may not fit the disk
        for where, d in dests.items():
            w_s, f_s = storage_baseline(d, base // jobs, jobs)
            tps = base / per_token / (w_s + f_s)
            print(f"{where} baseline: {jobs} x {base / jobs / 1e9:.2f} GB at once: "
                  f"write {base / w_s / 1e9:.2f} GB/s, fsync + sha256 {base / f_s / 1e9:.2f} "
                  f"GB/s; together {tps:,.0f} tok/s of states")  # fmt: skip
        print(
            f"{len(records)} records x {n} tokens per round in {args.chunks} chunk(s), {jobs} "
            f"at once, {args.in_flight} in flight per chunk, {args.rounds} rounds each, "
            f"alternating; states {raw / 1e9:.2f} GB per round"
        )
        for m, _ in modes[2:]:
            print(f"{m}: on/off {rate[m] / rate['off']:.3f} ({rate[m]:,.0f} tok/s)")
        head = modes[1][0]
        on, off = rate[head], rate["off"]
        print(
            f"capture on/off throughput ratio: {on / off:.3f} ({head}: on "
            f"{on:,.0f}, off {off:,.0f} tok/s)"
        )
    finally:
        for st in states.values():
            server.stop(st)


if __name__ == "__main__":
    main()
