"""``n_chunks: auto``: how many chunks, from the data's tokens and a fixed target.

The count decides which records share a chunk (a hash mod the count), so it may depend on
nothing but the records and an explicit ``chunk_tokens``: a throughput setting that moved
it (``client.requests_in_flight`` 8 -> 64 once halved the count, issue 38) re-extracted a
whole run for a knob the settings table says changes nothing.  The target below is the
default of ``chunk_tokens``; a node of DP workers, whose server does the same work in less
time, can ask for larger chunks with it (``hsextract plan`` says so).

Why a chunk has a lower bound: each chunk job pays a fixed cost outside its sending that
the other jobs' chunks must cover, or SGLang's queue runs dry.  Measured on the H200
(issue 34, bench/README.md "Race": Llama-3.1-8B's shape, 4 aux layers, -j8, 4 sending
turns): Snakemake's dispatch 0.6-0.8 s, the process start and imports (torch) 3.8-4.5 s,
the chunk's records 0.3 s, then after its last request is sent a window's drain (2.5-2.9
s, which still feeds the server) and fsync + sha256 + check (0.5 s per ~47k tokens).
With ~47k-token chunks (1.5 s of the server's work each) the turns stood vacant 42 % of
the sending phase; ~141k-token chunks (4.4 s), 7.5 %.  Since then the jobs holding a turn
also send for the vacant ones (``client._Window``), so a chunk only has to outlast that
fixed cost with the other jobs' help; a chunk of ``SECONDS_PER_CHUNK`` of the server's work
keeps a margin of ~3x over what the 47k-token race still sustained.

Why an upper bound: a failed chunk is redone whole, and its file's finish (fsync, sha256:
~1 s per GB) after the last response is the run's tail.  A chunk of less than one in-flight
window goes out whole at once and spends its life draining: ``hsextract plan`` warns then
(:func:`advice`), but never changes the count for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hsextract.config import input_shards
from hsextract.config_types import Config
from hsextract.datasize import input_size
from hsextract.window import InFlight, Lengths, choose, for_run

#: What one DP worker is assumed to prefill, tokens/s: an 8B target on one H200 (32-36k
#: bare in the race).  A slower server (a larger model) makes each chunk last longer, the
#: safe side; a much faster one would want larger chunks than ``auto`` gives.
RATE_TOK_S = 36_000
#: The default target: this many seconds of one DP worker's work at RATE_TOK_S.
SECONDS_PER_CHUNK = 4.0
#: Bounds of any target, ``chunk_tokens`` included: below, a chunk job's fixed cost
#: dominates; above, a failed chunk's redo and its file's finish are the run's tail.
MIN_CHUNK_TOKENS = 1_024
MAX_CHUNK_TOKENS = 4_194_304
#: ``chunk_tokens: null``.
DEFAULT_TARGET_TOKENS = int(SECONDS_PER_CHUNK * RATE_TOK_S)


@dataclass(frozen=True)
class ChunkSizing:
    """What ``auto`` chose, and from what: ``hsextract plan`` and the split report it."""

    n_chunks: int
    target_tokens: int
    total_tokens: int
    n_records: int

    def describe(self) -> str:
        per = self.total_tokens / self.n_chunks if self.n_chunks else 0
        return (
            f"n_chunks: auto -> {self.n_chunks} chunks of ~{per:,.0f} tokens "
            f"({self.total_tokens:,} tokens in {self.n_records:,} records; target "
            f"{self.target_tokens:,} tokens a chunk (chunk_tokens); a power of two)"
        )


def target_chunk_tokens(cfg: Config) -> int:
    """``chunk_tokens``, or the default, within the bounds."""
    want = cfg.chunk_tokens if cfg.chunk_tokens is not None else DEFAULT_TARGET_TOKENS
    return int(min(MAX_CHUNK_TOKENS, max(MIN_CHUNK_TOKENS, want)))


def auto_chunks(cfg: Config, total_tokens: int, n_records: int) -> ChunkSizing:
    """The chunk count for ``total_tokens`` in ``n_records`` (after truncation/drop).

    A power of two, the nearest to ``total / target`` in log scale (chunks of 0.71 - 1.41
    targets): records go to chunks by a hash mod the count, so a new count re-extracts
    everything, and a few more records move a power of two only near a boundary.  Doubled
    while a chunk would exceed MAX_CHUNK_TOKENS; never more chunks than records."""
    target = target_chunk_tokens(cfg)
    ratio = total_tokens / target
    n = 2 ** round(math.log2(ratio)) if ratio > 1 else 1
    while total_tokens / n > MAX_CHUNK_TOKENS and n < n_records:
        n *= 2
    n = max(1, min(n_records, n)) if n_records else 1
    return ChunkSizing(n, target, total_tokens, n_records)


def advice(cfg: Config, sizing: ChunkSizing) -> list[str]:
    """What the throughput settings suggest about the chunk size, said and never applied:
    a chunk shorter than SECONDS_PER_CHUNK of the whole server's work (DP workers finish it
    sooner), or smaller than the requests every sending job keeps in flight."""
    out = []
    per = sizing.total_tokens / sizing.n_chunks if sizing.n_chunks else 0
    dp = cfg.sglang.dp_size
    want = SECONDS_PER_CHUNK * RATE_TOK_S * dp
    if sizing.n_chunks > 1 and per < want / 2:
        out.append(
            f"chunks of ~{per:,.0f} tokens are ~{per / (RATE_TOK_S * dp):.1f} s of a "
            f"{dp}-worker server's work at {RATE_TOK_S:,} tok/s a worker; for ~"
            f"{SECONDS_PER_CHUNK:g} s set chunk_tokens: {int(want):,} (a new split: every "
            "chunk is extracted again)"
        )
    mean = sizing.total_tokens / sizing.n_records if sizing.n_records else 0
    win = in_flight(cfg, sizing)
    per_turn = win.requests * mean if win.tokens is None else min(win.tokens, win.requests * mean)
    window = win.sending.jobs * dp * per_turn
    if sizing.n_chunks > 1 and per < window:
        out.append(
            f"a chunk (~{per:,.0f} tokens) is smaller than the requests the sending jobs "
            f"keep in flight (~{window:,.0f} tokens): each goes out whole at once; larger "
            "chunks (chunk_tokens) keep the server's queue fuller"
        )
    return out


def in_flight(cfg: Config, sizing: ChunkSizing | None) -> InFlight:
    """The in-flight window (hsextract.window): from the merged stats, what the launch and
    the chunk jobs use; before the merge, from the inputs' count that sized the chunks."""
    win = for_run(cfg)
    if win.lengths is None and sizing is not None and sizing.n_records:
        mean = sizing.total_tokens / sizing.n_records
        src = "the inputs' count (the merge's stats replace it)"
        lengths = Lengths(mean=mean, p50=None, p99=None, records=sizing.n_records, source=src)
        win = choose(cfg, lengths, workflow_jobs=win.sending.workflow_jobs)
    return win


