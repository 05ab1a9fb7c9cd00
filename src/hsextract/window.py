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

Why the number of sending jobs is derived too (``client.sending_jobs: auto``): a chunk job
is one Python process, and what it spends on each record -- a fixed cost a request (the
HTTP round trip, its pieces found and opened, the window's and the budget's turnover,
thread hand-offs) and a cost a byte of states (read, checked, written, hashed) -- is time
its requests wait inside it with their place in the window held.  Four turns kept the
server fed where that cost a token was low (on an H100: ShareGPT-like records on an 8B
with three aux layers, 0.988 of the bare server; bimodal, 0.986; long records, 0.997),
not with chat turns (mean 129 tokens, 5 aux layers of a 7B: 0.887), whose cost a token is
about twice: the same window over 8 turns gave 0.966.  So ``auto`` is ``REF_SENDING_JOBS`` scaled by
the records' cost a token over the reference's (:func:`sending_jobs`), and the window a
turn is the reference's four turns' split over them (``x REF_SENDING_JOBS / jobs``): the
turns together queue what four queued, only handled by more processes.  A set count wins,
with the window a turn as it always was.

Within Snakemake's ``-j``: a workflow that runs at most N jobs at once cannot have more
than N sending; the workflow exports N (``WORKFLOW_JOBS_ENV``, rules/common.smk) and
where it is below the derived count the chunk jobs take it, the window split over it.
Never below ``REF_SENDING_JOBS``: fewer turns than jobs are harmless (a job holding a
turn takes the share of those nobody holds, ``client._Window``), and four turns of the
reference's window are what every run had before.  ``hsextract plan`` has no ``-j``: it
says the derived count and that a ``-j`` below it caps it.

