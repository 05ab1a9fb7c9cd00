"""The race: hsextract vs SpecForge's offline capture vs the bare SGLang server, one H200,
a Qwen3-8B-shaped target, the same records, one run.  Runs on the H200 through the harness:

    HSEXTRACT_TIMEOUT=585 HSEXTRACT_RUN="python3 bench/race.py" bash h200/run.sh

with SpecForge's wheel and its ``scripts/prepare_hidden_states.py`` carried beside
(``--specforge DIR``: ``specforge-0.2.0-py3-none-any.whl`` and the script; bench/README.md,
"Race", says how to stage them).  SGLang 0.5.14, triton attention (the H200 payload has no
FA3), random weights (``--load-format dummy``: SGLang's seeded dummy init, so every
contender holds the same weights and no checkpoint is written).

Records: token ids with a ShareGPT-like length distribution (lognormal, mean ~550, p99 ~4k,
cap 8,192), seeded; ``--lengths bimodal`` (issue 34) or ``chat`` (issue 40: ~130 tokens on
average, p99 ~500).  Shapes (``--model``): Qwen3-8B, Llama-3.1-8B, Qwen2.5-7B (issue 40's
7B of another family).  Issue 40's run (one device call, ~540 s):

    HSEXTRACT_TIMEOUT=585 HSEXTRACT_RUN="python3 bench/race.py --model qwen2.5-7b \
      --aux-layers 5 --lengths chat --tokens 1.5M --chunks auto \
      --contenders bare,hsextract --reclaim" bash h200/run.sh

Contenders, one at a time on the GPU:

* ``bare``: ``sglang.launch_server`` with hsextract's flags for this config minus the
  capture (``--forward-hooks``), every record's ``/generate``: the ceiling, at hsextract's
  window for these records (``--in-flight same``: as many requests in flight as
  hsextract's sending turns hold together, its server at the same
  ``--max-running-requests``, both derived by ``hsextract.window`` from the records'
  lengths as the merge counts them; the race prints both);
* ``hsextract``: ``snakemake -j8 extract_all`` with ``configs/qwen3-8b-1xh200.yaml`` (hooks,
  lossless chunk files, fsync + sha256, manifest); the window runs from the server healthy
  to the run's last output in place (manifest, report), the bare server's from healthy to
  its last response (the model load and the server's stop are left out of both; with
  ``--reclaim`` each finished chunk's states are freed on disk, bench/README.md says why);
* ``hsextract-fault``: a smaller hsextract run (``--fault-records``) whose workflow is
  SIGKILLed (process group) once half its chunks are finished, then run again: what the
  rerun redoes, and whether ``hsextract verify`` passes with every record present;
* ``bare-dp2``: the bare server with ``--dp-size 2`` on the one GPU (the live DP tests'
  shim), over the first ``--dp2-records`` records; ``bare-dp1``: the bare server (dp 1)
  over the same records, its like-for-like baseline;
* ``specforge`` / ``specforge-gz``: SpecForge's own ``HiddenStatesGenerator`` from its
  script on its in-process SGLang engine (``specforge.offline_capture``), its defaults
  (batch 32, 16 I/O threads, ``.ckpt`` per record; gzip 6 with ``--compress``), driven as
  its ``main()`` does except the dataset: our token ids go straight into its collator (no
  chat template), and ``load_format=dummy`` into its SGLang kwargs.  Its window ends when
  its files are written and ``sync`` returned (it never fsyncs).  A prefix of the records
  (a multiple of its batch, so ``drop_last`` drops none), sized by disk: it stores the
  padding too.

Figures per contender: tokens/s, ratio to bare, bytes on disk per token, peak /dev/shm,
peak host RAM (MemTotal - MemAvailable over the baseline, and the largest summed RSS of
processes started since), GPU busy share; the servers' own prefill rate and queue from
their logs.  All of it goes to ``$OUT/race.json``; the logs to ``$OUT/race-logs.tar.xz``.
Last line: ``race: hsextract/bare X, hsextract/specforge Y``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

#: Qwen3-8B's shape (config.json of Qwen/Qwen3-8B), random weights.
QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
    rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
    max_position_embeddings=40960, attention_bias=False, attention_dropout=0.0,
    tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=151643,
    eos_token_id=151645, use_cache=True, use_sliding_window=False, sliding_window=None,
    max_window_layers=36, initializer_range=0.02,
)  # fmt: skip
#: Llama-3.1-8B's shape (config.json of meta-llama/Llama-3.1-8B-Instruct), random weights:
#: issue 34's target.
LLAMA31_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
    rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192, rope_type="llama3"),
    max_position_embeddings=131072, attention_bias=False, attention_dropout=0.0,
    mlp_bias=False, pretraining_tp=1, tie_word_embeddings=False, torch_dtype="bfloat16",
    bos_token_id=128000, eos_token_id=[128001, 128008, 128009], use_cache=True,
    initializer_range=0.02,
)  # fmt: skip
#: Qwen2.5-7B-Instruct's shape (config.json of Qwen/Qwen2.5-7B-Instruct), random weights:
#: issue 40's target of another family (q/k/v bias, which Qwen2ForCausalLM always has; 28
#: layers, hidden 3584, 28 heads of 128, 4 KV heads).
QWEN25_7B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064,
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, hidden_act="silu", rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=32768,
    attention_dropout=0.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    bos_token_id=151643, eos_token_id=151645, use_cache=True, use_sliding_window=False,
    sliding_window=131072, max_window_layers=28, initializer_range=0.02,
)  # fmt: skip
MODELS = {"qwen3-8b": QWEN3_8B, "llama3.1-8b": LLAMA31_8B, "qwen2.5-7b": QWEN25_7B}
#: What the H200 payload needs beyond the shipped config (sglang-h200 recipe): no FA3 in
#: the slimmed kernel, no tokenizer (ids are sent), random weights.
PAYLOAD_ARGS = ["--load-format", "dummy", "--attention-backend", "triton",
                "--sampling-backend", "pytorch", "--skip-tokenizer-init"]  # fmt: skip
PAYLOAD_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
#: lognormal(mu, sigma): mean exp(mu + sigma^2/2) = 550, p99 exp(mu + 2.326 sigma) = 4000.
MU, SIGMA, MIN_LEN, MAX_LEN = 5.677, 1.125, 16, 8192


#: ``--lengths bimodal`` (issue 34's mix): chat turns and long documents.  A record is
#: long with probability BIMODAL_LONG; short ones lognormal(median 300, sigma 0.8), long
#: ones lognormal(median 4,000, sigma 0.35); both clipped to [MIN_LEN, MAX_LEN].  Mean
#: ~1,370 tokens: a 64-request window holds ~88k tokens, so a 47k-token chunk is ~35
#: records (half a window) and a 141k-token one ~100.
BIMODAL_LONG = 0.25
BIMODAL = ((5.704, 0.8), (8.294, 0.35))  # (mu, sigma): exp(mu) = 300, 4,000
#: ``--lengths chat`` (issue 40's records): chat turns, lognormal with mean exp(mu +
#: sigma^2/2) = 130 and p99 exp(mu + 2.326 sigma) = 500 (median ~103), clipped to
#: [MIN_LEN, MAX_LEN] (the floor lifts the mean a little: the race prints the figures).
CHAT = (4.6377, 0.678)
LENGTH_MIXES = ("sharegpt", "bimodal", "chat")


def lengths(n: int, seed: int, mix: str = "sharegpt") -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    if mix == "bimodal":
        long = rng.random(n) < BIMODAL_LONG
        (mu0, s0), (mu1, s1) = BIMODAL
        raw = np.where(long, np.exp(rng.normal(mu1, s1, n)), np.exp(rng.normal(mu0, s0, n)))
    elif mix == "chat":
        raw = np.exp(rng.normal(CHAT[0], CHAT[1], n))
    else:
        raw = np.exp(rng.normal(MU, SIGMA, n))
    return np.clip(raw, MIN_LEN, MAX_LEN).astype(int).tolist()


def lengths_for_tokens(tokens: int, seed: int, mix: str) -> list[int]:
    """The shortest seeded prefix of ``lengths`` holding at least ``tokens`` tokens."""
    n = 1024
    while True:
        lens = lengths(n, seed, mix)
        total, k = 0, 0
        for k, x in enumerate(lens, 1):
            total += x
            if total >= tokens:
                return lens[:k]
        n *= 2


def write_records(path: Path, lens: list[int], seed: int, vocab: int) -> list[int]:
    """Seeded records: random ids, a random prompt prefix masked out (loss_mask 0)."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    with open(path, "w") as f:
        for i, n_tok in enumerate(lens):
            ids = rng.integers(2, vocab, n_tok).tolist()
            cut = int(rng.integers(0, n_tok))
            rec = {
                "id": f"r{i:06d}",
                "input_ids": ids,
                "loss_mask": [0] * cut + [1] * (n_tok - cut),
            }
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    return lens


