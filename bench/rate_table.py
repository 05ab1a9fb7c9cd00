"""The request-rate table (issue 40): record length x captured layers x dp, each cell the
bare server and then hsextract on the same records in one process, so in one device call.

A cell is (target shape, record length mix, aux layers, dp, tokens).  It runs
``bench/race.py``'s own contenders, imported: the bare server (``race.run_bare``: the same
flags minus the capture, at hsextract's window for these records, ``race.race_window``
with ``same``), then ``snakemake -j8 extract_all`` (``race.run_hsextract``, with
``--reclaim``'s punching on the GPU).  One row per finished cell is appended to the CSV
(``--csv``; temporary name and rename): the ratio is hsextract's sending-phase tok/s over
the bare server's (``race.sending_figures``: first request sent to last response, the
bare server's flood likewise), beside each side's requests/s in that phase, GPU busy (the
race's ``Sampler``, its samples within that phase) and SGLang's prefill passes with
an empty queue while sending (its log).  A cell already in the CSV is skipped, so a call
cut short is resumed by the same command; a cell that did not finish writes no row (its
figures go to ``rate_table.json``).  The CSV is copied to ``$OUT/rate_table.csv`` after
each cell: one device call holds ~9 minutes, so bench/README.md ("Request-rate table")
gives one command per call, each with the CSV the previous call brought back.

    HSEXTRACT_TIMEOUT=585 HSEXTRACT_RUN="python3 bench/rate_table.py --cells chat-7b-5aux \\
      --csv bench/tables/rate_table_h200.csv" bash h200/run.sh
    python bench/rate_table.py --render
    python bench/rate_table.py --quick --work /tmp/rt-quick --csv /tmp/rt-quick.csv

``--render`` prints docs/sglang.md's table from the committed CSVs
(``bench/tables/rate_table_<device>.csv``, each row dated); tests/test_rate_table.py checks that
the page holds exactly that, so a figure there can only come from a measurement.
``--quick``: one tiny cell on this CPU (the demo's model, the reference engine, capture
off for bare: no dump dir), what the test runs; its ratio means nothing.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
import race  # noqa: E402 - bench/race.py; it puts the repo's src/ on sys.path

TABLES = BENCH / "tables"
CSV_GLOB = "rate_table_*.csv"
MARKER = ".rate_table_bench"  # the work dir is ours: only then are cells removed in it


@dataclass(frozen=True)
class Cell:
    """One cell of the table.  ``need_s``: the call time it takes (two server starts with
    their loads, both floods, the workflow's tail), what a call must have left to start it."""

    model: str  # race.MODELS, or "demo" (--quick)
    lengths: str  # race.LENGTH_MIXES
    aux: str | None  # race.aux_layer_list's spec: a count, a list, None = EAGLE-3's three
    dp: int
    tokens: str  # race.parse_tokens
    need_s: float
    #: ``--set`` overrides of hsextract's config (``client.tokens_in_flight=21000``): an
    #: experiment on the window, its row told apart by its spec.
    sets: tuple[str, ...] = ()

    def spec(self, seed: int) -> str:
        """What the cell measured: a row is resumed only under the same spec.  ``sending=
        auto``: the derived sending jobs (cell_config), which rows of the set count before
        them lack, so a CSV of those is not resumed as these."""
        sets = f" set={','.join(self.sets)}" if self.sets else ""
        return (
            f"{self.model} {self.lengths} aux={self.aux or 'default'} dp={self.dp} "
            f"tokens={self.tokens} seed={seed} sending=auto{sets}"
        )


#: The issue's "Must show" cells.  Each fits one ~9-minute device call on its own (the
#: issue-40 run: bare and hsextract over 1.0 M chat tokens in ~390 s, a fresh machine's
#: kernel compilation included; the bimodal race: three contenders over 2.25 M in 541 s).
CELLS = {
    # 128-token records with 5 aux layers on a 7B of another family (issue 40's run).
    "chat-7b-5aux": Cell("qwen2.5-7b", "chat", "5", 1, "1.0M", need_s=400),
    # 550-token records (ShareGPT-like) on Qwen3-8B, EAGLE-3's three aux layers.
    "sharegpt-8b-3aux": Cell("qwen3-8b", "sharegpt", None, 1, "2M", need_s=400),
    # Issue 34's bimodal Llama-3.1-8B race, 4 aux layers.
    "bimodal-llama-4aux": Cell("llama3.1-8b", "bimodal", "4", 1, "2.25M", need_s=450),
    # dp 2 on the one GPU (race.dp2_config) with short records; bare at dp 2 too.
    "chat-7b-5aux-dp2": Cell("qwen2.5-7b", "chat", "5", 2, "1.0M", need_s=450),
}
#: --quick: the demo's tiny model on the reference engine (CPU), a few dozen records.
QUICK = {"quick": Cell("demo", "sharegpt", "2", 1, "1500", need_s=0)}

FIELDS = [
    "cell", "spec", "engine", "device", "sglang", "date_utc", "model", "lengths",
    "records", "tokens", "mean_len", "median_len", "p99_len", "aux_layers", "dp",
    "n_chunks", "hsx_requests_per_turn", "hsx_tokens_per_turn", "max_running_requests",
    "bare_in_flight",
    "bare_sending_s", "bare_sending_tok_s", "bare_req_s", "bare_gpu_busy_sending_pct",
    "bare_passes", "bare_passes_queue_empty",
    "hsx_sending_s", "hsx_sending_tok_s", "hsx_req_s", "hsx_gpu_busy_sending_pct",
    "hsx_passes", "hsx_passes_queue_empty",
    "ratio_sending", "bare_tok_s", "hsx_tok_s", "ratio_whole",
]  # fmt: skip


# --- running a cell ------------------------------------------------------------------------


def device_name() -> str:
    """The GPU the cell ran on (NVML), or the CPU's core count where there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # no GPU (--quick on a CPU)
        return f"CPU ({os.cpu_count()} cores)"


def sglang_version(engine: str) -> str:
    """The SGLang release that served the cell; none for the reference engine."""
    if engine != "sglang":
        return ""
    from hsextract.sglang.launch import installed_version

    return installed_version(sys.executable)  # the workflow's own detection


def cell_records(cell: Cell, cwork: Path, seed: int) -> tuple[Path, list[int], int]:
    """The cell's model dir and seeded records (race's lengths and ids)."""
    data = cwork / "data.jsonl"
    if cell.model == "demo":
        import stream_budget

        from hsextract.demo import build_demo_model

        build_demo_model(cwork / "model", stream_budget.QUICK_DEMO)
        lens = [min(x, stream_budget.QUICK_MAX_LEN) for x in race.lengths(4096, seed, cell.lengths)]
        want = race.parse_tokens(cell.tokens)
        lens = lens[: next(k for k in range(1, len(lens) + 1) if sum(lens[:k]) >= want)]
        vocab = stream_budget.QUICK_DEMO["vocab_size"]
    else:
        shape = race.MODELS[cell.model]
        (cwork / "model").mkdir(parents=True, exist_ok=True)
        (cwork / "model" / "config.json").write_text(json.dumps(shape, indent=1))
        lens = race.lengths_for_tokens(race.parse_tokens(cell.tokens), seed, cell.lengths)
        vocab = shape["vocab_size"]
    race.write_records(data, lens, seed, vocab)
    return data, lens, vocab


def cell_config(
    cell: Cell, cwork: Path, data: Path, tag: str = "hsx", sets: tuple[str, ...] = ()
) -> tuple[Path, list[int]]:
    """hsextract's config for the cell (``n_chunks: auto``), and the aux layers it captures.
    SGLang: race's (the shipped 1xH200 config, payload flags; dp 2: race.dp2_config);
    --quick: stream_budget's (config.yaml, reference engine).  ``client.sending_jobs`` is
    the shipped default, ``auto`` (derived from the cell's records and shape,
    hsextract.window), whatever count those configs set: the row is what ships.  ``tag``:
    a variant's own config dir and output root; ``sets``: its overrides, after the cell's."""
    import yaml

    from hsextract.convention import default_aux_layers

    if cell.model == "demo":
        import stream_budget

        n_layers = stream_budget.QUICK_DEMO["num_hidden_layers"]
        aux = race.aux_layer_list(cell.aux, n_layers)
        cfg_path = stream_budget.quick_config(cwork, data, "auto", tag)
        raw = yaml.safe_load(cfg_path.read_text())
        raw["aux_layers"] = aux
        cfg_path.write_text(yaml.safe_dump(raw))
    else:
        n_layers = race.MODELS[cell.model]["num_hidden_layers"]
        aux = race.aux_layer_list(cell.aux, n_layers)
        cfg_path = race.hsx_config(cwork, data, "auto", tag, aux)
    if cell.dp == 2:
        cfg_path = race.dp2_config(cwork, cfg_path)
    elif cell.dp != 1:
        raise SystemExit(f"dp {cell.dp}: only dp 2 on one GPU is set up (race.dp2_config)")
    apply_sets(cfg_path, ("client.sending_jobs=auto", *cell.sets, *sets))
    return cfg_path, aux if aux is not None else default_aux_layers(n_layers)


def apply_sets(cfg_path: Path, sets: tuple[str, ...]) -> None:
    """Each ``section.key=value`` (a YAML value) into the config at ``cfg_path``; a key or
    value the config's schema refuses ends the bench before any server starts."""
    import yaml

    from hsextract.config import read_config

    if not sets:
        return
    raw = yaml.safe_load(cfg_path.read_text())
    for item in sets:
        key, eq, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not eq or not isinstance(node, dict):
            raise SystemExit(f"--set {item!r}: not SECTION.KEY=VALUE, SECTION in {cfg_path}")
        node[leaf] = yaml.safe_load(value)
    tmp = cfg_path.with_name(f".{cfg_path.name}.set.tmp")  # beside it: its relative paths
    tmp.write_text(yaml.safe_dump(raw))
    try:
        read_config(tmp)
    except Exception as exc:  # the config's own message names the key
        tmp.unlink()
        raise SystemExit(f"--set {', '.join(sets)}: {exc}") from None
    tmp.replace(cfg_path)