Why the server's limit follows (``max_running_requests``): past it a request only waits in
SGLang's queue with its timeout running, and the client never sends more than it
(``client._Window``'s cap); below the window it would cap the window.  So ``auto`` is
what every turn's window together can hold: ``requests x client.sending_jobs``, with a
derived count that of the split before ``-j`` (a launch flag that moved with ``-j`` would
replace a live server for a one-chunk redo at ``-j1``).  SGLang's own default is
memory-based and far larger; a set value wins (the cap follows it).

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
import os
from dataclasses import dataclass
from pathlib import Path

from hsextract.budget import bytes_per_token
from hsextract.config import captured_layers, read_model_config, run_dir
from hsextract.config_types import Config
from hsextract.errors import ConfigError, HsextractError

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

#: The sending jobs the shipped window was measured with: good (>= 0.986 of the bare
#: server) on every cell of the rate table whose cost a token is at or below the
#: reference's below (bench/tables/rate_table_h100.csv).  Also the least ``auto``
#: derives: fewer was never measured.
REF_SENDING_JOBS = 4
#: The most ``auto`` derives: the hosts it was measured on have 16 cores, a sending job of
#: the chat cell took ~1.6 of them (bench/README.md, "One H100 host, five calls": 6.44
#: cores over 4 jobs) beside the server's scheduler; and at 16 a turn's window is half an
#: extend pass already.
MAX_SENDING_JOBS = 16
#: The reference the four turns were measured good on (bench/tables/rate_table_h100.csv,
#: sharegpt-8b-3aux: Qwen3-8B, hidden 4096, EAGLE-3's three aux layers, bf16, records of
#: mean 529 tokens, 0.988 of the bare server).  Its length is ASSUMED_MEAN_TOKENS, just
#: below the cell's 529, so that shape before the merge derives exactly four.
REF_MEAN_TOKENS = ASSUMED_MEAN_TOKENS
REF_HIDDEN, REF_AUX, REF_DTYPE = 4096, 3, "bfloat16"
#: A sending job's cost a MB (10^6 bytes) of captured states, ms: the client's CPU a MB on
#: the 16-core device, 2.7-3.1 (bench/README.md, "Client ceiling": 128- and 2,048-token
#: records, 3 and 6 aux layers of 4096).
MS_PER_MB = 3.0
#: A sending job's cost a request, ms, whatever its length.  Not its CPU alone (~2-5 ms
#: on the stub server: bench/README.md "Client ceiling", "CPU per MB"): on the live chat
#: cell 404 of its 652 requests in flight waited inside the jobs after their pieces were
#: in (bench/README.md, "One H100 host, five calls"), each job's requests queued behind
#: one another.  So this is the live calibration: the value at which the chat cell (mean
#: 129 tokens, 43 KB a token) derives the 8 measured good (0.966 against 0.887 with 4),
#: while the ShareGPT (mean 529, 32.8 KB) and bimodal (mean 1,375, 41 KB) cells, good
#: with 4, keep 4.  From the CPU figures alone the chat cell would get 6, never measured.
MS_PER_REQUEST = 16.0
#: Where the workflow tells its jobs how many it runs at once (Snakemake's -j).
WORKFLOW_JOBS_ENV = "HSEXTRACT_WORKFLOW_JOBS"


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


def captured_bytes_per_token(cfg: Config) -> int | None:
    """Bytes of states a token a chunk job reads, checks, writes and hashes: the size the
    budget's checks count (:func:`hsextract.budget.bytes_per_token`: the aux layers, the
    pre-norm final where captured, the final, the ids and mask).  None where the model's
    config cannot be read yet (a model still to be downloaded); the demo's model is its
    recipe, readable before its first job builds it."""
    if cfg.demo.enabled:
        hidden, layers = cfg.demo.hidden_size, cfg.demo.num_hidden_layers
    else:
        try:
            mcfg = read_model_config(cfg)
            hidden, layers = int(mcfg["hidden_size"]), int(mcfg["num_hidden_layers"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    try:
        return bytes_per_token(hidden, len(captured_layers(cfg, layers)), cfg.model.dtype)
    except HsextractError:  # its own check (the launch, the preflight) says it in a sentence
        return None


def job_ms_per_token(mean_tokens: float, states_bytes_per_token: int) -> float:
    """A sending job's cost a token: its cost a request spread over the mean record (what
    the run's records average per token, whatever their median), plus its cost a byte."""
    return MS_PER_REQUEST / mean_tokens + MS_PER_MB * states_bytes_per_token / 1e6


#: The reference's bytes a token and cost a token, what a run's cost is counted against.
REF_BYTES_PER_TOKEN = bytes_per_token(REF_HIDDEN, REF_AUX, REF_DTYPE)
REF_MS_PER_TOKEN = job_ms_per_token(REF_MEAN_TOKENS, REF_BYTES_PER_TOKEN)


def workflow_jobs_from_env() -> int | None:
    """How many jobs the workflow this process runs in runs at once (its ``-j``), as
    rules/common.smk exports it; None outside a workflow."""
    try:
        n = int(os.environ.get(WORKFLOW_JOBS_ENV) or 0)
    except ValueError:
        return None
    return n if n > 0 else None


@dataclass(frozen=True)
class Sending:
    """How many chunk jobs send at once: the turns they share (``SendingTurn``'s count),
    and what that came from.  ``derived``: ``auto``'s count before ``-j`` (None: set)."""

    jobs: int
    derived: int | None
    workflow_jobs: int | None
    ms_per_token: float | None
    bytes_per_token: int | None
    mean_tokens: float

    @property
    def split(self) -> int | None:
        """The turns an ``auto`` window is split over (None: a set count, whose turns each
        keep the window a turn always had)."""
        return None if self.derived is None else self.jobs

    def describe(self) -> str:
        """One line: the count, and why (``hsextract plan``, the workflow's log)."""
        if self.derived is None:
            return f"sending jobs {self.jobs} (client.sending_jobs set)"
        if self.ms_per_token is None or self.bytes_per_token is None:
            why = (
                f"the reference's {REF_SENDING_JOBS}: the model's config.json is not readable "
                "for its bytes of states a token"
            )
        else:
            raw = REF_SENDING_JOBS * self.ms_per_token / REF_MS_PER_TOKEN
            bounded = (
                f", within {REF_SENDING_JOBS}-{MAX_SENDING_JOBS}"
                if self.derived != math.floor(raw + 0.5)
                else ""
            )
            ratio = self.ms_per_token / REF_MS_PER_TOKEN
            why = (
                f"~{self.ms_per_token:.3f} ms of a sending job's time a token for records of "
                f"mean {self.mean_tokens:,.0f} tokens at {self.bytes_per_token / 1000:.1f} KB of "
                f"states a token, against {REF_MS_PER_TOKEN:.3f} ms for the reference's "
                f"{REF_SENDING_JOBS} (mean {REF_MEAN_TOKENS} tokens, "
                f"{REF_BYTES_PER_TOKEN / 1000:.1f} KB a token): {REF_SENDING_JOBS} x "
                f"{ratio:.2f} = {raw:.1f}{bounded}"
            )
        n = self.workflow_jobs
        if n is not None and n < self.derived:
            least = (
                f", the least (its {n} jobs share the turns none holds)"
                if n < REF_SENDING_JOBS
                else ""
            )
            cap = f"; -j{n} caps it at {self.jobs}{least}, the window split over {self.jobs}"
            return f"sending jobs {self.jobs} (auto {self.derived}: {why}{cap})"
        if n is None and self.derived > REF_SENDING_JOBS:
            why += f"; -j below {self.derived} caps it"
        return f"sending jobs {self.jobs} (auto: {why})"


def sending_jobs(cfg: Config, lengths: Lengths | None, workflow_jobs: int | None = None) -> Sending:
    """``client.sending_jobs``: as set, or ``auto``: ``REF_SENDING_JOBS`` x the records'
    cost a token over the reference's, to the nearest, within ``REF_SENDING_JOBS`` -
    ``MAX_SENDING_JOBS``; then within ``workflow_jobs`` (a workflow's ``-j``), never below
    ``REF_SENDING_JOBS``.  To the nearest, not up: the count scales a measured point, and
    up would add a fifth job for a cost a few percent above the reference's (the bimodal
    cell: 1.04x, measured 0.986 with four)."""
    value = cfg.client.sending_jobs
    mean = lengths.mean if lengths is not None else ASSUMED_MEAN_TOKENS
    if value != "auto":
        n = _setting(value, "client.sending_jobs")
        assert n is not None
        return Sending(n, None, workflow_jobs, None, None, mean)
    bpt = captured_bytes_per_token(cfg)
    if bpt is None:
        derived, ms = REF_SENDING_JOBS, None
    else:
        ms = job_ms_per_token(mean, bpt)
        nearest = math.floor(REF_SENDING_JOBS * ms / REF_MS_PER_TOKEN + 0.5)
        derived = min(MAX_SENDING_JOBS, max(REF_SENDING_JOBS, nearest))
    jobs = derived
    if workflow_jobs is not None:
        jobs = min(derived, max(workflow_jobs, REF_SENDING_JOBS))
    return Sending(jobs, derived, workflow_jobs, ms, bpt, mean)


@dataclass(frozen=True)
class InFlight:
    """The window one sending turn keeps per DP worker, and the server's running limit per
    DP worker; ``derived`` names the keys that were ``auto``; ``sending``: the turns."""

    tokens: int | None
    requests: int
    max_running: int
    lengths: Lengths | None
    derived: tuple[str, ...]
    pass_tokens: int
    sending: Sending

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
        sending = self.sending
        split = sending.split
        # The passes a derived window is counted in are the reference's four turns' share.
        share = ""
        if split and split != REF_SENDING_JOBS:
            share = f" x {REF_SENDING_JOBS}/{split} turns"
        running = how("server.max_running_requests")
        if "server.max_running_requests" in self.derived:
            if sending.derived is None:
                running += ": requests x client.sending_jobs"
            elif sending.derived == sending.jobs:
                running += f": requests x {sending.jobs} sending jobs"
            else:
                running += (
                    f": {self.max_running // sending.derived} requests x {sending.derived} "
                    "sending jobs, the split -j does not move"
                )
        if self.tokens is None:
            tokens = "no token limit (client.tokens_in_flight auto, client.requests_in_flight set)"
        elif "client.tokens_in_flight" in self.derived and self.lengths is None:
            tokens = (
                f"{self.tokens:,} tokens (client.tokens_in_flight auto: {TURN_PASSES} x "
                f"{self.pass_tokens:,}-token passes{share})"
            )
        elif "client.tokens_in_flight" in self.derived:
            tokens = (
                f"{self.tokens:,} tokens (client.tokens_in_flight auto: the requests at the "
                f"mean length, within {TURN_PASSES}-{MAX_TURN_PASSES} x "
                f"{self.pass_tokens:,}-token passes{share})"
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


def _turn_window(
    cfg: Config, lengths: Lengths | None, pass_tokens: int, split: int | None
) -> tuple[int | None, int, list[str]]:
    """One turn's window (tokens, requests) and the keys derived: counted in the
    reference's ``REF_SENDING_JOBS`` turns' passes split over ``split`` turns (None: a set
    count, a turn's passes whole)."""

    def share(tokens: int) -> int:
        return tokens if split is None else -(-tokens * REF_SENDING_JOBS // split)

    derived = []
    set_tokens = _setting(cfg.client.tokens_in_flight, "client.tokens_in_flight")
    requests = _setting(cfg.client.requests_in_flight, "client.requests_in_flight")
    turn, most = share(TURN_PASSES * pass_tokens), share(MAX_TURN_PASSES * pass_tokens)
    # auto tokens with a set request window: none, that window as it always was (a config
    # tuned in requests, or a test batching N requests, is not cut by a token limit).
    tokens = set_tokens
    if set_tokens is None:
        derived.append("client.tokens_in_flight")
        if requests is None:
            tokens = turn
    if requests is None:
        typical = lengths.typical if lengths is not None else ASSUMED_MEAN_TOKENS
        target = tokens if tokens is not None else turn
        requests = min(MAX_REQUESTS, max(MIN_REQUESTS, math.ceil(target / typical)))
        derived.append("client.requests_in_flight")
        if set_tokens is None and lengths is not None:
            # The request window was counted in the median; the tokens those requests
            # carry on average are the mean's.  A token window of only TURN_PASSES passes
            # then binds before the request window does, and the turn holds fewer requests
            # than the bare server it is compared with (chat turns, median 101, mean 129,
            # held ~127 of 163).
            held = math.ceil(requests * lengths.mean)
            tokens = min(most, max(turn, held))
    return tokens, requests, derived


def choose(cfg: Config, lengths: Lengths | None, *, workflow_jobs: int | None = None) -> InFlight:
    """The window for records of ``lengths`` (None: not known yet), within a workflow
    running ``workflow_jobs`` jobs at once (None: no ``-j`` known)."""
    cps = cfg.server.chunked_prefill_size
    pass_tokens = cps if cps > 0 else UNCHUNKED_PASS_TOKENS
    sending = sending_jobs(cfg, lengths, workflow_jobs)
    tokens, requests, derived = _turn_window(cfg, lengths, pass_tokens, sending.split)
    running = _setting(cfg.server.max_running_requests, "server.max_running_requests")
    if running is None:
        if sending.derived is None or sending.derived == sending.jobs:
            running = requests * sending.jobs
        else:
            # A launch flag: counted in the split before -j, so a workflow at another -j
            # (a one-chunk redo) finds the live server's limit its own.
            uncapped = _turn_window(cfg, lengths, pass_tokens, sending.derived)[1]
            running = uncapped * sending.derived
        derived.append("server.max_running_requests")
    return InFlight(tokens, requests, running, lengths, tuple(derived), pass_tokens, sending)


def for_run(cfg: Config) -> InFlight:
    """The window of the config's run: from its merged stats where the merge has run,
    within the -j of the workflow this process runs in.  Every reader (the launch, the
    chunk jobs, the preflight, ``hsextract plan``) asks here, so they agree."""

    return choose(
        cfg,
        merged_lengths(run_dir(cfg) / "merged" / "stats.json"),
        workflow_jobs=workflow_jobs_from_env(),
    )
