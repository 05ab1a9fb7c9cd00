"""Summarise py-spy samples of an SGLang scheduler process (``h200/profile_scheduler.sh``).

What issue 40's server-side question needs from a profile, bare against capture on: how
much of the main thread's time is waiting for the GPU (``Event.synchronize``: the GPU is
the slower side), how much is launching the forward (the ``*ForCausalLM.forward`` frame:
Python that must keep ahead of the GPU), how much of that is hsextract's own code (frames
under ``hsextract/``), and how busy every other thread is (the dump writers, the D2H
copier).  Shares are of the main thread's samples; a thread's "active" share is its
samples over the main thread's (py-spy leaves out idle threads by default).

    python3 bench/scheduler_profile.py sched1.txt sched2.txt   # bare, then hsextract
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


def summarise(lines: list[str]) -> Summary:
    """Figures from py-spy's raw output: ``thread;frame;...;frame count`` a line."""
    by_thread: collections.Counter[str] = collections.Counter()
    stacks: list[tuple[str, list[str], int]] = []
    for line in lines:
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        thread, *frames = stack.split(";")
        n = int(count)
        by_thread[thread] += n
        stacks.append((thread, frames, n))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profiles", nargs="+", type=Path, help="py-spy raw files (sched<k>.txt)")
    args = ap.parse_args()
    for path in args.profiles:
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