class Sampler:
    """Peaks while a contender runs: /dev/shm used, host RAM in use (MemTotal -
    MemAvailable, so page cache is not counted, /dev/shm is), the summed RSS of processes
    started since, and how busy the GPU was."""

    def __init__(self, period: float = 0.25, before: set[int] | None = None) -> None:
        import psutil

        self.psutil = psutil
        self.period = period
        # Processes that are not the contender's (a server started earlier is passed in).
        self.before = before if before is not None else set(psutil.pids())
        self.base_used = self._used()
        self.base_shm = self._shm()
        self.peak = {"shm": 0, "ram": 0, "rss": 0}
        self.gpu_busy: list[int] = []
        self.gpu_at: list[float] = []  # each sample's wall clock: busy within a phase
        self.cpu_busy: list[float] = []
        psutil.cpu_percent()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
        except Exception:  # no GPU here (a dry run): no busy figure
            self._nvml = None

    @staticmethod
    def _shm() -> int:
        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    @staticmethod
    def _used() -> int:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
        return info["MemTotal"] - info["MemAvailable"]

    def _rss(self) -> int:
        total = 0
        for p in self.psutil.process_iter(["pid"]):
            if p.info["pid"] in self.before:
                continue
            try:
                total += p.memory_info().rss
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                pass
        return total

    def _run(self) -> None:
        k = 0
        while not self._stop.wait(self.period):
            self.peak["shm"] = max(self.peak["shm"], self._shm() - self.base_shm)
            self.peak["ram"] = max(self.peak["ram"], self._used() - self.base_used)
            if k % 4 == 0:  # RSS of every process costs more: once a second
                self.peak["rss"] = max(self.peak["rss"], self._rss())
                self.cpu_busy.append(self.psutil.cpu_percent())
            if self._nvml:
                nv, h = self._nvml
                self.gpu_busy.append(nv.nvmlDeviceGetUtilizationRates(h).gpu)
                self.gpu_at.append(time.time())
            k += 1

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    def busy_between(self, t0: float, t1: float) -> float | None:
        """GPU busy (%) over the samples taken in [t0, t1] (wall clock): the sending
        phase's own, where the whole window's figure also holds the load and the tail."""
        xs = [b for t, b in zip(self.gpu_at, self.gpu_busy, strict=True) if t0 <= t <= t1]
        return round(statistics.mean(xs), 1) if xs else None

    def report(self) -> dict:
        return {
            "peak_shm_gb": round(self.peak["shm"] / 1e9, 2),
            "peak_ram_gb": round(self.peak["ram"] / 1e9, 2),
            "peak_rss_gb": round(self.peak["rss"] / 1e9, 2),
            "gpu_busy_pct": round(statistics.mean(self.gpu_busy), 1) if self.gpu_busy else None,
            # All cores, mean and peak of 1-s samples (16 cores: 100 % = all 16 busy).
            "cpu_busy_pct": [round(statistics.mean(self.cpu_busy), 1), max(self.cpu_busy)]
            if self.cpu_busy
            else None,
        }


def server_log_figures(log: Path, since: float = 0.0) -> dict:
    """SGLang's own prefill batches: input throughput and queue length per batch."""
    rates, queue, tokens, stamps = [], [], [], []
    stamp = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if "Prefill batch" not in line:
            continue
        m = stamp.search(line)
        at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) if m else None
        if since and at is not None and at < since - 1:
            continue
        if at is not None:
            stamps.append(at)
        r = re.search(r"input throughput \(token/s\): ([\d.]+)", line)
        q = re.search(r"#queue-req: (\d+)", line)
        t = re.search(r"#new-token: (\d+)", line)
        if r:
            rates.append(float(r.group(1)))
        if q:
            queue.append(int(q.group(1)))
        if t:
            tokens.append(int(t.group(1)))
    return {
        "prefill_batches": len(rates),
        "prefill_tok_s_median": round(statistics.median(rates)) if rates else None,
        "tokens_per_batch_mean": round(statistics.mean(tokens)) if tokens else None,
        "batches_with_empty_queue": sum(1 for x in queue if x == 0),
        "batches_with_5plus_queued": sum(1 for x in queue if x >= 5),
        # First to last prefill batch, by the log's 1-s stamps (+-1 s).
        "prefill_span_s": round(max(stamps) - min(stamps)) if stamps else None,
    }


def own_work_dir(work: Path, marker: str, bench: str) -> None:
    """Use ``work`` only if it is new, empty or made by ``bench`` (its ``marker`` file):
    anything else is someone's, and the benches remove their runs in it."""
    if work.exists() and any(work.iterdir()) and not (work / marker).exists():
        raise SystemExit(
            f"{work} exists, is not empty and was not made by {bench} (no {marker}); the "
            "bench removes its runs there: pass another --work"
        )
    work.mkdir(parents=True, exist_ok=True)
    (work / marker).touch()


def disk_bytes(paths: list[Path]) -> int:
    return sum(p.stat().st_blocks * 512 for p in paths)


def gpu_used_mib() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return int(pynvml.nvmlDeviceGetMemoryInfo(h).used // 2**20)
    except Exception:
        return 0


def wait_gpu_free(limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while gpu_used_mib() > 2000 and time.monotonic() < deadline:
        time.sleep(0.5)


# --- the contenders ------------------------------------------------------------------------


def aux_layer_list(spec: str | None, num_layers: int) -> list[int] | None:
    """``--aux-layers``: None (the EAGLE-3 default), a count (spread evenly over
    [2, L-3], the default's ends), or a comma list of layer indices."""
    if not spec:
        return None
    if "," in spec:
        return [int(x) for x in spec.split(",")]
    k, lo, hi = int(spec), 2, num_layers - 3
    if k == 1:
        return [hi]
    return sorted({round(lo + i * (hi - lo) / (k - 1)) for i in range(k)})


def hsx_config(work: Path, data: Path, n_chunks: int | str, tag: str = "hsx",
               aux_layers: list[int] | None = None) -> Path:  # fmt: skip
    """The shipped config for this shape, with this machine's paths and payload flags.
    Each ``tag`` (a contender variant) has its own config dir and output root: a run never
    sees another variant's run dir (``stale`` would delete it, logs and all)."""
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / "qwen3-8b-1xh200.yaml").read_text())
    results = work / ("results" if tag == "hsx" else f"results-{tag}")
    cfg.update(inputs=[str(data)], output_root=str(results), n_chunks=n_chunks)
    cfg["aux_layers"] = aux_layers
    cfg["model"].update(path=str(work / "model"), revision="race-dummy")
    cfg["sglang"].update(python=sys.executable, extra_args=PAYLOAD_ARGS, extra_env=PAYLOAD_ENV)
    # Contenders run one after another: after a server stops, this machine's GPU keeps
    # ~615 MiB in use with no process listed (seen in the first call), over the 200 MiB gate.
    cfg["gpu"].update(wait_s=60, max_used_mib=2000)
    # The audit runs HF's forward of model.path after the extraction: these benches serve
    # SGLang's dummy weights (nothing on disk to load) and --reclaim punches the chunks it
    # would read, so it could only fail, after everything they measure.
    cfg["audit"] = {"records": 0}
    (work / tag).mkdir(parents=True, exist_ok=True)
    path = work / tag / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def turns_used(sidecars: list[dict]) -> int:
    """The sending turns the chunk jobs took (client.sending_jobs, ``auto`` within the
    workflow's -j), as their sidecars say; 4, the count before it was derived, for
    sidecars written before they said it."""
    return max((int(s.get("sending_jobs") or 0) for s in sidecars), default=0) or 4