def _per_s(n: float, seconds: float | None) -> float | None:
    return round(n / seconds, 1) if seconds else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


#: A variant: ``(label, sets)``, one more hsextract run of a cell with ``sets`` on top.
Variant = tuple[str, tuple[str, ...]]


def run_hsx(logs: Path, cfg_path: Path, jobs: int, tokens: int, timeout_s: float,
            reclaim: bool) -> dict:  # fmt: skip
    """``snakemake extract_all`` through race's contender (logs in ``logs/``); its chunks'
    sidecars kept in ``logs/../sidecars`` (the row's source), its states removed (disk)."""
    logs.mkdir(parents=True, exist_ok=True)
    hsx = race.run_hsextract(logs.parent, cfg_path, jobs, tokens, timeout_s, reclaim=reclaim)
    run = Path(hsx["run_dir"]) if hsx.get("run_dir") else None
    if run is not None:
        side = logs.parent / "sidecars"
        side.mkdir()
        for f in (run / "hidden").glob("chunk_*.json"):
            shutil.copy(f, side / f.name)
        hsx["window"] = race.sidecar_windows(side)
        shutil.rmtree(run / "hidden", ignore_errors=True)
    return hsx


def run_cell(name: str, cell: Cell, work: Path, seed: int, jobs: int, deadline: float,
             variants: tuple[Variant, ...] = ()) -> dict:  # fmt: skip
    """Bare, then hsextract, on the cell's records; the row (``row``: None unless both
    finished every record) and every figure the race reported.  Then each variant, time
    allowing: hsextract again with its sets, against the same bare run (``variants``:
    a lever measured in the very call, on the very host, that measures the shipped
    config; never a row)."""
    cwork = work / "cells" / name
    shutil.rmtree(cwork, ignore_errors=True)  # ours: under the marked work dir
    (cwork / "logs").mkdir(parents=True)
    data, lens, _ = cell_records(cell, cwork, seed)
    cfg_path, aux = cell_config(cell, cwork, data)
    # Every variant's config before any server starts: a set the schema refuses ends here.
    variant_cfgs = {label: cell_config(cell, cwork, data, f"hsx-{label}", sets)[0]
                    for label, sets in variants}  # fmt: skip
    engine = "reference" if cell.model == "demo" else "sglang"
    plan = race.resolve_auto(cfg_path, lens)
    window = race.race_window(cfg_path, lens, "same")
    print(f"== {name} ({cell.spec(seed)}): {len(lens)} records, {sum(lens):,} tokens; "
          f"window {window['hsextract']}; bare {window['bare_in_flight']} in flight",
          flush=True)  # fmt: skip
    records = [json.loads(line) for line in data.read_text().splitlines()]
    bare = race.run_bare(cwork, cfg_path, records, window["bare_in_flight"],
                         window["max_running_requests"])  # fmt: skip
    print(f"   bare: {json.dumps(bare)}", flush=True)
    race.wait_gpu_free()
    left = deadline - time.monotonic()
    hsx = run_hsx(cwork / "logs", cfg_path, jobs, sum(lens), max(60.0, left - 20),
                  reclaim=engine == "sglang")  # fmt: skip
    print(f"   hsextract: {json.dumps(hsx, default=str)}", flush=True)
    race.wait_gpu_free()
    out = {"cell": name, "spec": cell.spec(seed), "work": str(cwork), "plan": plan,
           "window": window, "bare": bare, "hsextract": hsx, "row": None}  # fmt: skip
    if variants:
        out["variants"] = {}
    for label, sets in variants:
        left = deadline - time.monotonic()
        if left < cell.need_s / 2:  # about hsextract's half of the cell's call
            out["variants"][label] = {"sets": sets, "not_started": f"{left:.0f} s left"}
            print(f"== {name} variant {label}: {left:.0f} s left, not started", flush=True)
            continue
        v = run_hsx(cwork / f"variant-{label}" / "logs", variant_cfgs[label], jobs,
                    sum(lens), max(60.0, left - 20), reclaim=engine == "sglang")  # fmt: skip
        race.wait_gpu_free()
        entry = out["variants"][label] = {
            "sets": sets,
            "ratio_sending": _ratio(v.get("sending_tok_s"), bare["sending_tok_s"]),
            "shipped_ratio_sending": _ratio(hsx.get("sending_tok_s"), bare["sending_tok_s"]),
            "hsextract": v,
        }
        print(f"== {name} variant {label} ({', '.join(sets)}): hsextract/bare sending "
              f"{entry['ratio_sending']} ({v.get('sending_tok_s')} vs {bare['sending_tok_s']} "
              f"tok/s; as shipped {entry['shipped_ratio_sending']})", flush=True)  # fmt: skip
    done = hsx.get("rc") == 0 and hsx.get("tokens") == bare["tokens"] == sum(lens)
    if not done:
        out["incomplete"] = (
            f"hsextract rc {hsx.get('rc')}, {hsx.get('tokens')} of {sum(lens)} tokens"
        )
        return out
    bs, hs = bare.get("server_sending") or {}, hsx.get("server_sending") or {}
    arr = sorted(lens)
    out["row"] = {
        "cell": name, "spec": cell.spec(seed), "engine": engine, "device": device_name(),
        "sglang": sglang_version(engine),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "model": cell.model, "lengths": cell.lengths, "records": len(lens),
        "tokens": sum(lens), "mean_len": round(statistics.mean(lens), 1),
        "median_len": statistics.median(lens), "p99_len": arr[int(0.99 * len(arr))],
        "aux_layers": ";".join(map(str, aux)), "dp": cell.dp, "n_chunks": hsx["chunks"],
        "hsx_requests_per_turn": window["hsextract_requests_per_turn"],
        "hsx_tokens_per_turn": window["hsextract_tokens_per_turn"],
        "max_running_requests": window["max_running_requests"],
        "bare_in_flight": window["bare_in_flight"],
        "bare_sending_s": bare["sending_s"], "bare_sending_tok_s": bare["sending_tok_s"],
        "bare_req_s": _per_s(bare["records"], bare["sending_s"]),
        "bare_gpu_busy_sending_pct": bare.get("gpu_busy_sending_pct"),
        "bare_passes": bs.get("prefill_batches"),
        "bare_passes_queue_empty": bs.get("batches_with_empty_queue"),
        "hsx_sending_s": hsx["sending_s"], "hsx_sending_tok_s": hsx["sending_tok_s"],
        "hsx_req_s": _per_s(hsx["records"], hsx["sending_s"]),
        "hsx_gpu_busy_sending_pct": hsx.get("gpu_busy_sending_pct"),
        "hsx_passes": hs.get("prefill_batches"),
        "hsx_passes_queue_empty": hs.get("batches_with_empty_queue"),
        "ratio_sending": _ratio(hsx["sending_tok_s"], bare["sending_tok_s"]),
        "bare_tok_s": bare["tok_s"], "hsx_tok_s": hsx["tok_s"],
        "ratio_whole": _ratio(hsx["tok_s"], bare["tok_s"]),
    }  # fmt: skip
    return out


