"""The in-flight window in tokens as well as requests (issue 40, Build 3): derived from the
merged records' lengths, the server's running limit to match, said by `hsextract plan`; a
set value wins; the client never passes either window."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from hsextract.client import _Window
from hsextract.config import fingerprint, read_config, run_dir
from hsextract.server import build_spec, spec_settings
from hsextract.window import (
    WORKFLOW_JOBS_ENV,
    Lengths,
    choose,
    for_run,
    merged_lengths,
)

REPO = Path(__file__).resolve().parents[1]


def _stats(mean: float, p50: float, p99: float, records: int = 1000) -> dict:
    length = {"mean": mean, "min": 1, "p50": p50, "p90": p99 / 2, "p99": p99, "max": p99 * 2}
    return {"records_out": records, "tokens_out": int(mean * records), "length": length}


def _project(tmp_path: Path, *, layers: int = 36, hidden: int = 4096, **over) -> Path:
    """An SGLang config of a Qwen3-8B shape (config.json only; ``layers`` and ``hidden``
    another's), its data stage not run."""
    model = tmp_path / "Qwen3-8B"
    model.mkdir(exist_ok=True)
    shape = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
             "num_hidden_layers": layers, "hidden_size": hidden,
             "torch_dtype": "bfloat16"}  # fmt: skip
    (model / "config.json").write_text(json.dumps(shape))
    shard = tmp_path / "data" / "s.jsonl"
    shard.parent.mkdir(exist_ok=True)
    shard.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}) + "\n")
    cfg = yaml.safe_load((REPO / "configs" / "qwen3-8b-1xh200.yaml").read_text())
    cfg["model"]["path"] = str(model)
    cfg["inputs"] = [str(shard)]
    cfg["output_root"] = str(tmp_path / "out")
    cfg["n_chunks"] = 2
    cfg["sglang"]["version"] = "0.5.14"  # no SGLang env here to detect it from
    for key, value in over.items():
        node = cfg
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _merge_stats(path: Path, stats: dict) -> Path:
    rd = run_dir(read_config(path))
    (rd / "merged").mkdir(parents=True, exist_ok=True)
    out = rd / "merged" / "stats.json"
    out.write_text(json.dumps(stats))
    return out


