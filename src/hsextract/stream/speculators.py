"""speculators' own training code reading a run in progress (issue 39, item 6).

speculators 0.9.0 trains from ``BaseDataset`` items packed by
``MultipackDistributedBatchSamplerV2``, which draws every record of the whole set in a
random order and packs them into ``total_seq_len`` token batches, one per DP rank.  Under a
disk budget the whole set never exists at once, so that order cannot be served: the
record it asks for first may be extracted last, behind chunks that fill the budget while
nothing can be trained on (a deadlock).  Instead of the order the trainer asks for, the
trainer asks in the order the workflow produces:

- :class:`StreamPackingSampler` (a batch sampler for speculators' ``DataLoader``) follows
  the journal: chunk by chunk, in journal order, it shuffles the chunk's records by
  (seed, epoch, seq) and packs them with speculators' own LPT packer
  (``_assign_to_packed_batches``, the one its sampler uses), for every rank at once, so
  all ranks step in lockstep.  The few records the packer leaves at a chunk's end (fewer
  than the ranks) are carried into the next chunk's packing; at the end of the pass the
  last ones go one per rank, a rank without one gets an empty batch (speculators'
  ``CollateFn`` turns it into its empty sample).  Every record is yielded exactly once a
  pass.  The shuffle window is the chunk (records are shuffled globally by
  ``merge_and_shuffle`` before they are split into chunks).
- :class:`StreamSpeculatorsDataset` is a speculators ``BaseDataset`` whose keys are
  ``(seq, position)``; it checks each chunk's sha256 before its first record.  A plain
  integer key is an index into the whole set, i.e. speculators' stock sampler: refused in
  one sentence rather than left to wait for a record the budget may never let exist.
- acks: ``sampler.covered_seqs(n)`` are the chunks whose every record is in the first
  ``n`` batches of the pass, i.e. what a checkpoint taken after ``n`` optimizer steps
  covers; rank 0 acks them once that checkpoint is durable.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from speculators.train.data import BaseDataset
from speculators.train.distributed_batch_sampler import _assign_to_packed_batches
from torch.utils.data import Sampler

from hsextract.chunks import ChunkReader
from hsextract.stream.journal import JOURNAL, StreamError, read_state, stream_dir
from hsextract.stream.reader import StreamDataset, _seed_of, _wait_change, speculators_sample

Key = tuple[int, int]


def _pass_lines(run_dir: Path, pass_: int, epochs_mode: str) -> tuple[list[dict], bool]:
    """The pass's chunk lines in journal order, and whether the pass has ended."""
    st = read_state(stream_dir(run_dir))
    src = 1 if epochs_mode == "keep" else pass_
    return [c for _, c in sorted(st.chunks.items()) if c["pass"] == src], src in st.ends


