"""The train-while-extracting bench (issue 39, bench/stream_budget.py) on the CPU: the
reference engine and the demo's tiny model, the same two runs as on the H200 (no budget,
then a budget with a consumer acking as it reads).  Nothing is timed here: the ratio is
the bench's (bench/README.md, "Train while extracting"); what is asserted are the
invariants it reports, recomputed from the files the runs left."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from fixtures_demo import kill_processes_under

REPO = Path(__file__).resolve().parents[1]
LAST = re.compile(
    r"stream budget: ratio (\d+\.\d{3}) peak_GB (\S+) budget_GB (\S+) largest_chunk_GB (\S+)"
)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.workflow
def test_quick_bench_reads_every_record_once_within_the_budget(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    try:
        proc = subprocess.run(
            [sys.executable, str(REPO / "bench" / "stream_budget.py"), "--quick", "--engine",
             "reference", "--work", str(work), "--out", str(out), "--budget-s", "1500"],
            cwd=REPO, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
    finally:
        kill_processes_under(work)
    tail = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, tail
    last = LAST.fullmatch(proc.stdout.strip().splitlines()[-1])
    assert last, tail
    report = json.loads((out / "stream_budget.json").read_text())
    s, runs = report["summary"], report["runs"]
    assert set(runs) == {"none", "budget"}
    none, budget = runs["none"], runs["budget"]
    assert none["rc"] == 0, none.get("log_tail")

    # Both runs extracted the same records, every chunk; the ratio is of their sending rates.
    n = report["plan"]["n_chunks"]
    assert none["chunks"] == budget["chunks"] == n
    assert none["tokens"] == budget["tokens"] == report["tokens"] > 0
    assert s["ratio"] == pytest.approx(budget["sending_tok_s"] / none["sending_tok_s"], rel=1e-3)
    assert float(last.group(1)) == pytest.approx(s["ratio"], abs=1e-3)

    # The budget: below the run's raw bytes, and the least chunk count the gate accepts.
    assert s["budget_bytes"] < report["run_raw_bytes"]
    assert budget["planned_chunks"] == n
    window = report["plan"]["window_chunks"]
    assert (
        max(window, (window - 1) / report["stream"]["low_mark"])
        * (budget["largest_chunk_tokens"] * report["raw_bytes_per_token"])
        <= s["budget_bytes"]
    )

    # Peak disk, recomputed from the sampled CSV (the budget run's sending phase on).
    with open(out / "disk.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["run"] == "budget"]
    assert rows and max(int(r["alloc_bytes"]) for r in rows) >= s["peak_disk_bytes"] > 0
    largest = max(c["bytes"] for c in lines(Path(budget["run_dir"]) / "stream" / "journal.jsonl")
                  if c["type"] == "chunk")  # fmt: skip
    assert s["largest_chunk_bytes"] == largest
    assert s["peak_disk_bytes"] <= s["budget_bytes"] + largest
    assert s["checks"]["peak_le_budget_plus_largest"]

    # The consumer read every record of the run exactly once, and acked every chunk; the
    # workflow deleted acked payloads (the stream, not the bench, freed the disk).
    rd = Path(budget["run_dir"])
    want = Counter(json.loads(x)["id"] for x in (rd / "merged" / "train.jsonl").open())
    consumer = json.loads((work / "consumer.json").read_text())
    assert Counter(consumer["ids"]) == want and len(want) == report["records"]
    assert s["checks"]["every_record_read_once"]
    sdir = rd / "stream"
    announced = {c["seq"] for c in lines(sdir / "journal.jsonl") if c["type"] == "chunk"}
    acked = {q for a in lines(sdir / "acks.jsonl") if a["type"] == "ack" for q in a["seqs"]}
    assert len(announced) == n and acked == announced
    deleted = lines(sdir / "deleted.jsonl")
    assert deleted and all(not (rd / d["path"]).exists() for d in deleted)
    assert (out / "disk.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