def sizing_report(cfg: Config, sizing: ChunkSizing | None) -> list[str]:
    """What ``auto`` chose, then its advice, then the sending jobs and the in-flight
    window: the lines ``hsextract plan`` and every ``snakemake`` invocation print."""
    lines = [] if sizing is None else [sizing.describe()]
    lines += [f"  note: {line}" for line in (advice(cfg, sizing) if sizing else [])]
    win = in_flight(cfg, sizing)
    return [*lines, win.sending.describe(), win.describe(cfg.sglang.dp_size)]


def chunk_sizing(cfg: Config, *, write_cache: bool = True) -> ChunkSizing | None:
    """What ``n_chunks: auto`` resolves to (None for a number): sized from the inputs'
    tokens (hsextract.datasize, counted once per version of the inputs) and the server's
    in-flight window (hsextract.sizing).  The demo's shards do not exist before its first
    job, so its count comes from its recipe (n_records records of up to max_seq_len)."""
    if cfg.n_chunks != "auto":
        return None
    if cfg.demo.enabled:
        records, tokens = cfg.demo.n_records, cfg.demo.n_records * cfg.max_seq_len
    else:
        records, tokens = input_size(cfg, input_shards(cfg), write_cache=write_cache)
    return auto_chunks(cfg, tokens, records)


def chunk_count(cfg: Config, *, write_cache: bool = True) -> int:
    """How many chunk files the records are split into: ``n_chunks``, or what ``auto``
    resolves to (:func:`chunk_sizing`).  Every reader of the count asks here."""
    sizing = chunk_sizing(cfg, write_cache=write_cache)
    return int(cfg.n_chunks) if sizing is None else sizing.n_chunks
