"""``n_chunks: auto`` (issue 34): chunks sized from the inputs' tokens and ``chunk_tokens``
(never a throughput setting: issue 38), a count that small data changes do not move, said
by `hsextract plan` and at planning; a bare number still works."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml
from fixtures_demo import own_config, planned_jobs, snakemake_cmd
from hypothesis import given, settings
from hypothesis import strategies as st

from hsextract.config import read_config, typed
from hsextract.datasize import cache_dir, count_tokens, input_size
from hsextract.settings import SETTINGS, kinds_with
from hsextract.sizing import (
    MAX_CHUNK_TOKENS,
    MIN_CHUNK_TOKENS,
    auto_chunks,
    chunk_count,
    chunk_sizing,
)

REPO = Path(__file__).resolve().parents[1]
PROD = read_config(REPO / "configs" / "qwen3-8b-1xh200.yaml")


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 10**9), st.integers(1, 10**6))
def test_auto_chunks_stay_within_bounds(tokens, records):
    s = auto_chunks(PROD, tokens, records)
    assert 1 <= s.n_chunks <= records
    assert s.n_chunks & (s.n_chunks - 1) == 0 or s.n_chunks == records  # a power of two
    per = tokens / s.n_chunks
    assert per <= max(MAX_CHUNK_TOKENS, tokens / records)  # never above the cap ...
    if s.n_chunks > 1:  # ... and, once split, never below half the target
        assert per >= s.target_tokens / 2 - 1 or s.n_chunks == records
    assert MIN_CHUNK_TOKENS <= s.target_tokens <= MAX_CHUNK_TOKENS


@settings(max_examples=200, deadline=None)
@given(st.integers(10**5, 10**9))
def test_a_few_more_records_rarely_move_the_count(tokens):
    """Records go to chunks by hash mod the count: a new count re-extracts everything.  Adding
    0.1% of tokens moves a power-of-two count only within 0.1% of a boundary."""
    records = max(1, tokens // 500)
    a = auto_chunks(PROD, tokens, records).n_chunks
    b = auto_chunks(PROD, int(tokens * 1.001), records + records // 1000).n_chunks
    if a != b:
        target = auto_chunks(PROD, tokens, records).target_tokens
        boundary = 2 ** (round(__import__("math").log2(tokens / target)) + 0.5)
        assert abs(tokens / target / boundary - 1) < 0.01


def test_count_tokens_follows_the_length_policy(tmp_path):
    f = tmp_path / "a.jsonl"
    lines = [
        {"input_ids": list(range(10)), "loss_mask": [1] * 10},
        {"input_ids": list(range(3)), "loss_mask": [1] * 3},
        "not json",
        {"input_ids": "nope"},
        {"input_ids": list(range(7)), "loss_mask": [1] * 7},
    ]
    f.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n\n")
    assert count_tokens([str(f)], 100, "truncate") == (3, 20)
    assert count_tokens([str(f)], 5, "truncate") == (3, 13)
    assert count_tokens([str(f)], 5, "drop") == (1, 3)


def test_auto_is_the_default_and_counts_once_per_version_of_the_inputs(
    demo_run, tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    raw = own_config(demo_run, tmp_path)
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = read_config(path)
    assert cfg.n_chunks == "auto"
    sizing = chunk_sizing(cfg)
    records = sum(len(Path(p).read_text().splitlines()) for p in sorted(
        (demo_run["workdir"] / "results" / "demo" / "data").glob("shard_*.jsonl")))  # fmt: skip
    assert sizing.n_records == records and sizing.total_tokens > 0
    assert chunk_count(cfg) == sizing.n_chunks == 1  # 48 records: below one chunk's minimum
    cached = list(cache_dir().glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["tokens"] == sizing.total_tokens
    assert not (tmp_path / "out").exists()  # nothing where runs live
    # Small chunks make several: the count is what auto_chunks says for those tokens.
    smaller = read_config(path, {"chunk_tokens": 2048})
    assert chunk_count(smaller) == auto_chunks(smaller, sizing.total_tokens, records).n_chunks
    # A bare number still works, and counts nothing.
    assert chunk_count(read_config(path, {"n_chunks": 3})) == 3
    assert input_size(cfg, list(cfg.inputs and [str(p) for p in sorted(
        (demo_run["workdir"] / "results" / "demo" / "data").glob("shard_*.jsonl"))]),
        write_cache=False) == (sizing.n_records, sizing.total_tokens)  # fmt: skip


def test_plan_and_the_workflow_say_the_size_auto_chose(demo_run, tmp_path):
    raw = own_config(demo_run, tmp_path)
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        snakemake_cmd(tmp_path, "-n", "extract_all", "--configfile", str(path)),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = re.search(r"hsextract: n_chunks: auto -> (\d+) chunks of ~([\d,]+) tokens", proc.stderr)
    assert said, proc.stderr[-3000:]
    n = int(said.group(1))
    assert planned_jobs(proc.stdout)["extract_chunk"] == n
    cli = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "plan", "--configfile", str(path)],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert cli.stdout.startswith(f"n_chunks: auto -> {n} chunks of ~{said.group(2)} tokens")


#: Throughput settings at extremes, beyond their samples: none may move the split.
EXTREMES = {
    "client.requests_in_flight": 1024,
    "client.sending_jobs": 64,
    "sglang.dp_size": 8,
    "server.max_running_requests": 8192,
    "server.chunked_prefill_size": 16384,
}


def _with(cfg: dict, key: str, value) -> dict:
    node = cfg
    *parents, last = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return cfg


def test_auto_moves_only_with_the_records_and_chunk_tokens():
    """Issue 38, item 6: on 51ef369 ``client.requests_in_flight`` 8 -> 64 (a "neither" key)
    made auto choose 1 chunk instead of 2, re-extracting the whole run.  Every key whose
    declared kind is not "chunk content" is changed to its sample (the throughput ones to
    extremes too), with either engine, on an auto-sized run of several chunks: the count,
    and so the split, stays."""
    import copy

    base_raw = yaml.safe_load((REPO / "config.yaml").read_text())
    base_raw.update(n_chunks="auto")
    base_raw["demo"]["n_records"] = 4000  # the demo's auto counts its recipe: ~2 M tokens
    moved = []
    for engine in ("reference", "sglang"):
        base = _with(copy.deepcopy(base_raw), "engine", engine)
        want = chunk_count(typed(base))
        assert want > 2
        for s in SETTINGS.values():
            if "chunk content" in kinds_with(s, engine) or s.key in ("engine", "demo.enabled"):
                continue
            changed = copy.deepcopy(base)
            for k, v in {**s.sample_with, s.key: s.sample}.items():
                _with(changed, k, copy.deepcopy(v))
            if chunk_count(typed(changed)) != want:
                moved.append(f"{s.key}={s.sample!r} ({engine})")
        extreme = copy.deepcopy(base)
        for k, v in EXTREMES.items():
            _with(extreme, k, v)
        if chunk_count(typed(extreme)) != want:
            moved.append(f"throughput settings at extremes ({engine})")
    assert not moved, f"the chunk count moved with: {moved}"
    # What does move it: chunk_tokens (its kind says so) and the records.
    assert chunk_count(typed({**base_raw, "chunk_tokens": 16384})) > chunk_count(typed(base_raw))
