"""Summarise py-spy samples of an SGLang scheduler process (``h200/profile_scheduler.sh``).

What issue 40's server-side question needs from a profile, bare against capture on: how
much of the main thread's time is waiting for the GPU (``Event.synchronize``: the GPU is
the slower side), how much is launching the forward (the ``*ForCausalLM.forward`` frame:
Python that must keep ahead of the GPU), how much of that is hsextract's own code (frames
under ``hsextract/``), and how busy every other thread is (the dump writers, the D2H
copier).  Shares are of the main thread's samples; a thread's "active" share is its
samples over the main thread's (py-spy leaves out idle threads by default).

    python3 bench/scheduler_profile.py sched1.txt sched2.txt   # bare, then hsextract

A chunk job's GIL (py-spy ``--gil``: only the thread holding it is sampled): is one job
bound by its GIL (issue 40: ~59 requests/s a sending job on the chat cell, whatever its
window)?  The share of samples that found the GIL held, of the rate x 12 s the script
records, and what held it:

    python3 bench/scheduler_profile.py --gil 50 job1.txt job2.txt   # recorded at 50 Hz
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass, field
from pathlib import Path

WAIT = "Event.synchronize"
FORWARD_SUFFIX = "ForCausalLM.forward"


@dataclass
class Summary:
    """One profile's figures, each a share of the main thread's samples."""

    main_samples: int = 0
    waiting: float = 0.0
    forward: float = 0.0
    hsextract: float = 0.0
    threads: dict[str, float] = field(default_factory=dict)


def _name(frame: str) -> str:
    """``Qwen2Model.forward (sglang/srt/models/qwen2.py:300)`` -> ``Qwen2Model.forward``."""
    return frame.split(" (")[0]


def _stacks(lines: list[str]) -> list[tuple[str, list[str], int]]:
    """py-spy's raw output (``--threads``), ``thread;frame;...;frame count`` a line, as
    (thread, frames outermost first, samples)."""
    out = []
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack:
            thread, *frames = stack.split(";")
            out.append((thread, frames, int(count)))
    return out


def summarise(lines: list[str]) -> Summary:
    """Figures from py-spy's raw output: ``thread;frame;...;frame count`` a line."""
    by_thread: collections.Counter[str] = collections.Counter()
    stacks = _stacks(lines)
    for thread, _, n in stacks:
        by_thread[thread] += n
    main = next((t for t in by_thread if "MainThread" in t), None)
    if main is None:
        raise SystemExit(
            "no MainThread in the profile: is it py-spy's --format raw with --threads?"
        )
    s = Summary(main_samples=by_thread[main])
    for thread, frames, n in stacks:
        if thread != main:
            continue
        names = [_name(f) for f in frames]
        if names and names[-1] == WAIT:
            s.waiting += n
        if any(x.endswith(FORWARD_SUFFIX) for x in names):
            s.forward += n
        if any("hsextract/" in f for f in frames):
            s.hsextract += n
    total = s.main_samples
    s.waiting /= total
    s.forward /= total
    s.hsextract /= total
    s.threads = {t.split(": ", 1)[-1]: c / total for t, c in by_thread.most_common() if t != main}
    return s


#: Seconds ``h200/profile_scheduler.sh`` records each process (py-spy ``-d``).
RECORD_S = 12


@dataclass
class GilSummary:
    """A ``--gil`` profile: the share of the samples it could take that found the GIL held,
    and the frames that held it, each as a share of those held samples."""

    held: float = 0.0
    held_samples: int = 0
    own: list[tuple[str, float]] = field(default_factory=list)
    within: list[tuple[str, float]] = field(default_factory=list)


def gil_summary(
    lines: list[str], rate: float, seconds: float = RECORD_S, top: int = 12
) -> GilSummary:
    """``own``: the innermost frame (where the GIL holder was); ``within``: every frame of
    hsextract's own code on the stack (a function and what it calls)."""
    own: collections.Counter[str] = collections.Counter()
    within: collections.Counter[str] = collections.Counter()
    total = 0
    for _, frames, n in _stacks(lines):
        total += n
        frames = [f for f in frames if f]
        if frames:
            own[_name(frames[-1])] += n
        for name in {_name(f) for f in frames if "hsextract/" in f}:
            within[name] += n
    share = [(k, c / total) for k, c in own.most_common(top)] if total else []
    inner = [(k, c / total) for k, c in within.most_common(top)] if total else []
    return GilSummary(total / (rate * seconds), total, share, inner)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profiles", nargs="+", type=Path, help="py-spy raw files (sched<k>.txt)")
    ap.add_argument(
        "--gil", type=float, metavar="HZ",
        help="the files are --gil profiles recorded at HZ: the GIL's held share, and by what",
    )  # fmt: skip
    args = ap.parse_args()
    for path in args.profiles:
        if args.gil:
            g = gil_summary(path.read_text().splitlines(), args.gil)
            print(f"{path}: GIL held in {g.held:.1%} of {args.gil * RECORD_S:.0f} samples")
            for title, rows in (("holding it", g.own), ("within hsextract's", g.within)):
                print(f"  {title}: " + "; ".join(f"{k} {v:.1%}" for k, v in rows))
            continue
        s = summarise(path.read_text().splitlines())
        print(
            f"{path}: main thread {s.main_samples} samples: waiting for the GPU "
            f"{s.waiting:.1%}, launching the forward {s.forward:.1%} (hsextract's code "
            f"{s.hsextract:.1%})"
        )
        for name, share in s.threads.items():
            print(f"  {name}: active {share:.1%} of the main thread's samples")


if __name__ == "__main__":
    main()
