"""The few lines a finished workflow ends with: what it made, where, and what to run next.

A run ended with "stopped the extraction server" and nothing else: the user had to know
where the manifest is, that ``verify`` and the exports exist, and how to read the states.
Read from the manifest and the sidecars only (no tensor, no torch): printed by the
workflow's ``onsuccess``, after the server is stopped.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from hsextract.commands import hsextract_command


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError


def _busy_rate(sidecars: list[dict]) -> tuple[float | None, float]:
    """(tokens per second of extraction, busy seconds): the union of the chunks' intervals,
    so chunks extracted side by side (-j N) and idle time between sessions count right."""
    from hsextract.status import _rate

    spans = []
    for s in sidecars:
        try:
            end = float(s["finished_at"])
            start = float(s.get("started_at") or end - float(s.get("seconds", 0.0)))
        except (KeyError, TypeError, ValueError):
            continue
        spans.append((start, end, float(s.get("tokens") or 0)))
    rate = _rate(spans, -math.inf, math.inf)
    busy = sum(s[2] for s in spans) / rate if rate else 0.0
    return rate, busy


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def run_summary(run_dir: Path, since: float | None = None) -> list[str]:
    """The summary of a run dir holding a manifest (empty without one, or with ``since``
    one written before it: this workflow finished something else, e.g. an export)."""
    rd = Path(run_dir)
    manifest = rd / "manifest.json"
    try:
        if since is not None and manifest.stat().st_mtime < since:
            return []
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return []
    chunks = [c for c in data.get("chunks") or [] if isinstance(c, dict)]
    totals = data.get("totals") or {}
    sidecars = []
    for c in chunks:
        try:
            sidecars.append(json.loads((rd / str(c.get("path"))).with_suffix(".json").read_text()))
        except (OSError, ValueError):
            continue
    rate, busy = _busy_rate(sidecars)
    speed = f", {rate:,.0f} tokens/s over {_duration(busy)} of extraction" if rate else ""
    # As the workflow names it (relative under its directory), where the user stands.
    rel = os.path.relpath(manifest)
    m = str(manifest) if rel.startswith("..") else rel
    cfg = data.get("config") or {}

    def export(fmt: str) -> str:
        return hsextract_command("export", fmt, "--manifest", m, with_config=False)

    lines = [
        f"hsextract: run finished: {int(totals.get('records') or 0):,} records, "
        f"{int(totals.get('tokens') or 0):,} tokens in {len(chunks)} chunk(s), "
        f"{_size(float(totals.get('bytes') or 0))} of states{speed}",
        f"  manifest  {m}",
        f"  check     {hsextract_command('verify', m, with_config=False)}",
        f"  train     {export('specforge')}   (SpecForge's offline .ckpt files)",
    ]
    if cfg.get("prenorm_final"):
        lines.append(f"            {export('speculators')}   (vLLM speculators)")
    else:
        lines.append(
            "            vLLM speculators needs prenorm_final: true (a new run dir), then "
            "`hsextract export speculators --manifest ...`"
        )
    if (cfg.get("stream") or {}).get("budget_gb") is not None:
        lines.append(
            f"  stream    chunks were announced in {rd / 'stream'}: a trainer reads them "
            "with hsextract.stream while they are extracted (docs/streaming.md)"
        )
    else:
        lines.append(
            "  read      hsextract.chunks.ManifestDataset(manifest) in Python, one record "
            "at a time; or set stream.budget_gb to train while extracting"
        )
    return lines


def clear_failed_merge(cfg: Any, run_dir: Path) -> bool:
    """Remove ``merged/rejects-failed.jsonl`` once the published merge read exactly the
    inputs there are now (a successful workflow's end): the failure it records is over.

    A merge that succeeds removes it itself; an input restored with its old time (from a
    backup) reruns nothing, so it stayed, naming rejects no input holds any more.
    """
    from hsextract.errors import HsextractError
    from hsextract.plan import changed_inputs
    from hsextract.records import FAILED_REJECTS

    failed = Path(run_dir) / "merged" / FAILED_REJECTS
    if not failed.exists():
        return False
    try:
        stats = json.loads((Path(run_dir) / "merged" / "stats.json").read_text())
        if "inputs" not in stats or changed_inputs(cfg, stats):
            return False
    except (OSError, ValueError, HsextractError):
        return False
    failed.unlink(missing_ok=True)
    return True
