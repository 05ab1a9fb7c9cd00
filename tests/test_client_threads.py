"""A chunk job's sender threads must not each bring a team of OpenMP threads (issue 40: the
client ceiling bench at dp 8 died of "libgomp: Thread creation failed")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

#: 16 sender threads checking a 20 MB piece at once, torch at 8 threads (a node's default:
#: its cores); prints the most OS threads the process had beyond its own and the senders.
PROBE = """
import pathlib, sys, threading, torch
from safetensors.torch import save_file
torch.set_num_threads(8)
from hsextract import client
if sys.argv[2] == "job":
    client.one_thread_per_op()  # what every chunk job does first
p = pathlib.Path(sys.argv[1]) / "piece.safetensors"
save_file({"input_ids": torch.zeros(2048, dtype=torch.int64),
           "hidden_states": torch.randn(2048, 1024).bfloat16(),
           "aux_hidden_states": torch.randn(2048, 3072).bfloat16()}, str(p))
piece = client._open_piece(p, 0, {})
def threads():
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("Threads:")).split()[1])
base, peak, done = threads(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], threads())
        done.wait(0.001)
sampler = threading.Thread(target=sample)
sampler.start()
go = threading.Barrier(16)
def check():
    go.wait()
    for _ in range(5):
        assert client._piece_finite(piece, ["hidden_states", "aux_hidden_states"])
senders = [threading.Thread(target=check) for _ in range(16)]
for t in senders:
    t.start()
for t in senders:
    t.join()
done.set()
sampler.join()
print(peak[0] - base - 1 - 16)
"""


def extra_threads(tmp_path: Path, mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path), mode],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


def test_a_chunk_jobs_sender_threads_bring_no_thread_teams(tmp_path):
    # The hazard is real: with torch's default threads every checking sender grows a team.
    assert extra_threads(tmp_path, "default") >= 8
    # A chunk job's senders run their ops alone: nothing beyond them (a few of torch's own).
    assert extra_threads(tmp_path, "job") <= 4