def sidecar_windows(side: Path) -> dict:
    """What the chunk jobs' windows were (sidecars ``window``, ``window_tokens``: own share,
    peak) and the running limit their server was started with (its argv)."""
    sides = [json.loads(f.read_text()) for f in sorted(side.glob("chunk_*.json"))]
    if not sides:
        return {}
    argv = (sides[0].get("server") or {}).get("argv") or []
    flag = "--max-running-requests"
    return {
        "max_running_requests": int(argv[argv.index(flag) + 1]) if flag in argv else None,
        "requests": [max((s.get("window") or [0, 0])[i] for s in sides) for i in (0, 1)],
        "tokens": [
            max((s.get("window_tokens") or [0, 0])[i] or 0 for s in sides) for i in (0, 1)
        ],  # fmt: skip
    }


def results_dir(cfg_path: Path) -> Path:
    import yaml

    return Path(yaml.safe_load(cfg_path.read_text())["output_root"])


def dp2_config(work: Path, cfg_path: Path) -> Path:
    """The same server with two DP workers on the one GPU (``sglang.dp_size: 2``): 0.5.14
    refuses ``--gpu-id-step 0``, so GPU 0 is listed once per worker and the test-only shim
    (tests/live/one_gpu_dp) maps both onto it.  Each worker sizes its KV pool from the free
    memory it saw before either loaded, so the pool is capped (``--max-total-tokens``) and
    the static fraction shared."""
    import yaml

    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["sglang"].update(
        dp_size=2,
        mem_fraction_static=0.5,
        extra_args=[*PAYLOAD_ARGS, "--max-total-tokens", "131072"],
        extra_env={
            **PAYLOAD_ENV,
            "CUDA_VISIBLE_DEVICES": "0,0",
            "SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS": "1",
            "HSEXTRACT_LIVE_ONE_GPU_DP": "1",
        },  # fmt: skip
    )
    # Beside the config it derives from (work/hsx -> work/hsx-dp2): each variant its own.
    path = work / f"{cfg_path.parent.name}-dp2" / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    shim = str(REPO / "tests" / "live" / "one_gpu_dp")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")]))
    return path


def race_window(cfg_path: Path, lens: list[int], in_flight: str = "same") -> dict:
    """hsextract's in-flight window for these records (``hsextract.window``, from the
    length statistics its merge will count: numpy's mean and percentiles, as
    ``records._stats``), and the bare server's: ``same`` = as many requests in flight as
    hsextract's turns hold together (its derived running limit x dp), its server at the same
    ``--max-running-requests``; a number overrides the requests only."""
    import numpy as np

    from hsextract.config import read_config
    from hsextract.dp import dp_size
    from hsextract.window import Lengths, choose

    cfg = read_config(cfg_path)
    arr = np.asarray(lens, np.int64)
    p50, p99 = np.percentile(arr, [50, 99]).tolist()
    src = "the race's records (what the merge counts)"
    win = choose(cfg, Lengths(float(arr.mean()), p50, p99, len(lens), src))
    dp = dp_size(cfg)
    same = win.max_running * dp
    return {
        "hsextract": win.describe(dp),
        "hsextract_requests_per_turn": win.requests * dp,
        "hsextract_tokens_per_turn": win.tokens * dp if win.tokens is not None else None,
        "max_running_requests": win.max_running,
        "bare_in_flight": same if in_flight == "same" else int(in_flight),
    }