# --- the CSV -------------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict]:
    """A table's rows, checked: its columns are ours, and each ratio is the quotient of the
    figures beside it (a row edited by hand fails here, and so does the README's test)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != FIELDS:
            raise SystemExit(
                f"{path}: its columns are not bench/rate_table.py's (FIELDS): it was written "
                "by another version; re-measure, or move it out of the way"
            )
        rows = list(reader)
    for i, r in enumerate(rows, 2):  # line 1 is the header
        for key, (a, b) in {"ratio_sending": ("hsx_sending_tok_s", "bare_sending_tok_s"),
                            "ratio_whole": ("hsx_tok_s", "bare_tok_s")}.items():  # fmt: skip
            if not (r[key] and r[a] and r[b]):
                raise SystemExit(f"{path} line {i}: {key}, {a} or {b} is empty: re-measure")
            if abs(float(r[key]) - float(r[a]) / float(r[b])) > 1e-4:
                raise SystemExit(
                    f"{path} line {i}: {key} {r[key]} is not {a} / {b} "
                    f"({r[a]} / {r[b]}): the row was not written by this bench"
                )
    return rows


def write_rows(path: Path, rows: list[dict]) -> None:
    """The whole table, to a temporary name and renamed: never a half-written CSV."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if r.get(k) is None else r[k] for k in FIELDS})
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --- the README's table --------------------------------------------------------------------

