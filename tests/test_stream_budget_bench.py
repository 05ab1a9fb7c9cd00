"""The train-while-extracting bench (issue 39, bench/stream_budget.py) on the CPU: the
reference engine and the demo's tiny model, the same passes as on the H200 (no budget,
the consumer alone on the chunks that run kept, then a budget with a consumer acking as
it reads).  Nothing is timed here: the rates and ratios are the bench's (bench/README.md,
"Train while extracting"); what is asserted are the invariants it reports, recomputed
from the files the runs left, and that its ratios are made of its figures."""

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
    r" producer_GBps (\S+) consumer_GBps (\S+) stream_GBps (\S+)"
    r" stream/smaller (\d+\.\d{3}) \(goal 0\.95: (met|unmet)\)"
)
#: Below the demo run's 3.5 MB of chunks, above its largest (0.58 MB): the run without a
#: budget keeps some of its chunks whole for the consumer alone and punches the others.
KEEP_GB = 0.0012


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.workflow
def test_quick_bench_reads_every_record_once_within_the_budget(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    try:
        proc = subprocess.run(
            [sys.executable, str(REPO / "bench" / "stream_budget.py"), "--quick", "--engine",
             "reference", "--work", str(work), "--out", str(out), "--budget-s", "1500",
             "--consumer-alone-gb", str(KEEP_GB), "--consumer-alone-s", "300"],
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

    # The consumer alone read the chunks the run without a budget kept whole (under the
    # cap; the others punched), every record of them exactly once, each chunk hashed
    # against the sha256 its writer took (a mismatch is a nack, and a nacked chunk is not
    # read).
    kept = none["reclaim"]["kept"]
    assert 0 < len(kept) < n and none["reclaim"]["punched"] == n - len(kept)
    assert none["reclaim"]["kept_bytes"] <= KEEP_GB * 1e9
    ca = report["consumer_alone"]
    assert ca["rc"] == 0 and not ca["stopped_at_limit"]
    rd_none = Path(none["run_dir"])
    given: Counter = Counter()
    for c in kept:
        given.update(json.loads(x)["id"] for x in (rd_none / "chunks" / f"{c}.jsonl").open())
    alone = json.loads((work / "consumer-alone.json").read_text())
    assert Counter(alone["ids"]) == given
    assert ca["records_read"] == ca["records_given"] == given.total()
    assert ca["every_record_once"] and s["checks"]["consumer_alone_read_once"]
    sidecars = {c: json.loads((rd_none / "hidden" / f"{c}.json").read_text()) for c in kept}
    adir = work / "consumer-alone" / "stream"
    journal = [c for c in lines(adir / "journal.jsonl") if c["type"] == "chunk"]
    assert sorted(c["chunk"] for c in journal) == sorted(kept)
    assert all(c["sha256"] == sidecars[c["chunk"]]["sha256"] for c in journal)
    acks = lines(adir / "acks.jsonl")
    assert not [a for a in acks if a["type"] == "nack"]
    assert {q for a in acks if a["type"] == "ack" for q in a["seqs"]} == {c["seq"] for c in journal}
    assert ca["chunks_read"] == len(kept) and ca["sha256_as_sidecar"] and ca["nacks"] == 0
    assert not (work / "consumer-alone" / "hidden").exists()  # the links went with the chunks
    assert alone["raw_bytes"] == alone["tokens"] * report["raw_bytes_per_token"]

    # The three rates, positive, and the ratio made of them: GB/s of raw states, the
    # producer's and the stream's from their runs' sending rates.
    rates, bpt = s["rates"], report["raw_bytes_per_token"]
    prod = rates["producer_alone"]["raw_gb_s"]
    cons = rates["consumer_alone"]["raw_gb_s"]
    stream = rates["stream"]["raw_gb_s"]
    assert prod > 0 and cons > 0 and stream > 0
    assert prod == pytest.approx(none["sending_tok_s"] * bpt / 1e9, rel=1e-3)
    assert stream == pytest.approx(budget["sending_tok_s"] * bpt / 1e9, rel=1e-3)
    span = alone["last_at"] - alone["first_at"]
    assert cons == pytest.approx(alone["raw_bytes"] / span / 1e9, rel=1e-3)
    per_worker = rates["consumer_alone"]["raw_gb_s_per_worker"]
    assert per_worker == pytest.approx(cons / alone["workers"], rel=2e-3)
    assert rates["consumer_alone"]["records_s"] > 0
    assert rates["stream_of_smaller"] == pytest.approx(stream / min(prod, cons), rel=2e-3)
    assert rates["smaller"] == ("producer" if prod <= cons else "consumer")
    met = rates["stream_of_smaller"] >= 0.95
    assert rates["met"] == met == s["checks"]["stream_ge_0.95_of_smaller"]
    assert [float(x) for x in last.group(5, 6, 7)] == pytest.approx([prod, cons, stream], rel=1e-3)
    assert float(last.group(8)) == pytest.approx(rates["stream_of_smaller"], abs=1e-3)
    assert last.group(9) == ("met" if met else "unmet")