class StreamSpeculatorsDataset(BaseDataset):
    """speculators' ``BaseDataset`` over the stream: ``dataset[(seq, j)]`` is record ``j``
    of the chunk announced as ``seq``, as speculators' ``ArrowDataset`` returns it (aux
    layers concatenated, the pre-norm final state apart; ``BaseDataset`` adds ``lengths``
    and ``position_ids``).  Use it with :class:`StreamPackingSampler` only."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        max_len: int,
        *,
        hidden_states_dtype: torch.dtype = torch.bfloat16,
        epochs_mode: str = "keep",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.epochs_mode = epochs_mode
        self._stream = StreamDataset(run_dir, layout="raw", epochs_mode=epochs_mode)
        self._open: tuple[int, ChunkReader] | None = None  # one chunk open per process
        super().__init__(max_len, hidden_states_dtype)

    def _compute_approx_lengths(self) -> list[int]:
        # The whole set's lengths do not exist before it is extracted; the sampler reads
        # each chunk's lengths when the chunk is announced.
        return []

    def __len__(self) -> int:
        st = read_state(stream_dir(self.run_dir))
        return sum(int(c["records"]) for c in st.chunks.values())

    def _get_raw_data(self, index: Any) -> dict[str, torch.Tensor]:
        if not (isinstance(index, tuple) and len(index) == 2):
            raise StreamError(
                f"speculators asked for record {index!r} of the whole set in a random order "
                "(its MultipackDistributedBatchSamplerV2), which a stream under "
                "stream.budget_gb cannot keep on disk; pass "
                "hsextract.stream.speculators.StreamPackingSampler as the DataLoader's "
                "batch_sampler (it packs the chunks in the order they are announced)"
            )
        seq, j = int(index[0]), int(index[1])
        if self._open is None or self._open[0] != seq:
            line = read_state(stream_dir(self.run_dir)).chunks.get(seq)
            if line is None:
                raise StreamError(f"seq {seq} is not in {stream_dir(self.run_dir) / JOURNAL}")
            self._open = None  # drop the previous chunk's map before opening the next
            self._open = (seq, self._stream._open(line))  # sha256 checked first
            self._chunk = line["chunk"]
        sample = speculators_sample(self._open[1][j], self._chunk)
        return {k: sample[k] for k in ("hidden_states", "input_ids",
                                       "verifier_last_hidden_states", "loss_mask")}  # fmt: skip


class StreamPackingSampler(Sampler[list[Key]]):
    """speculators' length packing over the chunks as they are announced (see the module
    docstring); one instance per rank, the same ``seed`` on every rank."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        batch_max_length: int,
        *,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
        epochs_mode: str = "keep",
        poll_s: float = 0.05,
        timeout_s: float | None = None,
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, world {world})")
        self.run_dir = Path(run_dir)
        self.batch_max_length = batch_max_length
        self.rank, self.world, self.seed = rank, world, seed
        self.epochs_mode = epochs_mode
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.epoch = 0
        self._complete: list[tuple[int, int]] = []  # (batches yielded, seq) as seqs finish

    def set_epoch(self, epoch: int) -> None:
        """speculators' Trainer calls this each epoch; epoch e reads pass e + 1."""
        self.epoch = epoch

    def __len__(self) -> int:
        """An estimate until the pass has been read (speculators' Trainer sizes its LR
        schedule by it): the run's planned tokens over one batch's tokens x ranks."""
        lines, _ = _pass_lines(self.run_dir, self.epoch + 1, self.epochs_mode)
        tokens = sum(int(c["tokens"]) for c in lines)
        return max(1, -(-tokens // (self.batch_max_length * self.world)))

    def covered_seqs(self, batches: int) -> list[int]:
        """The chunks whose every record is in the first ``batches`` batches of the pass:
        what a checkpoint after that many steps covers (rank independent)."""
        return [seq for n, seq in self._complete if n <= batches]

    def _wait(self, i: int) -> tuple[list[dict], bool]:
        import time

        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        seen = None
        while True:
            lines, ended = _pass_lines(self.run_dir, self.epoch + 1, self.epochs_mode)
            if len(lines) > i or ended:
                return lines, ended
            if deadline is not None and time.monotonic() > deadline:
                raise StreamError(
                    f"no chunk {i} of pass {self.epoch + 1} in {stream_dir(self.run_dir) / JOURNAL}"
                    f" after {self.timeout_s} s; is the workflow running?"
                )
            seen = _wait_change(stream_dir(self.run_dir) / JOURNAL, seen, self.poll_s)

    def __iter__(self) -> Iterator[list[Key]]:
        self._complete = []
        carry: list[tuple[Key, int]] = []  # (key, length) left by the packer
        owed: dict[int, int] = {}  # seq -> its records not yet in a batch
        yielded = 0
        i = 0
        while True:
            lines, _ = self._wait(i)
            if i >= len(lines):
                break
            line = lines[i]
            i += 1
            seq = int(line["seq"])
            reader = ChunkReader(self.run_dir / line["path"])  # lengths only: the header
            lens = (reader.offsets[1:] - reader.offsets[:-1]).tolist()
            del reader
            order = list(range(int(line["records"])))
            random.Random(_seed_of(self.seed, self.epoch, seq)).shuffle(order)
            pending = carry + [((seq, j), int(lens[j])) for j in order]
            owed[seq] = len(order)
            lengths = np.minimum(np.array([n for _, n in pending]), self.batch_max_length)
            per_rank = [
                _assign_to_packed_batches(lengths, self.batch_max_length, r, self.world)
                for r in range(self.world)
            ]
            placed: set[int] = set()
            for b, mine in enumerate(per_rank[self.rank]):
                for r in range(self.world):
                    placed.update(int(x) for x in per_rank[r][b])
                yield [pending[int(x)][0] for x in mine]
                yielded += 1
                self._settle(owed, [pending[int(x)][0] for r in range(self.world)
                                    for x in per_rank[r][b]], yielded)  # fmt: skip
            carry = [p for k, p in enumerate(pending) if k not in placed]
        if carry:  # fewer than `world` records: one each, the rest an empty batch
            mine = [carry[self.rank][0]] if self.rank < len(carry) else []
            yield mine
            yielded += 1
            self._settle(owed, [k for k, _ in carry], yielded)

    def _settle(self, owed: dict[int, int], keys: list[Key], yielded: int) -> None:
        for seq, _ in keys:
            owed[seq] -= 1
            if owed[seq] == 0:
                self._complete.append((yielded, seq))