NONE_YET = (
    "No cell has been measured yet: no `bench/tables/rate_table_*.csv` is committed. The "
    'table is produced by the commands in bench/README.md ("Request-rate table") on a GPU '
    "and rendered here by `python bench/rate_table.py --render`."
)


def goal(dp: int) -> float:
    """Issue 40's "Must show": ≥ 0.97 of the bare server's sending phase; dp 2 on one GPU
    ≥ 0.95 of the bare server at dp 2."""
    return 0.97 if dp == 1 else 0.95


def committed_csvs() -> list[Path]:
    return sorted(TABLES.glob(CSV_GLOB))


def _num(x: str, digits: int = 0) -> str:
    return "–" if x == "" else f"{float(x):,.{digits}f}"


def _side(r: dict, p: str) -> str:
    gpu = r[f"{p}_gpu_busy_sending_pct"]
    busy = "–" if gpu == "" else f"{float(gpu):.0f} %"
    passes = r[f"{p}_passes"]  # none on the reference engine, which logs no prefill passes
    dry = f"{r[f'{p}_passes_queue_empty']} of {passes}" if passes not in ("", "0") else "–"
    return f"{_num(r[f'{p}_sending_tok_s'])} | {_num(r[f'{p}_req_s'])} | {busy} | {dry}"


