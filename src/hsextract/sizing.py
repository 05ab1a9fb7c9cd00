"""``n_chunks: auto``: how many chunks, from the data's tokens and the server's window.

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
~1 s per GB) after the last response is the run's tail.  Why ``MIN_WINDOWS``: a chunk of
less than one in-flight window goes out whole at once and spends its life draining.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hsextract.config_types import Config

#: What one DP worker is assumed to prefill, tokens/s: an 8B target on one H200 (32-36k
#: bare in the race).  A slower server (a larger model) makes each chunk last longer, the
#: safe side; a much faster one would want larger chunks than ``auto`` gives.
RATE_TOK_S = 36_000
#: A chunk holds at least this many seconds of the server's work (at RATE_TOK_S x dp).
SECONDS_PER_CHUNK = 4.0
#: ... and at least this many of the server's in-flight windows (every sending job's
#: requests in flight, per DP worker, times the mean record).
MIN_WINDOWS = 1
#: ... and at least this many tokens, whatever the window (small records, few in flight).
MIN_CHUNK_TOKENS = 65_536
#: ... and at most this many (a redone chunk's cost; its file's size and finish).
MAX_CHUNK_TOKENS = 4_194_304


@dataclass(frozen=True)
class ChunkSizing:
    """What ``auto`` chose, and from what: ``hsextract plan`` and the split report it."""

    n_chunks: int
    target_tokens: int
    window_tokens: int
    total_tokens: int
    n_records: int

    def describe(self) -> str:
        per = self.total_tokens / self.n_chunks if self.n_chunks else 0
        return (
            f"n_chunks: auto -> {self.n_chunks} chunks of ~{per:,.0f} tokens "
            f"({self.total_tokens:,} tokens in {self.n_records:,} records; target "
            f"{self.target_tokens:,} tokens: the larger of {SECONDS_PER_CHUNK:g} s of the "
            f"server's work at {RATE_TOK_S:,} tok/s per DP worker and {MIN_WINDOWS}x its "
            f"in-flight window of {self.window_tokens:,} tokens, within "
            f"[{MIN_CHUNK_TOKENS:,}, {MAX_CHUNK_TOKENS:,}]; a power of two)"
        )


def in_flight_window_tokens(cfg: Config, mean_record_tokens: float) -> int:
    """Tokens the server holds when every sending job keeps its requests in flight."""
    requests = cfg.client.sending_jobs * cfg.client.requests_in_flight * cfg.sglang.dp_size
    return max(1, round(requests * mean_record_tokens))


def target_chunk_tokens(cfg: Config, window_tokens: int) -> int:
    work = SECONDS_PER_CHUNK * RATE_TOK_S * cfg.sglang.dp_size
    return int(min(MAX_CHUNK_TOKENS, max(MIN_CHUNK_TOKENS, work, MIN_WINDOWS * window_tokens)))


def auto_chunks(cfg: Config, total_tokens: int, n_records: int) -> ChunkSizing:
    """The chunk count for ``total_tokens`` in ``n_records`` (after truncation/drop).

    A power of two, the nearest to ``total / target`` in log scale (chunks of 0.71 - 1.41
    targets): records go to chunks by a hash mod the count, so a new count re-extracts
    everything, and a few more records move a power of two only near a boundary.  Doubled
    while a chunk would exceed MAX_CHUNK_TOKENS; never more chunks than records."""
    mean = total_tokens / n_records if n_records else 0.0
    window = in_flight_window_tokens(cfg, mean)
    target = target_chunk_tokens(cfg, window)
    ratio = total_tokens / target
    n = 2 ** round(math.log2(ratio)) if ratio > 1 else 1
    while total_tokens / n > MAX_CHUNK_TOKENS and n < n_records:
        n *= 2
    n = max(1, min(n_records, n)) if n_records else 1
    return ChunkSizing(n, target, window, total_tokens, n_records)
