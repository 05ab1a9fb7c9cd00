"""Benchmark end to end on CPU: pipeline tokens/s on the reference engine vs a bare HF forward.

Builds, untimed, the demo recipe's random DeepSeek-V3 (``hsextract.demo``) made bigger so the
forward dominates as it does in production (hidden 1024, 8 layers: 2 dense + 6 MoE, MLA,
float32 -- the demo dtype), and 24 records of 256-1,536 tokens in two JSON-lines shards.
Then, in the same run:

* pipeline: the real ``snakemake -j1 extract_all`` on a config with those inputs and
  model (``n_chunks`` 2, ``max_seq_len`` 2048, ``server.chunked_prefill_size`` 2048, the
  rest as in ``config.yaml``).  Its extraction time is what Snakemake's ``benchmark:``
  files record for ``launch_server`` (model load, health) plus every ``extract_chunk``
  (HTTP, scheduled forwards with capture, dump pieces, packing, fsync, sha256);
* bare: in this process, ``model.model(ids, output_hidden_states=True)`` per record over
  the same records (model loaded and warmed up first, untimed).

One record's final hidden state from the chunk file is checked against the bare forward.

Usage: .venv/bin/python bench/e2e_cpu.py [--hidden 1024] [--layers 8] [--records 24]
Last line: ``pipeline/bare tokens_per_s ratio: X.XX``.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512
MAX_LEN = 2048


def seconds(tsv: Path) -> float:
    with open(tsv) as f:
        return float(next(csv.DictReader(f, delimiter="\t"))["s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--records", type=int, default=24)
    ap.add_argument("--keep", action="store_true", help="keep the temp workdir")
    args = ap.parse_args()

    from hsextract.demo import build_demo_model

    wd = Path(tempfile.mkdtemp(prefix="hsextract-bench-e2e-"))
    try:
        demo = {
            "seed": 0,
            "hidden_size": args.hidden,
            "num_hidden_layers": args.layers,
            "vocab_size": VOCAB,
        }
        build_demo_model(wd / "model", demo)
        rng = random.Random(0)
        records = []
        for i in range(args.records):
            n = rng.randint(256, 1536)
            ids = [rng.randrange(VOCAB) for _ in range(n)]
            records.append({"id": f"r{i:04d}", "input_ids": ids, "loss_mask": [1] * n})
        (wd / "data").mkdir()
        for s in range(2):
            lines = [orjson.dumps(r) + b"\n" for r in records[s::2]]
            (wd / "data" / f"shard_{s}.jsonl").write_bytes(b"".join(lines))
        cfg = yaml.safe_load((REPO / "config.yaml").read_text())
        cfg.update(inputs=[str(wd / "data" / "shard_*.jsonl")], n_chunks=2, max_seq_len=MAX_LEN)
        cfg["model"].update(path=str(wd / "model"), dtype="float32", revision="bench")
        cfg["demo"]["enabled"] = False
        cfg["server"]["chunked_prefill_size"] = MAX_LEN
        (wd / "config.yaml").write_text(yaml.safe_dump(cfg))

        cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-j1"]
        t0 = time.perf_counter()
        proc = subprocess.run(
            [*cmd, "extract_all"], cwd=wd, capture_output=True, text=True, timeout=3600
        )
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"snakemake failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        rd_out = subprocess.run(
            [sys.executable, "-m", "hsextract.cli", "run-dir", "--configfile", "config.yaml"],
            cwd=wd, capture_output=True, text=True, check=True,
        )  # fmt: skip
        rd = wd / rd_out.stdout.strip()
        manifest = json.loads((rd / "manifest.json").read_text())
        tokens = manifest["totals"]["tokens"]
        bench = rd / "benchmarks"
        launch = seconds(bench / "launch_server.tsv")
        chunks = sum(seconds(p) for p in bench.glob("extract_chunk_*.tsv"))
        extraction = launch + chunks

        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(wd / "model", dtype=torch.float32).eval()
        tensors = [torch.tensor([r["input_ids"]]) for r in records]
        with torch.inference_mode():
            model.model(input_ids=tensors[0][:, :64], output_hidden_states=True)  # warm-up
            t0 = time.perf_counter()
            for ids in tensors:
                out = model.model(input_ids=ids, output_hidden_states=True)
            bare = time.perf_counter() - t0
        bare_tokens = sum(t.shape[1] for t in tensors)
        assert bare_tokens == tokens, (bare_tokens, tokens)

        from hsextract.chunks import ChunkReader

        for c in manifest["chunks"]:
            reader = ChunkReader(rd / c["path"])
            if records[-1]["id"] in reader.record_ids:
                got = reader[reader.record_ids.index(records[-1]["id"])]["hidden_states"]
                diff = (got - out.hidden_states[-1][0]).abs().max().item()
                print(f"check: record {records[-1]['id']} final hidden max |diff| {diff:.2e}")

        print(
            f"model: demo DeepSeek-V3 recipe, hidden {args.hidden}, {args.layers} layers, "
            f"vocab {VOCAB}, float32, CPU ({torch.get_num_threads()} torch threads); "
            f"{args.records} records, {tokens} tokens, 2 chunks"
        )
        print(f"snakemake -j1 extract_all wall (all stages): {wall:.1f} s")
        print(
            f"pipeline extraction (launch_server {launch:.1f} s + extract_chunk {chunks:.1f} s): "
            f"{extraction:.1f} s, {tokens / extraction:.0f} tokens/s"
        )
        print(
            f"bare model.model(ids, output_hidden_states=True) per record: {bare:.1f} s, "
            f"{tokens / bare:.0f} tokens/s"
        )
        print(f"pipeline/bare tokens_per_s ratio: {bare / extraction:.2f}")
    finally:
        if args.keep:
            print(f"kept {wd}")
        else:
            shutil.rmtree(wd, ignore_errors=True)


if __name__ == "__main__":
    main()