def run_bare(work: Path, cfg_path: Path, records: list[dict], in_flight: int,
             max_running: int | None = None) -> dict:  # fmt: skip
    """The same server and flags with no capture: every record's /generate, ``in_flight``
    at once; ``max_running``: its ``--max-running-requests`` (hsextract's derived one)."""
    import requests

    from hsextract import server
    from hsextract.config import read_config

    cfg = read_config(cfg_path)
    name = cfg_path.parent.name
    tag = f"bare-{name[4:]}" if name.startswith("hsx-dp") else "bare"
    spec = server.build_spec(cfg, run_dir=work / tag, log_path=work / "logs" / f"{tag}.log")
    argv = list(spec.argv)
    if "--forward-hooks" in argv:  # the reference engine has none: no dump dir, no capture
        i = argv.index("--forward-hooks")
        del argv[i : i + 2]
    if max_running is not None:
        argv[argv.index("--max-running-requests") + 1] = str(max_running)
    spec.argv = argv
    spec.env = {k: v for k, v in spec.env.items() if k != "SGLANG_HS_DUMP_DIR"}
    import psutil

    before = set(psutil.pids())  # the server's processes count as the contender's
    t = time.monotonic()
    state = server.start(spec, owner=os.getpid())
    load_s = time.monotonic() - t
    local = threading.local()

    def gen(rec: dict) -> None:
        s = getattr(local, "s", None) or requests.Session()
        local.s = s
        body = {"input_ids": rec["input_ids"], "rid": f"bare-{rec['id']}",
                "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
        s.post(f"{state['url']}/generate", json=body, timeout=600).raise_for_status()

    try:
        # The window starts when the server answers, as hsextract's does (its state file's
        # healthy_at): the first shapes' kernel compilation falls inside both windows.
        since = time.time()
        with Sampler(before=before) as smp:
            t0 = t = time.monotonic()
            warm = sorted(records, key=lambda r: len(r["input_ids"]))
            with ThreadPoolExecutor(4) as pool:  # kernels compile on the first shapes
                list(pool.map(gen, [{**r, "id": "warm" + r["id"]} for r in (warm[:2] + warm[-2:])]))
            warm_s = time.monotonic() - t
            t, flood_at = time.monotonic(), time.time()
            with ThreadPoolExecutor(in_flight) as pool:
                list(pool.map(gen, records))
            flood_s = time.monotonic() - t
            flood_end = time.time()
            dt = time.monotonic() - t0
    finally:
        server.stop(state)
        shutil.rmtree(spec.dump_dir, ignore_errors=True)
    tokens = sum(len(r["input_ids"]) for r in records)
    return {
        "seconds": round(dt, 2), "tokens": tokens, "records": len(records),
        "in_flight": in_flight,
        "max_running_requests": int(argv[argv.index("--max-running-requests") + 1]),
        "tok_s": round(tokens / dt), "load_s": round(load_s, 1), "warmup_s": round(warm_s, 1),
        "tok_s_after_warmup": round(tokens / flood_s),
        # The sending phase: the first record's request sent to the last response.
        "sending_s": round(flood_s, 2), "sending_tok_s": round(tokens / flood_s),
        "gpu_busy_sending_pct": smp.busy_between(flood_at, flood_end),
        "bytes_per_token": 0, **smp.report(),
        "server": server_log_figures(work / "logs" / f"{tag}.log", since),
        "server_sending": server_log_figures(work / "logs" / f"{tag}.log", flood_at),
    }  # fmt: skip


SAMPLE_IDS = [f"r{i:06d}" for i in range(4)]  # kept whole, for the SpecForge cross-check


def _safetensors_extents(path: Path) -> tuple[bytes, list[tuple[int, int]]]:
    """A safetensors file's header and each tensor's byte range in the file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = f.read(n)
    base = 8 + n
    spans = [
        (base + v["data_offsets"][0], base + v["data_offsets"][1])
        for k, v in json.loads(header).items()
        if k != "__metadata__"
    ]
    return header, spans


def _punch_largest_tensor(path: Path) -> int:
    """Free the disk blocks of a finished chunk file's largest tensor (the states), keeping
    its size, header and small tensors (offsets, frame table): ``check_chunk`` and the
    manifest still read them.  Returns the bytes freed.  Bench only: the file no longer
    holds its states, and ``hsextract verify`` would rightly fail on it."""
    import ctypes

    _, spans = _safetensors_extents(path)
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    lo = -(-lo // 4096) * 4096
    if hi - lo <= 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    before = path.stat().st_blocks * 512
    fd = os.open(path, os.O_RDWR)
    try:  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        if libc.fallocate(fd, 3, lo, hi - lo) != 0:
            raise OSError(ctypes.get_errno(), f"fallocate punch hole {path}")
    finally:
        os.close(fd)
    return before - path.stat().st_blocks * 512


def _reclaimer(results: Path, stop: threading.Event, ledger: dict) -> None:
    """The 8B race writes ~10.7 KB per token (dummy-weight states, lossless): a 5-minute
    round is ~110 GB, and the H200 machine has 64 GiB of disk.  Once a chunk is finished
    (its sidecar, written after the file's fsync and sha256, exists), its on-disk bytes
    are counted, then its states' blocks are freed.  Chunks holding the cross-check's
    records stay whole."""
    seen: set[Path] = set()
    while True:
        last = stop.is_set()
        for sc in results.glob("*/hidden/chunk_*.json"):
            if sc in seen:
                continue
            p = sc.with_suffix(".safetensors")
            try:
                json.loads(sc.read_text())
                header, _ = _safetensors_extents(p)
                disk = p.stat().st_blocks * 512
            except (OSError, ValueError):
                continue  # being written
            seen.add(sc)
            ledger["disk_bytes"] = ledger.get("disk_bytes", 0) + disk
            if any(rid.encode() in header for rid in SAMPLE_IDS):
                continue
            ledger["freed_bytes"] = ledger.get("freed_bytes", 0) + _punch_largest_tensor(p)
            ledger["punched"] = ledger.get("punched", 0) + 1
        if last:
            return
        stop.wait(0.5)


def _last_output_at(run: Path) -> float | None:
    """When extract_all's last output was written: the manifest and the report's files
    (each written to a temporary name and renamed: in place means durable)."""
    outs = [run / "manifest.json", *(run / "report").glob("*")]
    times = [p.stat().st_mtime for p in outs if p.exists()]
    return max(times) if times else None


def run_hsextract(work: Path, cfg_path: Path, jobs: int, tokens: int, timeout_s: float,
                  reclaim: bool = False) -> dict:  # fmt: skip
    """``snakemake -jN extract_all`` as a user runs it."""
    cmd = _snakemake_cmd(cfg_path, jobs)
    env = None
    if reclaim:  # the preflight must not refuse what the reclaimer frees (reclaim_shim/)
        shim = str(Path(__file__).resolve().parent / "reclaim_shim")
        env = {
            **os.environ,
            "HSEXTRACT_BENCH_FREE_FACTOR": "8",
            "PYTHONPATH": os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")])),
        }
    log = open(work / "logs" / "snakemake.log", "w")  # noqa: SIM115 - closed below
    t_start = time.time()
    with Sampler() as smp:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        healthy: list[float] = []
        results = results_dir(cfg_path)
        watch = threading.Thread(target=_watch_server, args=(results, proc, healthy))
        watch.start()
        ledger: dict = {}
        stop_reclaim = threading.Event()
        reclaimer = threading.Thread(target=_reclaimer, args=(results, stop_reclaim, ledger))
        if reclaim:
            reclaimer.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # Snakemake's onerror stops the server
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
            rc = f"timed out after {timeout_s:.0f} s (rc {rc})"
        t_end = time.time()
        watch.join()
        if not healthy:  # the live file went before the watcher saw it healthy
            healthy += _healthy_from_sidecars(results)
        stop_reclaim.set()
        if reclaim:
            reclaimer.join()
    log.close()
    out: dict = {"rc": rc, "wall_s": round(t_end - t_start, 1), **smp.report()}
    if not healthy:
        out["error"] = "no server came up: " + (work / "logs" / "snakemake.log").read_text()[-3000:]
        return out
    run, healthy = Path(healthy[1]), healthy[0]
    chunks = sorted((run / "hidden").glob("chunk_*.safetensors"))
    sidecars = [json.loads(p.with_suffix(".json").read_text()) for p in chunks
                if p.with_suffix(".json").exists()]  # fmt: skip
    done_tokens = sum(s["tokens"] for s in sidecars)
    # The window ends when the run's last output is in place (manifest, report), as the
    # bare server's ends at its last response: stopping either server is left out of both.
    # Snakemake's exit (after onsuccess has stopped the server) is reported beside it.
    last_out = _last_output_at(run) or t_end
    window = last_out - healthy
    on_disk = ledger.get("disk_bytes") if reclaim else disk_bytes(chunks)
    out.update(
        run_dir=str(run), load_s=round(healthy - t_start, 1), seconds=round(window, 2),
        seconds_to_exit=round(t_end - healthy, 2), reclaim=ledger if reclaim else None,
        last_chunk_file_s=round(max(s.get("finished_at", 0) for s in sidecars) - healthy, 2)
        if sidecars else None,
        tokens=done_tokens, expected_tokens=tokens, chunks=len(sidecars),
        records=sum(s["records"] for s in sidecars),
        tok_s=round(done_tokens / window) if window > 0 else None,
        tok_s_to_exit=round(done_tokens / (t_end - healthy)) if t_end > healthy else None,
        bytes_per_token=round((on_disk or 0) / max(done_tokens, 1), 1),
        stored_over_raw=round(sum(s["states_stored_bytes"] for s in sidecars)
                              / max(sum(s["states_raw_bytes"] for s in sidecars), 1), 3),
        first_chunk_started=round(min(s["started_at"] for s in sidecars) - healthy, 2)
        if sidecars else None,
        waited_for_turn_s=round(sum(s["waited_for_turn_s"] for s in sidecars), 1),
        waited_for_server_s=round(max((s.get("waited_for_server_s", 0) for s in sidecars),
                                      default=0), 1),
        shm_peak_in_sidecars_gb=round(max((s["shm_peak_bytes"] for s in sidecars), default=0)
                                      / 1e9, 2),
    )  # fmt: skip
    out["server"] = server_log_figures(run / "logs" / "server.log", healthy)
    if sidecars:
        out.update(sending_figures(sidecars, jobs_n=jobs, n_turns=turns_used(sidecars)))
        first = out["first_sent_at"]
        out["gpu_busy_sending_pct"] = smp.busy_between(first, first + out["sending_s"])
        out["server_sending"] = server_log_figures(run / "logs" / "server.log",
                                                   out["first_sent_at"])  # fmt: skip
    man = run / "manifest.json"
    out["manifest"] = man.exists()
    if man.exists():
        data = json.loads(man.read_text())
        out["manifest_totals"] = data["totals"]
    return out


def sending_figures(sidecars: list[dict], jobs_n: int, n_turns: int) -> dict:
    """The sending phase from the chunks' sidecars, and where each job's time went.

    Sending phase: the first request sent (the first turn taken) to the last response
    (``last_response_at``), the bare server's flood window's like; ``to_drained``: to
    the last response's rows written (``drained_at``; ``finished_at`` for older
    sidecars), the client's work after the server's.  Turns: how many were held, as
    shares of that phase (``sending`` windows [taken, released]); ``vacant_turn_share``
    is the mean fraction of ``sending_jobs`` turns nobody held.  Per job (medians, s):
    ``start`` process start to the chunk job's code running (interpreter, Snakemake's
    preamble, imports: ``process_started_at``), ``ready`` from there to ready to send
    (records, writer; the server wait excluded), ``send`` the turn held, ``drain`` its
    last request sent to its last response written, ``finish`` fsync, sha256, check,
    sidecar; ``spawn`` a finished job's sidecar to the next job's process start (exit,
    Snakemake's bookkeeping and dispatch).  ``in_flight_mean``: the requests in flight
    over the phase on average, all of them (``window``) and where they were (``shm``,
    ``answer``, ``pieces``, ``client``; the sidecars' ``request_s``)."""
    tokens = sum(s["tokens"] for s in sidecars)
    takes = [s["sending"][0] for s in sidecars]
    rels = [s["sending"][1] for s in sidecars]
    drained = [s.get("drained_at") or s["finished_at"] for s in sidecars]
    answered = [s.get("last_response_at") or d for s, d in zip(sidecars, drained, strict=True)]
    first, last = min(takes), max(drained)
    ev = sorted([(t, 1) for t in takes] + [(t, -1) for t in rels])
    held, prev, share = 0, first, {}
    for t, d in ev:
        share[held] = share.get(held, 0.0) + max(0.0, t - prev)
        held, prev = held + d, t
    share[0] = share.get(0, 0.0) + max(0.0, last - prev)
    span = max(last - first, 1e-9)
    answer_span = max(max(answered) - first, 1e-9)
    out = {
        "first_sent_at": first,
        "sending_s": round(answer_span, 2),
        "sending_tok_s": round(tokens / answer_span),
        "to_drained_s": round(span, 2),
        "to_drained_tok_s": round(tokens / span),
        "turns_held_share": {k: round(v / span, 3) for k, v in sorted(share.items())},
    }
    out["vacant_turn_share"] = round(
        sum(max(0, n_turns - k) * v for k, v in share.items()) / (n_turns * span), 3
    )

    def med(xs: list[float]) -> float | None:
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 2) if xs else None

    job: dict = {}
    if all(s.get("process_started_at") for s in sidecars):
        job["start"] = med([s["started_at"] - s["waited_for_server_s"] - s["process_started_at"]
                            for s in sidecars])  # fmt: skip
        starts = sorted(s["process_started_at"] for s in sidecars)[jobs_n:]
        spawn = []
        for f in sorted(s["finished_at"] for s in sidecars):
            nxt = [p for p in starts if p > f]
            if nxt:
                spawn.append(min(nxt) - f)
                starts.remove(min(nxt))
        job["spawn"] = med(spawn)
        job["spawn_max"] = round(max(spawn), 2) if spawn else None
    job["ready"] = med([s["sending"][0] - s["waited_for_turn_s"] - s["started_at"]
                        for s in sidecars])  # fmt: skip
    job["waited_for_turn"] = med([s["waited_for_turn_s"] for s in sidecars])
    job["send"] = med([s["sending"][1] - s["sending"][0] for s in sidecars])
    job["drain"] = med([d - s["sending"][1] for s, d in zip(sidecars, drained, strict=True)])
    job["finish"] = med([s["finished_at"] - d for s, d in zip(sidecars, drained, strict=True)])
    out["job_s"] = job
    if all("request_s" in s for s in sidecars):
        # Little's law: request-seconds over the phase = the mean requests in flight, here
        # split by where they were: waiting for /dev/shm room, for the server's answer,
        # for its pieces (the capture's writers), or in the client's own work after that.
        keys = ("window", "shm", "answer", "pieces")
        sums = {k: sum(s["request_s"][k] for s in sidecars) for k in keys}
        sums["client"] = sums["window"] - sums["shm"] - sums["answer"] - sums["pieces"]
        out["in_flight_mean"] = {k: round(v / span, 1) for k, v in sums.items()}
    return out


def _snakemake_cmd(cfg_path: Path, jobs: int) -> list[str]:
    return [sys.executable, "-m", "snakemake", "extract_all", "-s", str(REPO / "Snakefile"),
            "--directory", str(cfg_path.parent), f"-j{jobs}", "--scheduler", "greedy",
            "--configfile", str(cfg_path)]  # fmt: skip


def run_fault(work: Path, n_records: int, n_chunks: int, jobs: int, deadline: float) -> dict:
    """The fault: ``snakemake -jN extract_all`` SIGKILLed (its whole process group: the
    workflow and its chunk jobs, as when the driver's node session dies) once half the
    chunks are finished, then what the README tells the user to do after a SIGKILL:
    ``snakemake --unlock`` (Snakemake's own lock outlives its process), and the same
    command again.  What the second run redoes, and whether ``hsextract verify`` then
    passes with every record present.  Its logs go beside the other contenders'."""
    fw = work / "fault"
    (fw / "model").mkdir(parents=True, exist_ok=True)
    (fw / "logs").mkdir(exist_ok=True)
    out_logs = work / "logs" / "fault"
    out_logs.mkdir(parents=True, exist_ok=True)
    shutil.copy(work / "model" / "config.json", fw / "model" / "config.json")
    data = fw / "data.jsonl"
    with open(work / "data.jsonl") as src, open(data, "w") as dst:
        for _, line in zip(range(n_records), src, strict=False):
            dst.write(line)
    cfg_path = hsx_config(fw, data, n_chunks)
    cmd = _snakemake_cmd(cfg_path, jobs)
    out: dict = {"records": n_records, "chunks": n_chunks}
    t0 = time.monotonic()
    with open(fw / "logs" / "first.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        done: list[str] = []
        # The second run needs a server start (~60 s) and the other half: keep ~110 s.
        while proc.poll() is None and time.monotonic() < deadline - 110:
            done = sorted(p.stem for p in (fw / "results").glob("*/hidden/chunk_*.json"))
            if len(done) >= n_chunks // 2:
                os.killpg(proc.pid, signal.SIGKILL)
                out["killed_after_s"] = round(time.monotonic() - t0, 1)
                break
            time.sleep(0.05)
        else:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    out["finished_before_kill"] = done
    if "killed_after_s" not in out:
        out["error"] = "the first run ended (or ran out of time) before half its chunks"
        return out
    t1 = time.monotonic()
    unlock = subprocess.run([*cmd, "--unlock"], capture_output=True, text=True, timeout=120)
    out["unlock_rc"] = unlock.returncode
    (fw / "logs" / "unlock.log").write_text(unlock.stdout + unlock.stderr)
    with open(fw / "logs" / "second.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out["rerun_rc"] = proc.wait(timeout=max(10.0, deadline - time.monotonic() - 20))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            out["rerun_rc"] = f"timed out (rc {proc.wait()})"
    out["rerun_s"] = round(time.monotonic() - t1, 1)
    text = (fw / "logs" / "second.log").read_text(errors="replace")
    redone = sorted(set(re.findall(r"wildcards: chunk=(\d+)", text)))  # extract_chunk jobs
    out["redone"] = [f"chunk_{c}" for c in redone]
    # In flight at the kill, by Snakemake's own account: a chunk job it had started and not
    # seen finish.  Its chunk file may already be in place (renamed, sidecar written) while
    # the job still runs; Snakemake then marks the output incomplete and the rerun redoes it.
    first = (fw / "logs" / "first.log").read_text(errors="replace")
    started = dict(re.findall(r"jobid: (\d+)\n(?:.*\n){0,4}?\s*wildcards: chunk=(\d+)", first))
    finished = set(re.findall(r"Finished jobid: (\d+) \(Rule: extract_chunk\)", first))
    in_flight = sorted(f"chunk_{c}" for j, c in started.items() if j not in finished)
    out["in_flight_at_kill"] = in_flight
    out["redone_only_in_flight"] = set(out["redone"]) <= set(in_flight)
    for f in (fw / "logs").glob("*.log"):
        shutil.copy(f, out_logs / f.name)
    runs = list((fw / "results").glob("*/manifest.json"))
    if runs:
        man = json.loads(runs[0].read_text())
        out["manifest_records"] = man["totals"]["records"]
        out["complete"] = man["totals"]["records"] == n_records
        out.update(verify_hsextract(runs[0].parent, deadline))
    shutil.rmtree(fw / "results", ignore_errors=True)
    return out


def _watch_server(results: Path, proc: subprocess.Popen, found: list) -> None:
    """When the workflow's server became healthy: launch_server does not wait for it, so
    the first chunk job to see it healthy records ``healthy_at`` in the live state file
    (``state/server.<host>.live.json``), which exists only while the run does (onsuccess
    stops the server and removes it); :func:`_healthy_from_sidecars` is the fallback."""
    while proc.poll() is None and not found:
        for p in results.glob("*/state/server.*.live.json"):
            try:
                st = json.loads(p.read_text())
            except (OSError, ValueError):
                continue  # being written
            if st.get("healthy_at"):
                found += [float(st["healthy_at"]), str(p.parent.parent)]
                break
        time.sleep(0.1)


def _healthy_from_sidecars(results: Path) -> list:
    """[healthy_at, run dir] from the chunks' sidecars (each names the server it used)."""
    for run in results.glob("*/"):
        times = []
        for p in (run / "hidden").glob("chunk_*.json"):
            try:
                t = json.loads(p.read_text()).get("server", {}).get("healthy_at")
            except (OSError, ValueError):
                continue
            if t:
                times.append(float(t))
        if times:
            return [min(times), str(run)]
    return []


def verify_hsextract(run: Path, deadline: float) -> dict:
    """``hsextract verify`` of the manifest (re-hashes every chunk), if time allows."""
    if time.monotonic() > deadline:
        return {"verify": "skipped (time)"}
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "verify", str(run / "manifest.json")],
        capture_output=True, text=True, timeout=max(10.0, deadline - time.monotonic()),
    )  # fmt: skip
    return {"verify_rc": proc.returncode, "verify_s": round(time.monotonic() - t, 1),
            "verify_out": (proc.stdout + proc.stderr)[-600:]}  # fmt: skip


def sample_states(run: Path, ids: list[str]) -> dict:
    """A few records' states from hsextract's chunks, for the cross-check with SpecForge."""
    from hsextract.chunks import ChunkReader

    want, got = set(ids), {}
    for p in sorted((run / "hidden").glob("chunk_*.safetensors")):
        # --reclaim punched the states of every chunk holding no sample (their sha256 no
        # longer matches): only the ids are read from those; a chunk with samples, kept
        # whole, is checked.
        r = ChunkReader(p, verify=False)
        if not want & set(r.record_ids):
            continue
        r = ChunkReader(p)
        for j, rid in enumerate(r.record_ids):
            if rid in want:
                rec = r[j]
                got[rid] = {k: rec[k].clone() for k in ("input_ids", "hidden_states",
                                                         "aux_hidden_states")}  # fmt: skip
    return got


def specforge_subset(lens: list[int], batch: int, padded_budget: int) -> int:
    """How many records (a multiple of ``batch``) SpecForge gets: its padded tokens (each
    batch padded to its longest record) stay under ``padded_budget`` (the disk)."""
    n, padded = 0, 0
    while n + batch <= len(lens):
        add = max(lens[n : n + batch]) * batch
        if padded + add > padded_budget:
            break
        n, padded = n + batch, padded + add
    return n


def run_specforge(work: Path, sf_dir: Path, n: int, compress: bool, timeout_s: float) -> dict:
    """SpecForge's capture in a child process (its own torch.distributed world of one)."""
    tag = "specforge-gz" if compress else "specforge"
    out_dir = work / tag
    res = work / f"{tag}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "_specforge",
        "--work",
        str(work),
        "--specforge",
        str(sf_dir),
        "--n",
        str(n),
        "--out",
        str(out_dir),
        "--json",
        str(res),
    ]
    if compress:
        cmd.append("--compress")
    log = open(work / "logs" / f"{tag}.log", "w")  # noqa: SIM115
    with Sampler() as smp:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = f"killed after {timeout_s:.0f} s"
    log.close()
    out = json.loads(res.read_text()) if res.exists() else {}
    out.update(rc=rc, **smp.report())
    files = sorted(out_dir.rglob("data_*.ckpt*"))
    out["files"] = len(files)
    if files:
        out["bytes_per_token"] = round(disk_bytes(files) / max(out.get("tokens", 1), 1), 1)
    if not res.exists():
        out["error"] = (work / "logs" / f"{tag}.log").read_text()[-3000:]
    return out


