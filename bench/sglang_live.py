"""Throughput of extraction on a live SGLang: the pipeline with capture vs the same server
without it, same records, same run.  Runs on the H200 (``HSEXTRACT_RUN="python3
bench/sglang_live.py" bash h200/run.sh``), SGLang 0.5.14.

The model has DeepSeek-V3's full width -- hidden 7168, 128 heads, q_lora 1536, kv_lora
512, MLP 18432, vocab 129,280 -- and 8 layers (1 dense + 7 MoE of 16 experts of 2048,
top-2) so it fits one GPU; random weights (``--load-format dummy``: only a config.json).
Records of 8,192 tokens, one extend pass each (chunked prefill 8192), aux layers [2, 4, 5]
+ the final norm: 470 MB of states per pass.

Two servers with the same flags, started at once, measured in alternation (one at a time,
so they never share the GPU while timed):

* off: ``SGLANG_HS_DUMP_DIR`` unset (the patch is inert): the records' ``/generate``
  requests, as many in flight as the on rounds have at most -- what the GPU can do;
* on (``--modes codec@disk|shm[:jobs]``): the patch dumping, through the real client:
  ``extract_chunk`` of the same records into chunk files, assembly, fsync and sha256
  included, ``jobs`` chunks at a time, each worker taking the next chunk when its last one
  is finished -- as ``snakemake -j N`` runs chunk jobs against one server.  ``disk`` writes
  the chunk files in the work dir, ``shm`` on /dev/shm (tells the disk's share apart).

Also the servers' own prefill throughput from their logs (the capture's cost inside the
server), and a storage baseline: the same bytes written, fsynced and hashed with no
extraction (the least finishing the chunk files costs).  A round is short (seconds), so
its last chunks' finish shows in full; in a long run it shows once.  Last line:
``capture on/off throughput ratio: X (<first mode>: on Y, off Z tok/s)``.

Measured on 2026-12-01: bench/README.md, "Capture on a live SGLang".
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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
    ap.add_argument("--records", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--jobs",
        type=int,
        default=4,
        help="chunks extracted at once, one after another like snakemake -j N (0: all)",
    )
    ap.add_argument("--in-flight", type=int, default=4, help="per chunk")
    ap.add_argument(
        "--modes",
        default="lossless@disk,none@disk,lossless@disk:2",
        help="capture-on rounds, codec@disk|shm[:jobs] (chunk files on the work dir's disk "
        "or on /dev/shm; jobs: --jobs); the first is the headline",
    )
    ap.add_argument("--work", default="/tmp/hsextract-bench-live")
    args = ap.parse_args()

    import requests
    import yaml

    from hsextract import server
    from hsextract.client import extract_chunk
    from hsextract.config import load_config
    from hsextract.records import merge_and_shuffle, split_chunks
    from hsextract.sglang import patching
    from hsextract.steps import _installed_sglang_root

    work = Path(args.work)
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(WIDE))
    import random

    rng = random.Random(0)
    data = work / "data.jsonl"
    n = 8192
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
    # -j of every mode: the off rounds keep as many requests in flight as the most of them.
    most = max([jobs] + [int(m.partition(":")[2] or jobs) for m in args.modes.split(",")])

    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(engine="sglang", inputs=[str(data)], output_root=str(work / "results"),
               n_chunks=args.chunks, max_seq_len=n, capture="patch",
               model={"path": str(work / "model"), "dtype": "bfloat16"})  # fmt: skip
    cfg["demo"] = {"enabled": False}
    cfg["server"].update(
        chunked_prefill_size=n, max_running_requests=args.in_flight * most, health_timeout_s=900
    )
    cfg["client"].update(requests_in_flight=args.in_flight, request_timeout_s=600)
    cfg["dump"] = {"dir": str(Path("/dev/shm") / "hsextract-bench"), "shm_budget_gb": 16}
    cfg["sglang"] = {
        "python": sys.executable, "tp_size": 1, "mem_fraction_static": 0.4,
        "extra_args": ["--load-format", "dummy", "--attention-backend", "triton",
                       "--sampling-backend", "pytorch", "--skip-tokenizer-init",
                       # A fixed KV pool: two servers can start at once on one GPU.
                       "--max-total-tokens", "262144"],
        "extra_env": {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"},
    }  # fmt: skip
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    os.chdir(work)
    cfg = load_config("config.yaml")
    patching.apply(_installed_sglang_root(cfg))

    on_spec = server.build_spec(cfg, run_dir=work, log_path=work / "on.log")
    off_spec = server.build_spec(cfg, run_dir=work, log_path=work / "off.log")
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

    def on_round(tag: str, codec: str, dest: Path, jobs: int) -> float:
        run_cfg = copy.deepcopy(cfg)
        run_cfg["storage"]["codec"] = codec
        dest.mkdir(parents=True, exist_ok=True)

        def one(c: Path) -> None:
            out = dest / f"hidden-{tag}-{c.stem}.safetensors"
            extract_chunk(copy.deepcopy(run_cfg), chunk_path=c,
                          index_path=work / "chunks" / "index.json", out_path=out,
                          sidecar_path=out.with_suffix(".json"), ensure=lambda: states["on"],
                          progress=False)  # fmt: skip

        t = time.monotonic()
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(one, chunks))
        dt = time.monotonic() - t
        for f in dest.glob(f"hidden-{tag}-*.safetensors"):
            written[(codec, dest.name)] = f.stat().st_size
            f.unlink()
        return dt

    written: dict = {}
    dests = {"disk": work / "out", "shm": Path("/dev/shm/hsextract-bench-out")}
    try:
        # Warm-up: kernels compile on the first requests of each server.
        t = time.monotonic()
        for r in records[:2]:
            generate(states["off"]["url"], r["input_ids"], f"warm-{r['id']}")
        modes = [("off", off_round)]
        for m in args.modes.split(","):
            codec, where = m.split("@")
            where, _, j = where.partition(":")
            fn = partial(on_round, codec=codec, dest=dests[where], jobs=int(j or jobs))
            modes.append((f"on {codec}@{where} -j{int(j or jobs)}", fn))
        modes[1][1]("warm")
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
        raw = tokens * 2 * WIDE["hidden_size"] * 4  # bf16, 3 aux layers + final
        for where, d in dests.items():
            w_s, f_s = storage_baseline(d, raw // jobs, jobs)
            print(f"{where} baseline: {jobs} x {raw / jobs / 1e9:.2f} GB at once: "
                  f"write {raw / w_s / 1e9:.2f} GB/s, fsync + sha256 {raw / f_s / 1e9:.2f} GB/s; "
                  f"together {tokens / (w_s + f_s):,.0f} tok/s of states")  # fmt: skip
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