def test_short_records_get_a_larger_request_window_at_the_same_token_target(tmp_path):
    """Chat turns (~130 tokens) and documents (~2,000) under one target of two extend
    passes: the short records get ~15x the requests, counted in the median; the token
    window holds those requests at the mean length (else it binds first and a turn holds
    fewer requests than the bare server it is compared with), within 2-4 passes.  The
    server's running limit follows (requests x sending jobs).  Four turns set: the window
    a turn keeps when the count is derived is the next tests'."""
    path = _project(tmp_path, **{"client.sending_jobs": 4})
    short = _merge_stats(path, _stats(130, 110, 500))
    chat = for_run(read_config(path))
    assert merged_lengths(short) == Lengths(130.0, 110.0, 500.0, 1000, str(short))
    short.write_text(json.dumps(_stats(2000, 1900, 7000)))
    docs = for_run(read_config(path))
    assert chat.requests == -(-16384 // 110) == 149  # the median, below the mean
    assert docs.requests == -(-16384 // 1900) == 9
    assert chat.tokens == 149 * 130 and docs.tokens == 9 * 2000  # the requests at the mean
    assert chat.worst_case_requests(130) == chat.requests  # the tokens do not bind first
    assert chat.max_running == 149 * 4 and docs.max_running == 9 * 4
    # A mix of chat turns and long documents: the turns' count (the median), not the
    # mean's; the documents held back at four passes, not the mean's 127 x 2,000 tokens.
    mix = choose(read_config(path), Lengths(2000, 130, 7000, 1000, "mix"))
    assert mix.requests == -(-16384 // 130) and mix.tokens == 4 * 8192
    # The median above the mean: the requests counted in the mean, two passes of tokens.
    uniform = choose(read_config(path), Lengths(512, 600, 900, 1000, "uniform"))
    assert uniform.requests == 16384 // 512 and uniform.tokens == 2 * 8192
    # Before the merge has counted the records: two passes of the assumed mean.
    fresh = choose(read_config(path), None)
    assert fresh.tokens == 2 * 8192 and fresh.requests == 16384 // 512


def test_a_set_value_wins_and_auto_reaches_the_launch(tmp_path):
    """The running limit is a launch flag: auto gives the derived value (argv and the
    spec's settings, so a server started on other lengths is replaced); a number is used
    as set.  Neither moves the fingerprint (chunk content does not depend on the window).
    Four turns set (the derived count is the tests' below)."""
    auto = _project(tmp_path, **{"client.sending_jobs": 4})
    _merge_stats(auto, _stats(130, 110, 500))
    cfg = read_config(auto)
    spec = build_spec(cfg, run_dir=run_dir(cfg), log_path=tmp_path / "s.log")
    assert spec.argv[spec.argv.index("--max-running-requests") + 1] == "596"
    assert (
        spec.settings["max_running_requests"] == 596 == spec_settings(cfg)["max_running_requests"]
    )
    assert cfg.raw["server"]["max_running_requests"] == "auto"
    fixed = read_config(
        auto,
        {
            "client": {"requests_in_flight": 16, "tokens_in_flight": 4096},
            "server": {"max_running_requests": 64},
        },
    )
    assert fingerprint(fixed) == fingerprint(cfg)
    win = for_run(fixed)
    assert (win.tokens, win.requests, win.max_running, win.derived) == (4096, 16, 64, ())
    spec = build_spec(fixed, run_dir=run_dir(fixed), log_path=tmp_path / "s.log")
    assert spec.argv[spec.argv.index("--max-running-requests") + 1] == "64"
    # Requests set, the rest auto: the limit follows the set window, and no token limit
    # cuts it (a config tuned in requests keeps its window).
    half = for_run(read_config(auto, {"client": {"requests_in_flight": 10}}))
    assert (half.requests, half.max_running, half.tokens) == (10, 40, None)
    assert "no token limit" in half.describe()


def test_plan_says_what_it_chose_and_from_which_stats(tmp_path):
    path = _project(tmp_path, **{"client.sending_jobs": 4})
    stats = _merge_stats(path, _stats(130, 110, 500, records=11_538))
    proc = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "plan", "--configfile", str(path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith("in flight per sending turn")]
    assert said == [
        "in flight per sending turn: 19,370 tokens (client.tokens_in_flight auto: the "
        "requests at the mean length, within 2-4 x 8,192-token passes), 149 requests "
        "(client.requests_in_flight auto); "
        "server.max_running_requests 596 (auto: requests x client.sending_jobs); from p50 "
        f"110, mean 130 tokens, p99 500, 11,538 records, {stats}"
    ], proc.stdout + proc.stderr


class _Turn:
    """A sending turn held by this job alone, of ``n`` turns."""

    def __init__(self, n: int, held: int = 1) -> None:
        self.n, self.held = n, held

    def held_count(self) -> int:
        return self.held


def test_the_window_holds_tokens_and_requests_and_lets_a_long_record_go_alone():
    w = _Window(_Turn(1), 4, cap=64, tokens=1000, probe_s=0.0)
    w.acquire(400)
    w.acquire(400)
    assert not w._room(300) and w._room(200)  # 1,100 tokens would pass the window
    w.acquire(200)
    w.acquire(0)
    assert w.active == 4 and not w._room(0)  # the request window is full
    for n in (400, 400, 200, 0):
        w.release(n)
    assert w.active == w.active_tokens == 0
    assert w._room(5000)  # longer than the whole window: it goes alone
    w.acquire(5000)
    assert not w._room(1)
    w.release(5000)
    # Vacant turns' share: the token window grows with the request window.
    w = _Window(_Turn(4), 4, cap=64, tokens=1000, probe_s=0.0)
    assert w.limit() == 16 and w.token_limit() == 4000


def test_concurrent_senders_never_pass_either_window():
    """Threads as many as the window's most, records of mixed lengths (some longer than
    the token window): what is in flight, counted outside the window, never passes the
    requests' limit nor the tokens' (but for a long record alone), and every record goes."""
    rng = random.Random(0)
    lens = [int(rng.lognormvariate(4.6, 0.8)) + 1 for _ in range(3000)] + [3000] * 20
    rng.shuffle(lens)
    w = _Window(_Turn(1), 16, cap=64, tokens=2048, probe_s=0.0)
    lock = threading.Lock()
    now = {"n": 0, "tokens": 0}
    seen = {"n": 0, "tokens": 0, "done": 0, "bad": []}

    def one(n: int) -> None:
        w.acquire(n)
        try:
            with lock:
                now["n"] += 1
                now["tokens"] += n
                seen["n"] = max(seen["n"], now["n"])
                seen["tokens"] = max(seen["tokens"], now["tokens"])
                if now["n"] > 16 or (now["tokens"] > 2048 and now["n"] > 1):
                    seen["bad"].append(dict(now))
            with lock:
                now["n"] -= 1
                now["tokens"] -= n
                seen["done"] += 1
        finally:
            w.release(n)

    with ThreadPoolExecutor(max_workers=w.most) as pool:
        for f in [pool.submit(one, n) for n in lens]:
            f.result(timeout=120)
    assert seen["bad"] == [] and seen["done"] == len(lens)
    assert seen["n"] <= 16 and w.peak <= 16
    assert w.tokens_peak <= max(2048, 3000)  # the 3,000-token records went alone


def test_the_window_keys_take_auto_or_a_count_and_refuse_the_rest_in_a_sentence(tmp_path):
    """auto and a count are taken (plan gets as far as the missing split); anything else
    is one sentence naming the key, no traceback."""

    def plan(value) -> subprocess.CompletedProcess:
        path = _project(tmp_path, **{"client.tokens_in_flight": value})
        return subprocess.run(
            [sys.executable, "-m", "hsextract.cli", "plan", "--configfile", str(path)],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    for value, said in (("auto", "16,384 tokens"), (3000, "3,000 tokens (client.tokens")):
        proc = plan(value)
        assert said in proc.stdout and "chunks/index.json does not exist yet" in proc.stderr, (
            proc.stdout + proc.stderr
        )
    for value in (0, -3, "many", True):
        proc = plan(value)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "tokens_in_flight" in lines[0], proc.stderr


def test_the_reference_engine_never_sees_more_than_either_window(demo_run, tmp_path, monkeypatch):
    """One chunk through the reference engine, one sending turn, 4 requests and 600 tokens
    a turn (more than any demo record, less than its four longest together): the most the
    server held at once, counted on its side between arrival and answer, stays within
    both, and so do the request-seconds the sidecar sums up; the server was started with
    the running limit auto derived (4 x 1 turn); the chunk holds the workflow's states."""
    import copy
    import os

    import requests
    import torch

    from hsextract import server
    from hsextract.chunks import ChunkReader
    from hsextract.client import extract_chunk
    from hsextract.config import load_config, typed
    from hsextract.records import load_chunk

    workdir, rd = demo_run["workdir"], demo_run["run_dir"]
    monkeypatch.chdir(workdir)
    raw = copy.deepcopy(load_config(workdir / "config.yaml"))
    raw["client"].update(requests_in_flight=4, tokens_in_flight=600, sending_jobs=1)
    raw["server"]["max_running_requests"] = "auto"
    raw["dump"]["dir"] = str(tmp_path / "dump")
    cfg = typed(raw)
    chunk = max(demo_run["manifest"]["chunks"], key=lambda c: c["records"])
    name = Path(chunk["path"]).stem
    lens = sorted(len(r.input_ids) for r in load_chunk(rd / "chunks" / f"{name}.jsonl", None))
    assert lens[-1] <= 600 < sum(lens[-4:]), lens  # the token window has work to do
    spec = server.build_spec(cfg, run_dir=tmp_path, log_path=tmp_path / "server.log")
    assert spec.argv[spec.argv.index("--max-running-requests") + 1] == "4"
    state = server.start(spec, owner=os.getpid())
    try:
        sidecar = extract_chunk(
            cfg,
            chunk_path=rd / "chunks" / f"{name}.jsonl",
            index_path=rd / "chunks" / "index.json",
            out_path=tmp_path / f"{name}.safetensors",
            sidecar_path=tmp_path / f"{name}.json",
            ensure=lambda: state,
            progress=False,
        )
        seen = requests.get(f"{state['url']}/get_server_info", timeout=30).json()
    finally:
        server.stop(state)
    peak = seen["peak_in_flight"]
    assert 1 <= peak["requests"] <= 4 and lens[-1] <= peak["tokens"] <= 600, peak
    assert sidecar["window"][1] <= 4
    assert sidecar["nice"] == os.getpriority(os.PRIO_PROCESS, 0)  # the job's own niceness
    assert sidecar["window_tokens"][0] == 600 and sidecar["window_tokens"][1] <= 600
    # Where the requests were (request-seconds): the waits for /dev/shm, the answers and
    # the pieces are parts of the window's time, and no more than 4 were in it over the
    # job's sending.
    req = sidecar["request_s"]
    assert req["answer"] > 0 and req["shm"] >= 0 and req["pieces"] > 0, req
    assert req["answer"] + req["shm"] + req["pieces"] <= req["window"], req
    assert req["window"] <= 4 * (sidecar["drained_at"] - sidecar["sending"][0]) + 0.01, req
    got, want = ChunkReader(tmp_path / f"{name}.safetensors"), ChunkReader(rd / chunk["path"])
    assert got.record_ids == want.record_ids
    for j in range(len(want.record_ids)):
        a, b = got[j], want[j]
        assert torch.equal(a["input_ids"], b["input_ids"]), (name, j)
        for key in ("hidden_states", "aux_hidden_states"):  # other batches: float32 noise
            assert (a[key] - b[key]).abs().max().item() <= 1e-5, (name, j, key)


# The rate table's cells (bench/tables/rate_table_h100.csv): the records' statistics the
# sending jobs are derived from.  Four turns were measured good on all but the chat cell.
CHAT = Lengths(129.3, 101.0, 494.0, 7736, "chat-7b-5aux")
SHAREGPT = Lengths(529.4, 280.0, 3968.0, 3778, "sharegpt-8b-3aux")
BIMODAL = Lengths(1375.2, 434.0, 7330.0, 1637, "bimodal-llama-4aux")
LONG = Lengths(5900.0, 5600.0, 8000.0, 340, "long records")


def _chat_7b(tmp_path: Path, **over) -> Path:
    """The chat cell's shape: Qwen2.5-7B (28 layers of 3,584), five aux layers captured,
    client.sending_jobs at its default."""
    over = {"aux_layers": [2, 8, 14, 19, 25], "client.sending_jobs": "auto", **over}
    return _project(tmp_path, layers=28, hidden=3584, **over)


def _window(win) -> tuple:
    return win.tokens, win.requests, win.max_running


def test_chat_turns_get_eight_sending_jobs_and_four_turns_window_split_over_them(tmp_path):
    """The chat cell: its cost a token (a request's cost over 129 tokens, 43 KB of states
    a token) is ~1.95x the reference's, so 8 jobs, as measured good (0.966 against 0.887
    with 4); each turn keeps half of what a turn of four kept, so the turns together, and
    the server's running limit, hold what four did."""
    path = _chat_7b(tmp_path)
    win = choose(read_config(path), CHAT)
    assert win.sending.jobs == win.sending.derived == 8
    assert win.requests == -(-8192 // 101) == 82  # two passes x 4/8 turns, in the median
    assert win.tokens == math.ceil(82 * 129.3) == 10_603  # those requests at the mean
    assert win.max_running == 82 * 8 == 656
    four = choose(read_config(path, {"client": {"sending_jobs": 4}}), CHAT)
    assert _window(four) == (math.ceil(163 * 129.3), 163, 652)  # the shipped window
    assert abs(win.max_running - four.max_running) <= 8
    said = win.sending.describe()
    head = ("sending jobs 8 (auto: ~0.253 ms of a sending job's time a token for records of "
            "mean 129 tokens at 43.0 KB of states a token")  # fmt: skip
    assert said.startswith(head), said
    assert said.endswith("4 x 1.95 = 7.8; -j below 8 caps it)"), said
    assert "x 4/8 turns" in win.describe() and "requests x 8 sending jobs" in win.describe()


def test_where_four_turns_were_good_auto_is_four_and_the_window_as_it_was(tmp_path):
    """ShareGPT-like records on Qwen3-8B with EAGLE-3's three aux layers (the reference),
    the bimodal Llama cell with four, and long records: four jobs and exactly the window a
    set four gives, before the merge too."""
    (tmp_path / "q").mkdir()
    (tmp_path / "l").mkdir()
    sharegpt = _project(tmp_path / "q", **{"client.sending_jobs": "auto"})
    llama = _project(tmp_path / "l", layers=32, aux_layers=[2, 11, 20, 29],
                     **{"client.sending_jobs": "auto"})  # fmt: skip
    for path, lengths in ((sharegpt, SHAREGPT), (sharegpt, LONG), (sharegpt, None),
                          (llama, BIMODAL), (llama, LONG)):  # fmt: skip
        auto = choose(read_config(path), lengths)
        four = choose(read_config(path, {"client": {"sending_jobs": 4}}), lengths)
        assert (auto.sending.jobs, auto.sending.derived) == (4, 4), (path, lengths)
        assert _window(auto) == _window(four), (path, lengths)
    assert _window(choose(read_config(sharegpt), SHAREGPT)) == (math.ceil(59 * 529.4), 59, 236)
    assert "caps" not in choose(read_config(sharegpt), SHAREGPT).sending.describe()


def test_a_set_count_wins_with_a_turn_s_window_whole(tmp_path):
    path = _chat_7b(tmp_path, **{"client.sending_jobs": 6})
    win = choose(read_config(path), CHAT, workflow_jobs=2)
    assert (win.sending.jobs, win.sending.derived) == (6, None)
    assert (win.requests, win.max_running) == (163, 163 * 6)  # not split, not capped
    assert win.sending.describe() == "sending jobs 6 (client.sending_jobs set)"
    assert "requests x client.sending_jobs" in win.describe()


def test_the_workflow_s_j_caps_the_derived_count_and_says_so(tmp_path, monkeypatch):
    """-j6 under a derived 8: six turns, the window split over six; never below four (the
    jobs share the turns none holds); the launch's running limit is the same at any -j (a
    one-chunk redo at -j1 keeps the live server).  The workflow exports its -j to its
    jobs and its log line says the cap; a dry run's does not."""
    path = _chat_7b(tmp_path)
    cfg = read_config(path)
    six = choose(cfg, CHAT, workflow_jobs=6)
    assert (six.sending.jobs, six.sending.derived) == (6, 8)
    assert six.requests == math.ceil(math.ceil(16384 * 4 / 6) / 101) == 109
    assert six.max_running == 656 == choose(cfg, CHAT).max_running
    assert "; -j6 caps it at 6, the window split over 6)" in six.sending.describe()
    two = choose(cfg, CHAT, workflow_jobs=2)
    assert two.sending.jobs == 4 and (two.requests, two.max_running) == (163, 656)
    assert "-j2 caps it at 4, the least" in two.sending.describe()
    assert choose(cfg, CHAT, workflow_jobs=16).sending.jobs == 8
    assert "caps" not in choose(cfg, CHAT, workflow_jobs=16).sending.describe()
    # Every reader of the run asks for_run, which takes the workflow's -j from its jobs'
    # environment; the launch flag does not move with it.
    _merge_stats(path, _stats(129.3, 101, 494, records=7736))
    spec = build_spec(cfg, run_dir=run_dir(cfg), log_path=tmp_path / "s.log")
    monkeypatch.setenv(WORKFLOW_JOBS_ENV, "6")
    assert for_run(cfg).sending.jobs == 6
    capped = build_spec(cfg, run_dir=run_dir(cfg), log_path=tmp_path / "s.log")
    flag = "--max-running-requests"
    assert spec.argv[spec.argv.index(flag) + 1] == capped.argv[capped.argv.index(flag) + 1]
    assert capped.argv[capped.argv.index(flag) + 1] == "656"
    monkeypatch.delenv(WORKFLOW_JOBS_ENV)

    def workflow(*args: str) -> str:
        """The sending jobs' line of a workflow that merges the records (a cheap job: the
        line is said as the workflow starts, from the stats written above)."""
        target = str(run_dir(cfg) / "merged" / "train.jsonl")
        proc = subprocess.run(
            [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d",
             str(tmp_path), "--configfile", str(path), *args, "--", target],
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return next(ln for ln in proc.stderr.splitlines() if "sending jobs" in ln)

    # A dry run runs nothing: it says what -j would cap.
    assert workflow("-n", "-j6") == f"hsextract: {choose(cfg, CHAT).sending.describe()}"
    assert workflow("-j6") == f"hsextract: {six.sending.describe()}"


def test_the_derived_count_is_the_turns_a_chunk_job_takes(demo_copy, tmp_path, monkeypatch):
    """One chunk job of the demo, its run's records counted short (its merged stats: a
    mean of 64 tokens) and client.sending_jobs auto, under a workflow of -j6: the job took
    a turn of 6 (the derived 8 capped), as its sidecar says, on a server whose running
    limit is the uncapped split's."""
    import copy
    import os

    from hsextract import server
    from hsextract.client import extract_chunk
    from hsextract.config import load_config, typed

    workdir, rd = demo_copy["workdir"], demo_copy["run_dir"]
    monkeypatch.chdir(workdir)
    (rd / "merged" / "stats.json").write_text(json.dumps(_stats(64, 64, 200, records=48)))
    raw = copy.deepcopy(load_config(workdir / "config.yaml"))
    raw["client"].update(requests_in_flight=4, tokens_in_flight=600, sending_jobs="auto")
    raw["server"]["max_running_requests"] = "auto"
    raw["dump"]["dir"] = str(tmp_path / "dump")
    cfg = typed(raw)
    assert choose(cfg, merged_lengths(rd / "merged" / "stats.json")).sending.jobs == 8
    monkeypatch.setenv(WORKFLOW_JOBS_ENV, "6")
    chunk = max(demo_copy["manifest"]["chunks"], key=lambda c: c["records"])
    name = Path(chunk["path"]).stem
    spec = server.build_spec(cfg, run_dir=tmp_path, log_path=tmp_path / "server.log")
    assert spec.argv[spec.argv.index("--max-running-requests") + 1] == str(4 * 8)
    state = server.start(spec, owner=os.getpid())
    try:
        sidecar = extract_chunk(
            cfg,
            chunk_path=rd / "chunks" / f"{name}.jsonl",
            index_path=rd / "chunks" / "index.json",
            out_path=tmp_path / f"{name}.safetensors",
            sidecar_path=tmp_path / f"{name}.json",
            ensure=lambda: state,
            progress=False,
        )
    finally:
        server.stop(state)
    assert sidecar["sending_jobs"] == 6
    assert sidecar["records"] == chunk["records"]