def render(paths: list[Path]) -> str:
    """The README's table, one per CSV: each cell's bare figures beside hsextract's, with
    the device, SGLang release and dates the CSV records.  No CSV: :data:`NONE_YET`."""
    if not paths:
        return NONE_YET
    parts = []
    for path in paths:
        rows = read_rows(path)
        if not rows:
            continue

        def said(key: str, rows: list[dict] = rows) -> str:
            return " / ".join(dict.fromkeys(r[key] for r in rows if r[key])) or "–"

        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        parts.append(
            f"`{rel}`: {said('device')}, SGLang {said('sglang')}, {said('date_utc')}. "
            "tok/s, req/s and GPU busy over the sending phase (first request sent to last "
            "response), the bare server at hsextract's window, both in one call; dry = "
            "prefill passes with SGLang's queue empty while sending.\n\n"
            "| cell | records (mean / p99 tokens) | target | aux layers | dp | window a turn "
            "(requests / tokens) | bare tok/s | bare req/s | bare GPU busy | bare dry | "
            "hsextract tok/s | hsextract req/s | hsextract GPU busy | hsextract dry | "
            "hsextract / bare | goal |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
            + "".join(
                f"| {r['cell']} | {r['lengths']}, {int(r['records']):,} "
                f"({_num(r['mean_len'])} / {r['p99_len']}) | {r['model']} | "
                f"{r['aux_layers'].replace(';', ', ')} | {r['dp']} | "
                f"{r['hsx_requests_per_turn']} / {_num(r['hsx_tokens_per_turn'])} | "
                f"{_side(r, 'bare')} | {_side(r, 'hsx')} | "
                f"**{float(r['ratio_sending']):.3f}** | ≥ {goal(int(r['dp'])):.2f} |\n"
                for r in rows
            )
        )
    return "\n".join(parts).rstrip("\n") if parts else NONE_YET