def _permissive_module(name: str):
    """A module whose every attribute is a decorator / type stand-in (never called here)."""
    import types

    class _Any:
        def __call__(self, *a, **k):
            return a[0] if len(a) == 1 and callable(a[0]) and not k else _Any()

        def __getitem__(self, key):
            return _Any()

        def __getattr__(self, key):
            return _Any()

    mod = types.ModuleType(name)

    def attr(key: str):
        if key.startswith("__"):  # inspect and importlib probe __file__, __path__, ...
            raise AttributeError(key)
        return _Any()

    mod.__getattr__ = attr  # type: ignore[method-assign]
    return mod


def specforge_worker(args: argparse.Namespace) -> None:
    """Inside the child: SpecForge's script, as its main() drives it, on our records."""
    import importlib.util
    import socket
    import types

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    try:
        import cuda.tile  # noqa: F401
    except ImportError:
        # SGLang's dp_attn (which SpecForge's backend imports) pulls in flashinfer.comm,
        # whose multi-GPU all-gather matmul imports cuTile at module level; the H200 image
        # has no cuda-tile, and nothing on this one-GPU path calls it.
        try:
            import cuda
        except ImportError:
            cuda = sys.modules["cuda"] = types.ModuleType("cuda")
        cuda.tile = sys.modules["cuda.tile"] = _permissive_module("cuda.tile")
    try:
        import datasets  # noqa: F401
    except ImportError:
        # The script imports HF datasets for its conversation loader and tokenizing map,
        # which we skip (our records are token ids already); nothing we call uses it.
        stub = types.ModuleType("datasets")
        stub.Dataset = type("Dataset", (), {})
        sys.modules["datasets"] = stub
    sf = Path(args.specforge)
    sys.path.insert(0, str(sf / "site"))
    spec = importlib.util.spec_from_file_location(
        "prepare_hidden_states", sf / "prepare_hidden_states.py"
    )
    phs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(phs)
    import torch
    from transformers import AutoConfig

    work = Path(args.work)
    model = str(work / "model")
    argv = ["--target-model-path", model, "--data-path", str(work / "data.jsonl"),
            "--output-path", args.out, "--max-length", str(MAX_LEN), "--tp-size", "1",
            "--batch-size", "32", "--sglang-attention-backend", "triton",
            "--sglang-mem-fraction-static", "0.6"]  # fmt: skip
    if args.compress:
        argv.append("--compress")
    sys.argv = ["prepare_hidden_states.py", *argv]
    a = phs.parse_args()
    a.num_io_threads = a.num_io_threads or max(1, os.cpu_count() or 1)  # as main() does
    base_kwargs = phs._sglang_kwargs
    phs._sglang_kwargs = lambda ns: {**base_kwargs(ns), "load_format": "dummy",
                                     "skip_tokenizer_init": True}  # fmt: skip
    t0 = time.monotonic()
    tcfg = AutoConfig.from_pretrained(model)
    plan = phs.resolve_offline_capture_plan(a, tcfg)
    phs.init_distributed(timeout=a.dist_timeout, tp_size=a.tp_size)
    target = phs.build_target_model(a, tcfg, capture_layers=list(plan.capture_layers),
                                    capture_method=plan.capture_method)  # fmt: skip
    load_s = time.monotonic() - t0
    recs = []
    with open(work / "data.jsonl") as f:
        for line in f:
            if len(recs) == args.n:
                break
            r = json.loads(line)
            ids = torch.tensor(r["input_ids"], dtype=torch.long)[None]
            recs.append(
                {
                    "input_ids": ids,
                    "attention_mask": torch.ones_like(ids),
                    "loss_mask": torch.tensor(r["loss_mask"], dtype=torch.long)[None],
                }
            )
    # Warm-up outside the window, as the servers had: the first shapes compile kernels.
    for k in (0, 1):
        b = recs[k]
        target.capture(**{key: v.cuda() for key, v in b.items()})
    torch.cuda.synchronize()
    loader = phs.prepare_dp_dataloaders(
        recs,
        batch_size=a.batch_size,
        num_workers=a.num_workers,
        shuffle=False,
        process_group=phs.get_dp_group(),
    )
    padded = sum(max(x["input_ids"].shape[1] for x in recs[i : i + a.batch_size]) * a.batch_size
                 for i in range(0, len(recs) - a.batch_size + 1, a.batch_size))  # fmt: skip
    tokens = sum(x["input_ids"].shape[1] for x in recs[: len(loader) * a.batch_size])
    t = time.monotonic()
    with phs.HiddenStatesGenerator(target, capture_layout=plan.layout,
                                   num_io_threads=a.num_io_threads, io_queue_size=a.io_queue_size,
                                   file_group_size=a.file_group_size, compress=a.compress,
                                   compression_level=a.compression_level) as gen:  # fmt: skip
        gen.generate(loader, output_path=a.output_path, start_idx=0, samples_per_dp=len(recs))
    written = time.monotonic() - t
    os.sync()  # SpecForge never fsyncs: its files are durable once the page cache is written
    dt = time.monotonic() - t
    Path(args.json).write_text(json.dumps({
        "seconds": round(dt, 2), "written_s": round(written, 2), "sync_s": round(dt - written, 2),
        "tokens": tokens, "padded_tokens": padded, "records": len(loader) * a.batch_size,
        "tok_s": round(tokens / dt), "load_s": round(load_s, 1),
        "capture_layers": list(plan.capture_layers), "compress": a.compress,
        "batch_size": a.batch_size, "num_io_threads": a.num_io_threads,
    }))  # fmt: skip
    phs.destroy_distributed()


