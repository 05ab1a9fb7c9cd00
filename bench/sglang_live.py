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
  requests, ``client.requests_in_flight`` at a time -- what the GPU can do;
* on: the patch dumping, through the real client: ``extract_chunk`` of the same records
  into chunk files, assembly, fsync and sha256 included -- ``--chunks`` of them at once, as
  ``snakemake -j N`` runs chunk jobs (one chunk's fsync and sha256, seconds for GBs, then
  overlap the next chunk's extraction instead of idling the GPUs).  ``--chunks 1`` shows
  the cost of one chunk alone.

Also the servers' own prefill throughput from their logs.  Last line:
``capture on/off throughput ratio: X (on Y tok/s, off Z tok/s)``.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=12)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--in-flight", type=int, default=2, help="per chunk")
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

    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(engine="sglang", inputs=[str(data)], output_root=str(work / "results"),
               n_chunks=args.chunks, max_seq_len=n, capture="patch",
               model={"path": str(work / "model"), "dtype": "bfloat16"})  # fmt: skip
    cfg["demo"] = {"enabled": False}
    cfg["server"].update(chunked_prefill_size=n, max_running_requests=4, health_timeout_s=900)
    cfg["client"].update(requests_in_flight=args.in_flight, request_timeout_s=600)
    cfg["dump"] = {"dir": str(Path("/dev/shm") / "hsextract-bench"), "shm_budget_gb": 16}
    cfg["sglang"] = {
        "python": sys.executable, "tp_size": 1, "mem_fraction_static": 0.4,
        "extra_args": ["--load-format", "dummy", "--attention-backend", "triton",
                       "--sampling-backend", "pytorch", "--skip-tokenizer-init",
                       # A fixed KV pool: two servers can start at once on one GPU.
                       "--max-total-tokens", "65536"],
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
        with ThreadPoolExecutor(args.in_flight * args.chunks) as pool:
            list(pool.map(lambda r: generate(states["off"]["url"], r["input_ids"],
                                             f"{tag}-{r['id']}"), records))  # fmt: skip
        return time.monotonic() - t

    def on_round(tag: str) -> float:
        def one(c: Path) -> None:
            out = work / f"hidden-{tag}-{c.stem}.safetensors"
            extract_chunk(copy.deepcopy(cfg), chunk_path=c,
                          index_path=work / "chunks" / "index.json", out_path=out,
                          sidecar_path=out.with_suffix(".json"), ensure=lambda: states["on"],
                          progress=False)  # fmt: skip

        t = time.monotonic()
        with ThreadPoolExecutor(len(chunks)) as pool:
            list(pool.map(one, chunks))
        dt = time.monotonic() - t
        for f in work.glob(f"hidden-{tag}-*.safetensors"):
            f.unlink()
        return dt

    try:
        # Warm-up: kernels compile on the first requests of each server.
        t = time.monotonic()
        for r in records[:2]:
            generate(states["off"]["url"], r["input_ids"], f"warm-{r['id']}")
        on_round("warm")
        print(f"warm-up {time.monotonic() - t:.0f} s", flush=True)
        tokens = n * len(records)
        rows = []
        since = time.time()
        for k in range(args.rounds):
            for name, fn in (("off", off_round), ("on", on_round))[:: 1 if k % 2 == 0 else -1]:
                dt = fn(f"r{k}")
                rows.append((name, dt))
                print(f"round {k} {name}: {dt:.2f} s = {tokens / dt:,.0f} tok/s", flush=True)
        on = statistics.median(tokens / dt for name, dt in rows if name == "on")
        off = statistics.median(tokens / dt for name, dt in rows if name == "off")
        for name in ("on", "off"):
            rates = prefill_rates(work / f"{name}.log", since)
            med = f"{statistics.median(rates):,.0f}" if rates else "n/a"
            print(f"server log ({name}): {len(rates)} prefill batches, median {med} tok/s")
        print(
            f"{len(records)} records x {n} tokens per round in {args.chunks} chunk(s) at once, "
            f"{args.in_flight} in flight per chunk, {args.rounds} rounds each, alternating"
        )
        ratio = on / off
        print(f"capture on/off throughput ratio: {ratio:.3f} (on {on:,.0f}, off {off:,.0f} tok/s)")
    finally:
        for st in states.values():
            server.stop(st)


if __name__ == "__main__":
    main()
