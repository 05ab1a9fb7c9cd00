"""The in-flight window, in tokens as well as requests, and the server's running limit.

``client.tokens_in_flight``, ``client.requests_in_flight`` and
``server.max_running_requests`` may each be ``auto``: derived here from the merged
records' lengths (``merged/stats.json``), per DP worker (hsextract.dp scales them).

Why tokens (issue 40): a window counted in requests suits one record length.  The same 16
requests a sending turn that keep an 8B server's queue full with ~550-token records (each
8,192-token extend pass packs ~15) leave it empty with ~130-token chat turns: on the H200,
4 turns x 16 requests gave SGLang ~1,455-token passes, its queue empty in 1,027 of 1,031
passes, 0.749 of the bare server.  What keeps a server fed is tokens queued, not requests:
so a turn keeps as many requests in flight as ``TURN_PASSES`` extend passes take of a
typical record (``requests``: the median length, or the mean where lower; within bounds),
and a token window (``tokens``) that holds those requests at the mean length, within
``TURN_PASSES``-``MAX_TURN_PASSES`` passes.  Short records then get many requests, long
ones few, for the same queue.  The token window is counted in the mean because a window of
``TURN_PASSES`` passes bound before the request window wherever the median is below the
mean: a turn of chat turns (median 101, mean 129) held ~127 of its 163 requests, fewer
than the bare server it is compared with keeps in flight.  A mix of short and long records
gets the short ones' count, the token window's cap holding the long ones back.

Why the server's limit follows (``max_running_requests``): past it a request only waits in
SGLang's queue with its timeout running, and the client never sends more than it
(``client._Window``'s cap); below the window it would cap the window.  So ``auto`` is
what every turn's window together can hold: ``requests x client.sending_jobs``.  SGLang's
own default is memory-based and far larger; a set value wins (the cap follows it).

``tokens_in_flight: auto`` with a set ``requests_in_flight`` is no token limit: the set
request window stays what it was (configs tuned in requests, tests that batch N requests).

Nothing here reaches a chunk's content or the fingerprint: the window decides only when a
record is sent, never which records share a chunk (hsextract.sizing).  The derived running
limit is a launch flag (``--max-running-requests``): the launch settings file keeps the
configured ``auto`` (nothing reruns for it), while the server's recorded settings carry the
value (``server.spec_settings``), so a live server started for other lengths is replaced.
``launch_server`` runs after the merge and the split, so the stats it derives from are the
run's.  Where they are not there yet (``hsextract server
command`` before the data stage), ``ASSUMED_MEAN_TOKENS`` stands in and the description
says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from hsextract.config import run_dir
from hsextract.config_types import Config
from hsextract.errors import ConfigError

#: What a sending turn's request window is counted to fill, and the least its derived token
#: window holds, in the server's extend passes (chunked_prefill_size) per DP worker.  Two:
#: while one pass runs, the next is queued whole, and the turns together
#: queue ``TURN_PASSES x sending_jobs`` passes, which outlasts the client's per-request
#: time (a response's pieces read, checked and written) that starved the server in issue 40.
TURN_PASSES = 2
#: The most a derived token window grows, in passes, to hold its request window of
#: mean-length records (``choose``): a skewed mix (median below the mean) gets the
#: requests of its median and the tokens of its mean, where a bimodal one (chat turns and
#: documents) would otherwise let the documents fill the queue many times over.
MAX_TURN_PASSES = 4
#: Bounds of a derived request window (per turn, per DP worker): at least two, so a
#: response's handling overlaps the next request even for records longer than the token
#: window; at most 256, a chunk job's threads (one per request in flight) and connections.
MIN_REQUESTS = 2
MAX_REQUESTS = 256
#: The mean record length assumed before the merge has counted them (``hsextract server
#: command`` on a fresh run): ShareGPT's ~550, rounded down (more requests, the safe side
#: for the queue; the token window still bounds the bytes).
ASSUMED_MEAN_TOKENS = 512
#: The pass size a token window is counted in when chunked prefill is off (-1).
UNCHUNKED_PASS_TOKENS = 8192


@dataclass(frozen=True)
class Lengths:
    """Record lengths the window is derived from, and where they come from."""

    mean: float
    p50: float | None
    p99: float | None
    records: int
    source: str

    @property
    def typical(self) -> float:
        """The length the request window is counted in: the median where it is below the
        mean (a mix of chat turns and long documents: the turns need the requests, and the
        token window holds the documents back), else the mean."""
        return min(self.mean, self.p50) if self.p50 else self.mean


def merged_lengths(stats_path: Path) -> Lengths | None:
    """The merge's length statistics (stats.json ``length``), or None before the merge."""
    try:
        stats = json.loads(Path(stats_path).read_text())
        length = stats["length"]
        mean, p50, p99 = float(length["mean"]), float(length["p50"]), float(length["p99"])
        records = int(stats["records_out"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{stats_path}: no record length statistics ({type(exc).__name__}: {exc}); "
            "rerun the merge (merge_and_shuffle) or set client.requests_in_flight, "
            "client.tokens_in_flight and server.max_running_requests to numbers"
        ) from None
    if records < 1 or mean <= 0:
        return None
    return Lengths(mean=mean, p50=p50, p99=p99, records=records, source=str(stats_path))


@dataclass(frozen=True)
class InFlight:
    """The window one sending turn keeps per DP worker, and the server's running limit per
    DP worker; ``derived`` names the keys that were ``auto``."""

    tokens: int | None
    requests: int
    max_running: int
    lengths: Lengths | None
    derived: tuple[str, ...]
    pass_tokens: int

    def describe(self, dp: int = 1) -> str:
        """One line: what was chosen, and from what (``hsextract plan``, snakemake)."""

        def how(key: str) -> str:
            return "auto" if key in self.derived else "set"

        per = " per DP worker" if dp > 1 else ""
        if self.lengths is None:
            src = f"no merged stats yet: a mean of {ASSUMED_MEAN_TOKENS} tokens assumed"
        else:
            n = self.lengths
            p50 = f"p50 {n.p50:,.0f}, " if n.p50 is not None else ""
            p99 = f", p99 {n.p99:,.0f}" if n.p99 is not None else ""
            src = f"{p50}mean {n.mean:,.0f} tokens{p99}, {n.records:,} records, {n.source}"
        running = how("server.max_running_requests")
        if "server.max_running_requests" in self.derived:
            running += ": requests x client.sending_jobs"
        if self.tokens is None:
            tokens = "no token limit (client.tokens_in_flight auto, client.requests_in_flight set)"
        elif "client.tokens_in_flight" in self.derived and self.lengths is None:
            tokens = (
                f"{self.tokens:,} tokens (client.tokens_in_flight auto: {TURN_PASSES} x "
                f"{self.pass_tokens:,}-token passes)"
            )
        elif "client.tokens_in_flight" in self.derived:
            tokens = (
                f"{self.tokens:,} tokens (client.tokens_in_flight auto: the requests at the "
                f"mean length, within {TURN_PASSES}-{MAX_TURN_PASSES} x "
                f"{self.pass_tokens:,}-token passes)"
            )
        else:
            tokens = f"{self.tokens:,} tokens (client.tokens_in_flight set)"
        return (
            f"in flight per sending turn{per}: {tokens}, {self.requests} requests "
            f"(client.requests_in_flight {how('client.requests_in_flight')}); "
            f"server.max_running_requests {self.max_running} "
            f"({running}); "
            f"from {src}"
        )

    def worst_case_requests(self, max_len: int) -> int:
        """Requests of ``max_len`` tokens a turn can hold at once (per DP worker): the
        request window, or fewer where the token window admits fewer (always one)."""
        if max_len <= 0 or self.tokens is None:
            return self.requests
        return max(1, min(self.requests, self.tokens // max_len))


def _setting(value: object, key: str) -> int | None:
    """A positive int, or None for ``auto``."""
    if value == "auto":
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key} must be an integer >= 1 or auto, got {value!r}")
    return value


def choose(cfg: Config, lengths: Lengths | None) -> InFlight:
    """The window for records of ``lengths`` (None: not known yet)."""
    cps = cfg.server.chunked_prefill_size
    pass_tokens = cps if cps > 0 else UNCHUNKED_PASS_TOKENS
    derived = []
    set_tokens = _setting(cfg.client.tokens_in_flight, "client.tokens_in_flight")
    requests = _setting(cfg.client.requests_in_flight, "client.requests_in_flight")
    # auto tokens with a set request window: none, that window as it always was (a config
    # tuned in requests, or a test batching N requests, is not cut by a token limit).
    tokens = set_tokens
    if set_tokens is None:
        derived.append("client.tokens_in_flight")
        if requests is None:
            tokens = TURN_PASSES * pass_tokens
    if requests is None:
        typical = lengths.typical if lengths is not None else ASSUMED_MEAN_TOKENS
        target = tokens if tokens is not None else TURN_PASSES * pass_tokens
        requests = min(MAX_REQUESTS, max(MIN_REQUESTS, math.ceil(target / typical)))
        derived.append("client.requests_in_flight")
        if set_tokens is None and lengths is not None:
            # The request window was counted in the median; the tokens those requests
            # carry on average are the mean's.  A token window of only TURN_PASSES passes
            # then binds before the request window does, and the turn holds fewer requests
            # than the bare server it is compared with (issue 40: chat turns, median 101,
            # mean 129, held ~127 of 163).
            held = math.ceil(requests * lengths.mean)
            tokens = min(MAX_TURN_PASSES * pass_tokens, max(tokens, held))
    running = _setting(cfg.server.max_running_requests, "server.max_running_requests")
    if running is None:
        running = requests * cfg.client.sending_jobs
        derived.append("server.max_running_requests")
    return InFlight(tokens, requests, running, lengths, tuple(derived), pass_tokens)


def for_run(cfg: Config) -> InFlight:
    """The window of the config's run: from its merged stats where the merge has run.
    Every reader (the launch, the chunk jobs, the preflight, ``hsextract plan``) asks here,
    so they agree."""

    return choose(cfg, merged_lengths(run_dir(cfg) / "merged" / "stats.json"))