def crosscheck(hsx: dict, sf_dir: Path, n_files: int = 4) -> dict:
    """hsextract's and SpecForge's states of the same records (relative RMS per layer)."""
    import torch

    out = {}
    for rid, h in list(hsx.items())[:n_files]:
        idx = int(rid[1:])
        files = list(sf_dir.rglob(f"data_{idx}.ckpt"))
        if not files:
            continue
        d = torch.load(files[0], map_location="cpu", weights_only=True)
        n = h["input_ids"].numel()
        same_ids = bool(torch.equal(d["input_ids"].view(-1)[:n].to(torch.int64),
                                    h["input_ids"].to(torch.int64)))  # fmt: skip

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            a, b = a.float(), b.float()
            return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))

        out[rid] = {
            "tokens": n, "ckpt_tokens": int(d["input_ids"].numel()), "same_ids": same_ids,
            "final_rel_rms": rel(d["hidden_state"][0, :n], h["hidden_states"]),
            "aux_rel_rms": rel(d["aux_hidden_state"][0, :n], h["aux_hidden_states"]),
        }  # fmt: skip
    return out


def parse_tokens(text: str) -> int:
    """``47000``, ``47k``, ``2.25M``."""
    mult = {"k": 1e3, "m": 1e6}.get(text[-1:].lower(), 1)
    return int(float(text[:-1] if mult != 1 else text) * mult)