# --- main ----------------------------------------------------------------------------------


def cell_list(text: str) -> list[str]:
    """``--cells``: checked as it is parsed, so a README command naming no cell fails its
    parse (tests/test_readme.py)."""
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in CELLS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown cell(s) {unknown or text!r}: the cells are {', '.join(CELLS)}"
        )
    return names


def variant_arg(text: str) -> Variant:
    """``LABEL:KEY=VALUE[,KEY=VALUE]`` (a label names its config dir and output root)."""
    label, colon, sets = text.partition(":")
    if not colon or not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", label) or not sets:
        raise argparse.ArgumentTypeError(
            f"{text!r}: LABEL:SECTION.KEY=VALUE[,SECTION.KEY=VALUE], LABEL of a-z, 0-9, -"
        )
    return label, tuple(sets.split(","))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default=",".join(CELLS), type=cell_list,
                    help=f"comma list, run in this order (of: {', '.join(CELLS)})")  # fmt: skip
    ap.add_argument("--csv", default=None,
                    help="the table to fill and resume (default: WORK/rate_table.csv)")  # fmt: skip
    ap.add_argument("--render", action="store_true",
                    help="print docs/sglang.md's table from the committed CSVs")  # fmt: skip
    ap.add_argument("--quick", action="store_true",
                    help="one tiny cell on the CPU: demo model, reference engine")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=None, help="snakemake -j (8; quick 2)")
    ap.add_argument("--budget-s", type=float, default=540,
                    help="this call's time: a cell starts only if its need_s is left")  # fmt: skip
    ap.add_argument("--work", default="/tmp/hsextract-rate-table")
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="where rate_table.csv/.json are copied (default $OUT)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override hsextract's config in every cell run "
                         "(client.tokens_in_flight=21000); part of the row's spec")  # fmt: skip
    ap.add_argument("--variant", action="append", default=[], type=variant_arg,
                    metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                    help="after a cell's row, hsextract again with these sets against the "
                         "same bare run (its ratio in the output and rate_table.json, never "
                         "a row); e.g. nice5:client.nice=5")  # fmt: skip
    args = ap.parse_args()
    if args.render:
        print(render(committed_csvs()))
        return
    cells = QUICK if args.quick else CELLS
    names = list(cells) if args.quick else args.cells
    jobs = args.jobs or (2 if args.quick else 8)
    t_begin = time.monotonic()
    deadline = t_begin + args.budget_s
    # h200/run.sh's `timeout` sends SIGTERM: the rows so far are already written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(args.work).resolve()
    race.own_work_dir(work, MARKER, "bench/rate_table.py")
    table = Path(args.csv).resolve() if args.csv else work / "rate_table.csv"
    out_dir = Path(args.out or work / "out").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = read_rows(table) if table.exists() else []
    have = {r["cell"]: r["spec"] for r in rows}
    details: dict = {"argv": sys.argv, "csv": str(table), "cells": {}}

    def save() -> None:
        (out_dir / "rate_table.json").write_text(json.dumps(details, indent=1, default=str))
        if table.exists() and table != out_dir / "rate_table.csv":  # --csv may be there
            shutil.copy(table, out_dir / "rate_table.csv")

    if not args.quick:
        # Matplotlib's font cache is built on a machine's first import: not in a window.
        subprocess.run([sys.executable, "-c", "import matplotlib.pyplot"], check=False)
    try:
        for name in names:
            cell = replace(cells[name], sets=tuple(args.set))
            if name in have:
                if have[name] != cell.spec(args.seed):
                    raise SystemExit(
                        f"{table}: cell {name} was measured as {have[name]!r}, this bench "
                        f"now runs it as {cell.spec(args.seed)!r}: pass another --csv"
                    )
                print(f"== {name}: in {table} already, skipped", flush=True)
                details["cells"][name] = {"skipped": "in the CSV already"}
                continue
            left = deadline - time.monotonic()
            if left < cell.need_s:
                print(f"== {name}: {left:.0f} s left of --budget-s, it needs ~{cell.need_s:.0f}:"
                      " not started (run the same command again)", flush=True)  # fmt: skip
                details["cells"][name] = {"not_started": f"{left:.0f} s left"}
                continue
            r = run_cell(name, cell, work, args.seed, jobs, deadline, tuple(args.variant))
            details["cells"][name] = {**r, "details": asdict(cell)}
            if r["row"] is not None:
                rows.append(r["row"])
                write_rows(table, rows)
                have[name] = r["row"]["spec"]
                print(f"== {name}: hsextract/bare sending {r['row']['ratio_sending']} "
                      f"({r['row']['hsx_sending_tok_s']} vs {r['row']['bare_sending_tok_s']} "
                      f"tok/s) -> {table}", flush=True)  # fmt: skip
            else:
                print(f"== {name}: no row ({r['incomplete']})", flush=True)
            save()
    finally:
        save()
        # Each cell's server and Snakemake logs, chunk logs and sidecars, for what the row
        # does not say.
        cells_dir = work / "cells"
        logs = [
            str(p.relative_to(work))
            for pattern in ("*/logs", "*/sidecars", "*/results-*/*/logs", "*/variant-*/*")
            for p in cells_dir.glob(pattern)
        ]
        if logs:
            tar = ["tar", "-cJf", str(out_dir / "rate_table-logs.tar.xz"), "-C", str(work)]
            subprocess.run([*tar, *logs], check=False)
    missing = [n for n in names if n not in have]
    if rows:
        print(render([table]))
    print(f"rate table: {len(names) - len(missing)} of {len(names)} cells in {table}"
          + (f"; left: {','.join(missing)}" if missing else ""))  # fmt: skip


if __name__ == "__main__":
    main()
