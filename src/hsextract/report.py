"""Figures and tables for ``snakemake --report``: what a user checks before training.

From files the run already wrote (no tensor is read): the merge's ``stats.json`` (length
histogram, rejects by reason), each chunk's sidecar (tokens/s, bytes, seconds, and the
activation statistics sampled while packing, :mod:`hsextract.stats`), the state files
(GPU gate, patch, server launch record), the manifest, and with a disk budget the
stream's samples of disk in use (``stream/usage.jsonl``).
"""

from __future__ import annotations

import base64
import html
import json
import os
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: a rule has no display

import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def lengths_figure(stats: dict, out: Path) -> None:
    """Record lengths after the merge (log2 bins), and the cut at max_seq_len."""
    bins = stats.get("length_histogram") or []
    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = [f"{b['lo']}" if b["lo"] == b["hi"] else f"{b['lo']}-{b['hi']}" for b in bins]
    ax.bar(range(len(bins)), [b["count"] for b in bins], color="#4477aa")
    ax.set_xticks(range(len(bins)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("tokens per record")
    ax.set_ylabel("records")
    length = stats.get("length", {})
    ax.set_title(
        f"{stats.get('records_out', 0)} records, {stats.get('tokens_out', 0)} tokens; "
        f"p50 {length.get('p50', 0):.0f}, p99 {length.get('p99', 0):.0f}, "
        f"max {length.get('max', 0)} (max_seq_len {stats.get('params', {}).get('max_seq_len')}); "
        f"{stats.get('truncated', 0)} truncated",
        fontsize=9,
    )
    _save(fig, out)


def rejects_figure(stats: dict, out: Path) -> None:
    """Rejected input lines by reason (an empty chart says so, rather than vanishing)."""
    reasons = stats.get("rejected_by_reason") or {}
    fig, ax = plt.subplots(figsize=(7, 2.6))
    if reasons:
        names = sorted(reasons, key=reasons.get, reverse=True)
        ax.barh(names, [reasons[n] for n in names], color="#cc6677")
        ax.invert_yaxis()
        ax.set_xlabel("lines rejected")
    else:
        ax.text(0.5, 0.5, "no input line rejected", ha="center", va="center", fontsize=12)
        ax.set_axis_off()
    ax.set_title(
        f"rejected {stats.get('rejected', 0)} of {stats.get('records_in', 0)} lines "
        f"({100 * stats.get('reject_fraction', 0):.2f} %; limit "
        f"{100 * stats.get('params', {}).get('max_reject_fraction', 0):.0f} %), "
        f"{stats.get('dropped_over_length', 0)} dropped over length",
        fontsize=9,
    )
    _save(fig, out)


def chunks_figure(sidecars: list[dict], out: Path) -> None:
    """Per chunk: tokens/s, seconds and bytes on disk (with the states' raw size)."""
    names = [s["chunk"].removeprefix("chunk_") for s in sidecars]
    x = range(len(sidecars))
    fig, axes = plt.subplots(3, 1, figsize=(8, 6.5), sharex=True)
    axes[0].bar(x, [s["tokens_per_s"] for s in sidecars], color="#228833")
    axes[0].set_ylabel("tokens/s")
    axes[1].bar(x, [s["seconds"] for s in sidecars], color="#ccbb44")
    axes[1].set_ylabel("seconds")
    mib = 2**20
    axes[2].bar(x, [s.get("states_raw_bytes", s["bytes"]) / mib for s in sidecars],
                color="#bbbbbb", label="states, uncompressed")  # fmt: skip
    axes[2].bar(x, [s["bytes"] / mib for s in sidecars], color="#4477aa", width=0.5,
                label=f"file ({sidecars[0].get('codec', 'none') if sidecars else ''})")  # fmt: skip
    axes[2].set_ylabel("MiB")
    axes[2].legend(fontsize=8)
    axes[2].set_xticks(list(x), names, rotation=90, fontsize=7)
    axes[2].set_xlabel("chunk")
    total_t = sum(s["tokens"] for s in sidecars)
    total_s = sum(s["seconds"] for s in sidecars)
    axes[0].set_title(
        f"{len(sidecars)} chunks, {total_t} tokens in {total_s:.1f} s of extraction "
        f"({total_t / total_s if total_s else 0:.0f} tokens/s overall)",
        fontsize=9,
    )
    _save(fig, out)


def all_zero_layers(sidecars: list[dict]) -> list[str]:
    """Captured layers whose sampled values are all zero in every chunk: a broken capture."""
    stats = [s["activation_stats"] for s in sidecars if s.get("activation_stats")]
    if not stats:
        return []
    return [n for n in stats[0]["layers"] if all((s["layers"][n]["rms"] or 0) == 0 for s in stats)]


def activations_figure(sidecars: list[dict], out: Path) -> None:
    """Per captured layer, RMS and max |x| across chunks (log scale): a layer of zeros or
    one that explodes stands out at once."""
    stats = [s.get("activation_stats") for s in sidecars]
    stats = [s for s in stats if s]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    if not stats:
        for ax in axes:
            ax.text(0.5, 0.5, "no activation statistics (chunks from before hsextract "
                    "recorded them)", ha="center", va="center", fontsize=8, wrap=True)  # fmt: skip
            ax.set_axis_off()
        _save(fig, out)
        return
    layers = list(stats[0]["layers"])
    for ax, key, title in ((axes[0], "rms", "RMS"), (axes[1], "max_abs", "max |x| (sampled)")):
        for name in layers:
            ys = [s["layers"][name][key] for s in stats if s["layers"].get(name)]
            ys = [max(y, 1e-12) if y is not None else float("nan") for y in ys]
            ax.plot(range(len(ys)), ys, marker="o", ms=3, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("chunk")
        ax.set_xticks(range(len(stats)), [s["chunk"].removeprefix("chunk_") for s in sidecars
                      if s.get("activation_stats")], rotation=90, fontsize=7)  # fmt: skip
        ax.set_title(title, fontsize=9)
    zero = all_zero_layers(sidecars)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"every {stats[0]['sample_every']}th token of every piece"
        + (f"; ALL-ZERO layers: {', '.join(zero)}" if zero else "; no layer is all zeros"),
        fontsize=9,
    )
    _save(fig, out)


def read_usage(run_dir: Path) -> list[dict]:
    """The stream's disk-in-use samples (``stream/usage.jsonl``); none for an offline run."""
    from hsextract.stream.gate import USAGE
    from hsextract.stream.journal import read_lines, stream_dir

    return read_lines(stream_dir(run_dir) / USAGE)


def usage_peaks(samples: list[dict]) -> dict:
    """What the report says of a streamed run: the peak of unacknowledged bytes (what the
    budget bounds) and when, the peak of chunk files on disk, the budget, and how long
    the gate was shut (chunk jobs waiting for the trainer)."""
    peak = max(samples, key=lambda s: s["unacked_bytes"])
    t0, t1 = samples[0]["at"], samples[-1]["at"]
    shut = sum(b["at"] - a["at"] for a, b in zip(samples, samples[1:], strict=False) if a["paused"])
    return {
        "samples": len(samples),
        "seconds": t1 - t0,
        "peak_unacked_bytes": peak["unacked_bytes"],
        "peak_unacked_after_s": peak["at"] - t0,
        "peak_payload_bytes": max(s["payload_bytes"] for s in samples),
        "budget_bytes": samples[-1]["budget_bytes"],
        "shut_s": shut,
    }


def _dur(s: float) -> str:
    return f"{s:.1f} s" if s < 100 else f"{s / 60:.1f} min"


def _unit(top: float) -> tuple[float, str]:
    return next((f, u) for f, u in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB"), (1, "B"))
                if top >= f or u == "B")  # fmt: skip


def disk_in_use_figure(samples: list[dict], out: Path) -> dict:
    """Disk in use over a streamed run: chunk files on disk, the unacknowledged ones (what
    the budget bounds) and those plus the chunk jobs' reservations, against the budget
    line; the spans where the gate was shut are shaded.  Its :func:`usage_peaks`."""
    peaks = usage_peaks(samples)
    budget = peaks["budget_bytes"]
    f, unit = _unit(max(budget, peaks["peak_payload_bytes"]))
    t0 = samples[0]["at"]
    mins = peaks["seconds"] > 300
    x = [(s["at"] - t0) / (60 if mins else 1) for s in samples]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for key, label, color, lw in (
        ("payload_bytes", "chunk files on disk", "#bbbbbb", 4),
        ("unacked_bytes", "not yet acknowledged by the trainer", "#4477aa", 1.5),
    ):
        ax.step(x, [s[key] / f for s in samples], where="post", label=label, color=color, lw=lw)
    ax.step(x, [(s["unacked_bytes"] + s["reserved_bytes"]) / f for s in samples], where="post",
            label="+ chunk jobs' reservations", color="#4477aa", ls=":")  # fmt: skip
    ax.axhline(budget / f, color="#cc3311", ls="--", label="stream.budget_gb")
    for a, xa, xb in zip(samples, x, x[1:], strict=False):
        if a["paused"]:
            ax.axvspan(xa, xb, color="#ee7733", alpha=0.15, lw=0)
    ax.set_xlabel("minutes" if mins else "seconds")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(
        f"peak unacknowledged {peaks['peak_unacked_bytes'] / f:.3g} {unit} of a "
        f"{budget / f:.3g} {unit} budget; gate shut (shaded) {_dur(peaks['shut_s'])} "
        f"of {_dur(peaks['seconds'])}",
        fontsize=9,
    )
    _save(fig, out)
    return peaks


def usage_text(peaks: dict) -> str:
    """The report's sentence on the budget: the peak in bytes, exactly, against it."""
    from hsextract.budget import human

    peak, budget = peaks["peak_unacked_bytes"], peaks["budget_bytes"]
    verdict = "within" if peak <= budget else "OVER"
    return (
        f"Peak unacknowledged chunk bytes {peak:,} ({human(peak)}), "
        f"{_dur(peaks['peak_unacked_after_s'])} into the stream: {100 * peak / budget:.1f} % of "
        f"the budget {budget:,} ({human(budget)}), {verdict} it. Peak chunk files on disk "
        f"{peaks['peak_payload_bytes']:,} ({human(peaks['peak_payload_bytes'])}); the gate was "
        f"shut {_dur(peaks['shut_s'])} of {_dur(peaks['seconds'])} ({peaks['samples']} samples)."
    )


def stream_section(run_dir: Path, out: Path) -> str | None:
    """A streamed run's part of the report (None for an offline run): the figure written
    to ``out`` and an HTML section with :func:`usage_text` and the figure inline (the
    report page must stand alone)."""
    samples = read_usage(run_dir)
    if not samples:
        return None
    peaks = disk_in_use_figure(samples, out)
    png = base64.b64encode(Path(out).read_bytes()).decode()
    return (
        f"<h3>Train while extracting: disk in use</h3><p>{html.escape(usage_text(peaks))}</p>"
        f"<img alt='disk in use over the run' src='data:image/png;base64,{png}'>"
    )


def run_table(
    manifest: dict,
    gate: dict,
    patch: dict,
    server: dict,
    out: Path,
    sidecars: list[dict] | None = None,
    stream: str | None = None,
    passes: dict | None = None,
) -> None:
    """Versions, the server command, the GPU gate's readings (and a streamed run's disk
    in use, ``stream``: :func:`stream_section`): one HTML page.  ``passes``:
    stream.receipts.regenerated (epochs_mode regenerate), when the run has one.

    The server's version is the one the chunks' sidecars name (the server that produced
    them; launch_server records none, it does not wait for the server to answer).
    """

    def row(k: str, v: object) -> str:
        return f"<tr><th>{html.escape(k)}</th><td><code>{html.escape(str(v))}</code></td></tr>"

    spec = server.get("spec", {})
    argv = spec.get("argv", [])
    from hsextract import __version__
    from hsextract.sglang.launch import redact_argv

    versions = {
        "hsextract": __version__,
        "server": ", ".join(
            sorted({str(v) for c in sidecars or [] if (v := c.get("server", {}).get("version"))})
        )
        or server.get("server_version"),
        "engine": manifest.get("engine"),
        "codec": manifest.get("codec"),
        "fingerprint": manifest.get("fingerprint"),
        "aux layers": manifest.get("aux_layers"),
        "max_seq_len": manifest.get("max_seq_len"),
    }
    gpus = gate.get("gpus") or []
    gpu_rows = "".join(
        row(
            f"GPU {g.get('index')}",
            f"{g.get('name')} used {g.get('used_mib')} MiB, processes {g.get('processes')}",
        )  # fmt: skip
        for g in gpus
    ) or row("GPUs", gate.get("message", "none"))
    checks = {v: d.get("verify", d) for v, d in (patch.get("versions") or {}).items()}
    patch_rows = "".join(
        row(f"patch {v}", f"{c.get('action')} {c.get('found_sha256')}") for v, c in checks.items()
    ) or row("patch", patch.get("action", patch))
    totals = manifest.get("totals", {})
    body = (
        "<h3>Run</h3><table>"
        + "".join(row(k, v) for k, v in versions.items())
        + row("totals", totals)
        + "".join(
            row(
                f"pass {p} re-extracted",
                f"{v['chunks']} chunks, {v['matched']} with pass 1's "
                f"sha256" + (f"; differ: {', '.join(v['differ'])}" if v["differ"] else ""),
            )
            for p, v in (passes or {}).items()
        )  # fmt: skip
        + "</table>"
        + _server_commands(sidecars or [], list(argv), redact_argv)
        + "<h3>GPU gate</h3><table>"
        + row("ok", gate.get("ok"))
        + gpu_rows
        + "</table><h3>Patch</h3><table>"
        + patch_rows
        + "</table>"
        + (stream or "")
    )
    head = (
        "<!doctype html><html><head><meta charset='utf-8'><title>run</title>"
        "<style>pre{white-space:pre-wrap;word-break:break-all}th{text-align:left}</style></head>"
    )
    page = f"{head}<body>{body}</body></html>"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out).with_name(f".{Path(out).name}.tmp")
    tmp.write_text(page)
    os.replace(tmp, out)


def _server_commands(sidecars: list[dict], launched: list[str], redact: Any) -> str:
    """The server command(s) that produced the chunks, from their sidecars, each with its
    chunks; the last launch only as that, when it produced none of them.

    state/server.json is the last launch: after an override run that extracted nothing
    (a server setting tried, a one-chunk redo with other flags) it was shown as the
    command of every chunk."""
    by_argv: dict[tuple[str, ...], list[str]] = {}
    for c in sidecars:
        argv = (c.get("server") or {}).get("argv")
        if argv:
            by_argv.setdefault(tuple(argv), []).append(str(c.get("chunk")))
    if not by_argv:  # sidecars from before they recorded it: the launch is all there is
        return "<h3>Server command</h3><pre>" + html.escape(" ".join(redact(launched))) + "</pre>"
    out = "<h3>Server command (what extracted the chunks)</h3>"
    for argv, chunks in by_argv.items():
        names = ", ".join(sorted(chunks))
        out += f"<p>{len(chunks)} chunk(s): {html.escape(names)}</p>"
        out += "<pre>" + html.escape(" ".join(redact(list(argv)))) + "</pre>"
    if launched and tuple(launched) not in by_argv:
        out += (
            "<h3>Last server launch (extracted none of these chunks)</h3><pre>"
            + html.escape(" ".join(redact(launched)))
            + "</pre>"
        )
    return out


def make_all(
    *, manifest: Path, stats: Path, gate: Path, patch: Path, server: Path, out: dict[str, Path]
) -> None:
    m = json.loads(Path(manifest).read_text())
    s = json.loads(Path(stats).read_text())
    root = Path(manifest).parent
    sidecars = [
        json.loads((root / c["path"]).with_suffix(".json").read_text()) for c in m["chunks"]
    ]
    lengths_figure(s, out["lengths"])
    rejects_figure(s, out["rejects"])
    chunks_figure(sidecars, out["chunks"])
    activations_figure(sidecars, out["activations"])
    run_table(
        m,
        json.loads(Path(gate).read_text()),
        json.loads(Path(patch).read_text()),
        json.loads(Path(server).read_text()) if Path(server).exists() else {},
        out["run"],
        sidecars,
        (stream_section(root, Path(out["run"]).with_name("disk_in_use.png")) or "")
        + (audit_section(root) or ""),
        _passes(root),
    )


def audit_section(root: Path) -> str | None:
    """The audit's table (hsextract.audit.report_section); None when the run has none."""
    from hsextract.audit import report_section

    return report_section(root)


def _passes(root: Path) -> dict | None:
    """A stream's later passes (epochs_mode regenerate); None offline (nothing imported)."""
    if not (root / "stream").is_dir():
        return None
    from hsextract.stream.receipts import regenerated

    return regenerated(root)