def chunk_plan(variant: str, args: argparse.Namespace, lens: list[int]) -> dict:
    """How many chunks a hsextract variant gets: ``hsextract`` (``--chunks`` /
    ``--chunk-tokens``), ``hsextract@47k`` (chunks of ~47k tokens) or ``hsextract@auto``
    (``n_chunks: auto``: the workflow sizes it, ``hsextract.sizing``; where this tree's
    config does not take ``auto`` yet, the race computes the same choice and passes it)."""
    tokens = sum(lens)
    spec = variant.split("@", 1)[1] if "@" in variant else None
    if spec is None:
        spec = args.chunks if args.chunk_tokens is None else args.chunk_tokens
        if spec != "auto" and args.chunk_tokens is None:
            return {"n_chunks": int(spec)}
    if spec == "auto":
        return {"n_chunks": "auto"}
    n = max(1, round(tokens / parse_tokens(str(spec))))
    return {"n_chunks": n, "chunk_tokens": parse_tokens(str(spec))}


def resolve_auto(cfg_path: Path, lens: list[int]) -> dict:
    """``n_chunks: auto`` as written: kept where the config takes it (the workflow then
    chooses), else replaced by ``sizing.auto_chunks``'s choice.  Either way the choice is
    reported (``describe``)."""
    import yaml

    from hsextract import sizing
    from hsextract.config import load_config, read_config

    raw = yaml.safe_load(cfg_path.read_text())
    try:
        load_config(cfg_path)
        via = "workflow"
    except Exception as exc:  # this tree's schema: an integer only
        via = f"race (the config refused auto: {str(exc)[:120]})"
    probe = dict(raw, n_chunks=1)
    tmp = cfg_path.with_name("probe.yaml")
    tmp.write_text(yaml.safe_dump(probe))
    choice = sizing.auto_chunks(read_config(tmp), sum(lens), len(lens))
    tmp.unlink()
    if via != "workflow":
        raw["n_chunks"] = choice.n_chunks
        cfg_path.write_text(yaml.safe_dump(raw))
    return {"auto": choice.describe(), "auto_n_chunks": choice.n_chunks, "auto_via": via}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b",
                    help="the target's shape (random weights)")  # fmt: skip
    ap.add_argument("--aux-layers", default=None,
                    help="aux layers: a count spread over [2, L-3], or a comma list "
                         "(default: SGLang's EAGLE-3 three)")  # fmt: skip
    ap.add_argument("--lengths", choices=LENGTH_MIXES, default="sharegpt",
                    help="record length mix")  # fmt: skip
    ap.add_argument("--records", type=int, default=4000)
    ap.add_argument("--tokens", default=None,
                    help="instead of --records: records up to this many tokens")  # fmt: skip
    ap.add_argument("--chunks", default="32", help="n_chunks, or auto")
    ap.add_argument("--chunk-tokens", default=None,
                    help="n_chunks = tokens / this (47k); hsextract@47k: per variant")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=8, help="snakemake -j")
    ap.add_argument("--in-flight", default="same",
                    help="bare: requests in flight; same (default): hsextract's window for "
                         "these records, its server at the same running limit")  # fmt: skip
    ap.add_argument("--contenders", default="bare,hsextract,specforge,specforge-gz",
                    help="comma list; hsextract@47k, hsextract@auto: chunk sizes")  # fmt: skip
    ap.add_argument(
        "--specforge",
        default=str(REPO / ".devcarry" / "specforge"),
        help="dir with site/ (the wheel unpacked) and prepare_hidden_states.py",
    )
    ap.add_argument(
        "--sf-padded-tokens",
        type=float,
        default=6e5,
        help="SpecForge's share: padded tokens (its files hold the padding)",
    )
    ap.add_argument("--sf-gz-padded-tokens", type=float, default=3e5)
    ap.add_argument("--sf-timeout", type=float, default=200, help="per SpecForge run")
    ap.add_argument("--budget-s", type=float, default=540, help="the whole run's time limit")
    ap.add_argument("--reserve-s", type=float, default=150,
                    help="kept per contender still to run")  # fmt: skip
    ap.add_argument("--work", default="/tmp/hsextract-race")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="records, configs, plan; no GPU")
    ap.add_argument(
        "--reclaim",
        action="store_true",
        help="free each finished chunk's states on disk (a 5-minute 8B round is ~110 GB)",
    )
    ap.add_argument("--fault-records", type=int, default=1600, help="hsextract-fault's records")
    ap.add_argument("--fault-chunks", type=int, default=16)
    ap.add_argument("--dp2-records", type=int, default=4000, help="bare-dp1/-dp2's records")
    args = ap.parse_args()
    t_begin = time.monotonic()
    deadline = t_begin + args.budget_s
    work = Path(args.work)
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    shape = MODELS[args.model]
    (work / "model" / "config.json").write_text(json.dumps(shape, indent=1))
    aux = aux_layer_list(args.aux_layers, shape["num_hidden_layers"])
    data = work / "data.jsonl"
    if args.tokens:
        lens = lengths_for_tokens(parse_tokens(args.tokens), args.seed, args.lengths)
    else:
        lens = lengths(args.records, args.seed, args.lengths)
    write_records(data, lens, args.seed, shape["vocab_size"])
    tokens = sum(lens)
    print(f"{args.model}, aux layers {aux or 'default'}, {args.lengths} lengths: "
          f"{len(lens)} records, {tokens:,} tokens: mean {statistics.mean(lens):.0f}, median "
          f"{statistics.median(lens):.0f}, p99 {sorted(lens)[int(0.99 * len(lens))]}, max "
          f"{max(lens)} ({time.monotonic() - t_begin:.0f} s)", flush=True)  # fmt: skip
    contenders = args.contenders.split(",")
    variants: dict[str, Path] = {}
    plans: dict[str, dict] = {}
    for name in contenders:
        if name != "hsextract" and not name.startswith("hsextract@"):
            continue
        tag = "hsx" if name == "hsextract" else "hsx-" + name.split("@", 1)[1].lower()
        plan = chunk_plan(name, args, lens)
        variants[name] = hsx_config(work, data, plan["n_chunks"], tag, aux)
        if plan["n_chunks"] == "auto":
            plan.update(resolve_auto(variants[name], lens))
        plans[name] = plan
        print(f"{name}: {json.dumps(plan)}", flush=True)
    cfg_path = next(iter(variants.values()), None) or hsx_config(work, data, 32, "hsx", aux)
    if "hsextract@auto" not in variants:  # what auto would choose, said either way
        plans["auto (not run)"] = resolve_auto(
            hsx_config(work, data, "auto", "hsx-plan", aux), lens
        )
        print(f"n_chunks auto (not run): {plans['auto (not run)']['auto']}", flush=True)
    # Matplotlib builds its font cache on a machine's first import (~2 s, then never again):
    # the fresh H200 paid it inside hsextract's window, in the report rule.  A user pays it
    # once per machine, not per run; it is paid here, before any window.
    subprocess.run([sys.executable, "-c", "import matplotlib.pyplot"], check=False)
    results: dict = {"records": len(lens), "tokens": tokens, "argv": sys.argv,
                     "model": args.model, "aux_layers": aux, "lengths": args.lengths,
                     "plans": plans, "contenders": {}}  # fmt: skip
    # One device call holds ~9 minutes: contenders of one race may run in several calls on
    # the same (warm) machine; the same records give the same figures, and earlier calls'
    # figures are kept beside this one's.
    kept = work / "race.json"
    if kept.exists():
        old = json.loads(kept.read_text())
        if (old.get("records"), old.get("tokens")) == (len(lens), tokens):
            results["contenders"] = old.get("contenders", {})
            results["earlier_argv"] = old.get("earlier_argv", []) + [old.get("argv")]
    out_dir = Path(os.environ.get("OUT", work / "out"))
    out_dir.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        text = json.dumps(results, indent=1, default=str)
        (out_dir / "race.json").write_text(text)
        kept.write_text(text)

    n_sf = specforge_subset(lens, 32, int(args.sf_padded_tokens))
    n_gz = specforge_subset(lens, 32, int(args.sf_gz_padded_tokens))
    if any(c.startswith("specforge") for c in contenders):
        print(f"specforge gets {n_sf} records ({sum(lens[:n_sf]):,} tokens), with --compress "
              f"{n_gz} ({sum(lens[:n_gz]):,})", flush=True)  # fmt: skip
    windows = {"bare": race_window(cfg_path, lens, args.in_flight)}
    same = windows["bare"]
    print(f"window: hsextract {same['hsextract']}", flush=True)
    print(f"window: bare {same['bare_in_flight']} requests in flight, "
          f"--max-running-requests {same['max_running_requests']}", flush=True)  # fmt: skip
    results["windows"] = windows
    if args.dry_run:
        from hsextract import server
        from hsextract.config import read_config

        cfg = read_config(cfg_path, {"sglang.version": "0.5.14"})
        spec = server.build_spec(cfg, run_dir=work, log_path=work / "logs" / "x.log")
        argv = list(spec.argv)  # before the merge: the race's derived limit, as bare's
        argv[argv.index("--max-running-requests") + 1] = str(
            windows["bare"]["max_running_requests"]
        )
        print(" ".join(argv))
        return
    records = [json.loads(line) for line in data.read_text().splitlines()]
    samples: dict = {}
    sf_n = {"specforge": (n_sf, False), "specforge-gz": (n_gz, True)}
    try:
        for name in contenders:  # in the order given
            left = deadline - time.monotonic()
            if left < 60:
                results["contenders"][name] = {"skipped": f"{left:.0f} s left"}
                continue
            print(f"== {name}", flush=True)
            if name == "bare":
                w = windows["bare"]
                r = run_bare(work, cfg_path, records, w["bare_in_flight"],
                             w["max_running_requests"])  # fmt: skip
            elif name in ("bare-dp1", "bare-dp2"):  # the same prefix: dp 1 vs dp 2
                conf = dp2_config(work, cfg_path) if name == "bare-dp2" else cfg_path
                w = windows[name] = race_window(conf, lens[: args.dp2_records], args.in_flight)
                r = run_bare(work, conf, records[: args.dp2_records], w["bare_in_flight"],
                             w["max_running_requests"])  # fmt: skip
            elif name == "hsextract-fault":
                if left < 280:  # two server starts, half a run each, verify
                    results["contenders"][name] = {"skipped": f"{left:.0f} s left"}
                    continue
                r = run_fault(work, args.fault_records, args.fault_chunks, args.jobs, deadline)
            elif name in variants:
                rest = contenders[contenders.index(name) + 1 :]
                reserve = args.reserve_s * len(rest)
                r = run_hsextract(
                    work,
                    variants[name],
                    args.jobs,
                    tokens,
                    max(60.0, left - reserve),
                    reclaim=args.reclaim,
                )
                r["plan"] = plans[name]
                if r.get("manifest"):
                    if not args.reclaim:  # freed states fail verify, rightly
                        r.update(verify_hsextract(Path(r["run_dir"]), deadline - reserve))
                    samples.update(sample_states(Path(r["run_dir"]), SAMPLE_IDS))  # kept whole
                if r.get("run_dir"):  # the disk is the next contender's
                    run = Path(r["run_dir"])
                    index = run / "chunks" / "index.json"
                    if index.exists():  # what the split made (auto: the workflow's choice)
                        r["n_chunks"] = len(json.loads(index.read_text()).get("chunks", []))
                    side = work / "logs" / ("sidecars" + variants[name].parent.name[3:])
                    side.mkdir(exist_ok=True)
                    for f in (run / "hidden").glob("chunk_*.json"):
                        shutil.copy(f, side / f.name)
                    r["window"] = sidecar_windows(side)
                    shutil.rmtree(run / "hidden", ignore_errors=True)
            else:
                n, compress = sf_n[name]
                limit = min(left - 20, args.sf_timeout)
                r = run_specforge(work, Path(args.specforge), n, compress, limit)
                keep = work / "sf-samples"  # a few of its files, for the cross-check
                keep.mkdir(exist_ok=True)
                for i in range(4):
                    for f in (work / name).rglob(f"data_{i}.ckpt"):
                        shutil.copy(f, keep / f.name)
                shutil.rmtree(work / name, ignore_errors=True)
            results["contenders"][name] = r
            save()
            print(json.dumps(r), flush=True)
            wait_gpu_free()
        if samples and (work / "sf-samples").exists():
            results["crosscheck"] = crosscheck(samples, work / "sf-samples")
            print("crosscheck", json.dumps(results["crosscheck"]), flush=True)
    finally:
        save()
        subprocess.run(["tar", "-cJf", str(out_dir / "race-logs.tar.xz"), "-C", str(work),
                        "logs", *[str(p.relative_to(work)) for p in work.glob(
                            "results*/*/logs")]], check=False)  # fmt: skip
    print_table(results["contenders"], time.monotonic() - t_begin)


