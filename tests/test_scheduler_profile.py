"""bench/scheduler_profile.py: the shares it reports are the samples' own (a py-spy raw file
written here by hand, in py-spy's format: ``thread;frame;... count`` a line)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location(
        "scheduler_profile", ROOT / "bench" / "scheduler_profile.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


RAW = """\
thread (10): MainThread;run (x.py:1);Scheduler.f (s.py:2);Event.synchronize (t.py:3) 70
thread (10): MainThread;run (x.py:1);Qwen2ForCausalLM.forward (q.py:4);M.forward (q.py:5) 20
thread (10): MainThread;run (x.py:1);Qwen2ForCausalLM.forward (q.py:4);h (/hsextract/h.py:9) 5
thread (10): MainThread;run (x.py:1);Scheduler.recv (s.py:7) 5
thread (11): hsextract-dump-0;DumpWriter._worker (/site/hsextract/capture.py:1) 25
thread (12): hsextract-d2h;DumpWriter._copier (/site/hsextract/capture.py:2) 2
"""


def test_shares_are_counted_from_the_main_threads_samples():
    s = _module().summarise(RAW.splitlines())
    assert s.main_samples == 100
    assert s.waiting == 0.70
    assert s.forward == 0.25
    assert s.hsextract == 0.05
    assert s.threads == {"hsextract-dump-0": 0.25, "hsextract-d2h": 0.02}


GIL_RAW = """\
thread (20): T-0_3;one (/hsextract/c.py:1);put_files (/hsextract/k.py:2);compress_frame (/s.py:3) 30
thread (21): T-0_7;one (/hsextract/c.py:1);_post (/hsextract/c.py:4);getresponse (http/c.py:5) 10
thread (21): T-0_7;one (/hsextract/c.py:1);put_files (/hsextract/k.py:2) 20
"""


def test_a_gil_profile_gives_the_held_share_of_the_samples_it_could_take():
    # 60 held samples at 10 Hz over the 12 s recorded: held half the time.
    g = _module().gil_summary(GIL_RAW.splitlines(), rate=10)
    assert g.held_samples == 60
    assert g.held == 0.5
    assert g.own[0] == ("compress_frame", 0.5)  # most held first
    assert dict(g.own) == {"compress_frame": 0.5, "put_files": 1 / 3, "getresponse": 1 / 6}
    # compress_frame's frame is not under hsextract/ here (/s.py): not in ``within``.
    assert dict(g.within) == {"one": 1.0, "put_files": 50 / 60, "_post": 1 / 6}