def print_table(c: dict, elapsed: float) -> None:
    """Whole window and sending phase, each against the bare server of the same run."""
    bare = c.get("bare", {})
    b_all, b_send = bare.get("tok_s"), bare.get("sending_tok_s")
    print(
        "\ncontender          chunks  tok/s  /bare  send tok/s  /bare  drained  dry(send)  "
        "vacant  B/token  RAM GB  GPU%"
    )
    for name, r in c.items():
        ts, ss = r.get("tok_s"), r.get("sending_tok_s")
        ra = f"{ts / b_all:.3f}" if ts and b_all else "-"
        rs = f"{ss / b_send:.3f}" if ss and b_send else "-"
        dr = r.get("to_drained_tok_s")
        rd = f"{dr / b_send:.3f}" if dr and b_send else "-"
        srv = r.get("server_sending") or {}
        dry = (f"{srv.get('batches_with_empty_queue')}/{srv.get('prefill_batches')}"
               if srv else "-")  # fmt: skip
        print(f"{name:18s} {r.get('n_chunks', r.get('chunks', '-')):>6} {ts or '-':>6} {ra:>6} "
              f"{ss or '-':>10} {rs:>6} {rd:>8} {dry:>10} {r.get('vacant_turn_share', '-'):>7} "
              f"{r.get('bytes_per_token', '-'):>8} {r.get('peak_ram_gb', '-'):>7} "
              f"{r.get('gpu_busy_pct', '-'):>5}")  # fmt: skip
    parts = []
    for name, r in c.items():
        if name.startswith("hsextract") and name != "hsextract-fault":
            ts, ss = r.get("tok_s"), r.get("sending_tok_s")
            parts.append(f"{name}/bare sending {ss / b_send:.3f} whole {ts / b_all:.3f}"
                         if ts and ss and b_all and b_send else f"{name}/bare n/a")  # fmt: skip
    h, s = c.get("hsextract", {}).get("tok_s"), c.get("specforge", {}).get("tok_s")
    if h and s:
        parts.append(f"hsextract/specforge {h / s:.3f}")
    print(f"race: {', '.join(parts) or 'no hsextract figure'} ({elapsed:.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_specforge":
        p = argparse.ArgumentParser()
        for k in ("--work", "--specforge", "--out", "--json"):
            p.add_argument(k, required=True)
        p.add_argument("--n", type=int, required=True)
        p.add_argument("--compress", action="store_true")
        specforge_worker(p.parse_args(sys.argv[2:]))
    else:
        main()
