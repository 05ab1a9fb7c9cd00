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
- :class:`AckOnCheckpoint` does that for speculators' own ``Trainer``: it acks after each
  checkpoint the Trainer commits, saves the sampler's state with it, resumes from it, and
  has the Trainer checkpoint every ``checkpoint_chunks`` chunks (the budget's window)
  through ``train_epoch``'s ``step_callback``, since the Trainer's own schedule
  (``checkpoint_freq``) counts steps of a pass whose length is only estimated, and per
  epoch (the default) it would hold the whole pass unacked.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from speculators.train.data import BaseDataset
from speculators.train.distributed_batch_sampler import _assign_to_packed_batches
from torch.utils.data import DataLoader, Sampler

from hsextract.chunkfile import VerifiedDir
from hsextract.chunks import ChunkReader
from hsextract.config_types import StreamConfig
from hsextract.records import _write_atomic
from hsextract.stream.journal import (
    JOURNAL,
    AckWriter,
    StreamError,
    _fsync_dir,
    read_state,
    stream_dir,
)
from hsextract.stream.reader import (
    StreamDataset,
    _seed_of,
    _wait_change,
    log,
    open_checked,
    speculators_sample,
    waiting_why,
)

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
        epochs_mode: str = StreamConfig.epochs_mode,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.epochs_mode = epochs_mode
        self._stream = StreamDataset(run_dir, layout="raw", epochs_mode=epochs_mode)
        # Open chunks, newest last: two, since a chunk's packing group also holds the
        # records carried from the one before, so batches alternate between them (each
        # open checks the sha256, a whole read: not to be redone per batch).
        self._open: dict[int, ChunkReader] = {}
        super().__init__(max_len, hidden_states_dtype)

    def __getstate__(self) -> dict[str, Any]:
        # A worker process opens its own chunk: a memory map does not pickle.
        return {**self.__dict__, "_open": {}}

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
        if seq not in self._open:
            line = read_state(stream_dir(self.run_dir)).chunks.get(seq)
            if line is None:
                raise StreamError(f"seq {seq} is not in {stream_dir(self.run_dir) / JOURNAL}")
            while len(self._open) >= 2:  # drop the oldest map before opening another
                del self._open[next(iter(self._open))]
            self._open[seq] = self._stream._open(line)[0]  # sha256 checked first
        sample = speculators_sample(self._open[seq][j], f"seq {seq}")
        return {k: sample[k] for k in ("hidden_states", "input_ids",
                                       "verifier_last_hidden_states", "loss_mask")}  # fmt: skip


@dataclass
class _Group:
    """One chunk's packing: its journal index, the pass's batch count before it, its
    batches (per batch, per rank, the keys) and the records it carried out."""

    index: int
    start: int
    batches: list[list[list[Key]]]
    carry_out: list[tuple[Key, int]]


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
        epochs_mode: str = StreamConfig.epochs_mode,
        poll_s: float = 0.05,
        timeout_s: float | None = None,
        verified: VerifiedDir | None = None,
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, world {world})")
        self.run_dir = Path(run_dir)
        self.verified = verified  # the dataset's: its workers then take this hash
        self.batch_max_length = batch_max_length
        self.rank, self.world, self.seed = rank, world, seed
        self.epochs_mode = epochs_mode
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.epoch = 0
        self._complete: list[tuple[int, int]] = []  # (batches yielded, seq) as seqs finish
        self._groups: list[_Group] = []  # the packing groups since the last state_dict
        self._resume: dict[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        """speculators' Trainer calls this each epoch; epoch e reads pass e + 1."""
        self.epoch = epoch

    def __len__(self) -> int:
        """An estimate (speculators' Trainer sizes its LR schedule and checkpoint interval
        by it before the pass exists): the run's planned tokens (``chunks/index.json``, or
        the chunks announced so far without one) over one step's tokens on all ranks."""
        index = self.run_dir / "chunks" / "index.json"
        if index.exists():
            from hsextract.records import read_index

            tokens = sum(int(e["tokens"]) for e in read_index(index)["chunks"])
        else:
            lines, _ = _pass_lines(self.run_dir, self.epoch + 1, self.epochs_mode)
            tokens = sum(int(c["tokens"]) for c in lines)
        return max(1, -(-tokens // (self.batch_max_length * self.world)))

    def covered_seqs(self, batches: int) -> list[int]:
        """The chunks whose every record is in the first ``batches`` batches of the pass:
        what a checkpoint after that many steps covers (rank independent).  Ack them with
        ``pass_=epoch + 1`` (with ``keep`` and several passes a chunk is freed only once
        acked in the last)."""
        return [seq for n, seq in self._complete if n <= batches]

    def _wait(self, i: int) -> tuple[list[dict], bool]:
        """The pass's chunks once its ``i``-th is announced or the pass has ended; warns
        while it waits and raises after ``timeout_s`` as :class:`StreamDataset` does."""
        t0 = time.monotonic()
        deadline = None if self.timeout_s is None else t0 + self.timeout_s
        report = t0 + StreamDataset.REPORT_S
        seen = None
        pass_ = self.epoch + 1
        while True:
            lines, ended = _pass_lines(self.run_dir, pass_, self.epochs_mode)
            if len(lines) > i or ended:
                return lines, ended
            now = time.monotonic()
            if deadline is not None and now > deadline:
                why = waiting_why(self.run_dir, read_state(stream_dir(self.run_dir)), lines,
                                  pass_, epochs_mode=self.epochs_mode)  # fmt: skip
                raise StreamError(
                    f"no chunk {i} of pass {pass_} in {stream_dir(self.run_dir) / JOURNAL}"
                    f" after {self.timeout_s} s{why}"
                )
            if now >= report:
                report = now + StreamDataset.REPORT_S
                why = waiting_why(self.run_dir, read_state(stream_dir(self.run_dir)), lines,
                                  pass_, epochs_mode=self.epochs_mode)  # fmt: skip
                log.warning(
                    "rank %d: waiting %.0f s for chunk %d of pass %d in %s%s (the sampler's "
                    "timeout_s stops it instead)", self.rank, now - t0, i, pass_,
                    stream_dir(self.run_dir) / JOURNAL, why,
                )  # fmt: skip
            seen = _wait_change(stream_dir(self.run_dir) / JOURNAL, seen, self.poll_s)

    def state_dict(self, batches: int) -> dict[str, Any]:
        """What a checkpoint taken after ``batches`` steps of this pass holds to resume:
        the packed batches left of the chunk group it was in (every rank's) and the records
        carried out of it, with their lengths.  So a resumed sampler reads no chunk that
        was packed before (those the checkpoint covers may be acked and deleted by then),
        and every rank resumes from rank 0's state."""
        while len(self._groups) > 1 and self._groups[1].start <= batches:
            self._groups.pop(0)  # a checkpoint never goes back before one already taken
        if not self._groups:
            return {"epoch": self.epoch, "at": batches, "next": 0, "rest": [], "carry": []}
        g = self._groups[0]
        return {"epoch": self.epoch, "at": batches, "next": g.index + 1,
                "rest": [[[list(k) for k in r] for r in b]
                         for b in g.batches[batches - g.start:]],
                "carry": [[k[0], k[1], n] for k, n in g.carry_out]}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], *, at: int | None = None) -> None:
        """Resume from :meth:`state_dict`: the next ``__iter__`` yields exactly the batches
        an uninterrupted pass would have yielded after that point, or after batch ``at``
        (>= the state's) if the trainer's checkpoint is later than this state: its
        batches in between are packed again, not yielded (no chunk they need is acked)."""
        if at is not None and at < int(state["at"]):
            raise ValueError(f"at {at} is before the state's batch {state['at']}")
        self.epoch = int(state["epoch"])
        self._resume = {**state, "skip_to": int(state["at"]) if at is None else at}

    def __iter__(self) -> Iterator[list[Key]]:
        skip_to = 0 if self._resume is None else int(self._resume["skip_to"])
        for n, batch in self._numbered():
            if n > skip_to:
                yield batch

    def _numbered(self) -> Iterator[tuple[int, list[Key]]]:
        """This rank's batches of the pass, each with its number (1-based, in the pass)."""
        resume, self._resume = self._resume, None
        if resume is not None and int(resume["epoch"]) != self.epoch:
            resume = None  # set_epoch moved on: a new pass starts at its beginning
        self._complete, self._groups = [], []
        owed: dict[int, int] = {}
        yielded, i = 0, 0
        carry: list[tuple[Key, int]] = []
        if resume is not None:
            yielded, i = int(resume["at"]), int(resume["next"])
            carry = [((int(a), int(b)), int(n)) for a, b, n in resume["carry"]]
            rest = [[[(int(a), int(b)) for a, b in r] for r in bt] for bt in resume["rest"]]
            owed = dict(Counter(k[0] for bt in rest for r in bt for k in r))
            owed.update((k, v + owed.get(k, 0)) for k, v in Counter(k[0] for k, _ in carry).items())
            for bt in rest:
                yielded += 1
                self._settle(owed, [k for r in bt for k in r], yielded)
                yield yielded, bt[self.rank]
        while True:
            lines, _ = self._wait(i)
            if i >= len(lines):
                break
            line = lines[i]
            seq = int(line["seq"])
            order = list(range(int(line["records"])))
            random.Random(_seed_of(self.seed, self.epoch, seq)).shuffle(order)
            lens = self._lengths(line)
            pending = carry + [((seq, j), lens[j]) for j in order]
            owed[seq] = len(order)
            lengths = np.minimum(np.array([n for _, n in pending]), self.batch_max_length)
            per_rank = [
                _assign_to_packed_batches(lengths, self.batch_max_length, r, self.world)
                for r in range(self.world)
            ]
            batches = [[[pending[int(x)][0] for x in per_rank[r][b]] for r in range(self.world)]
                       for b in range(len(per_rank[0]))]  # fmt: skip
            placed = {k for bt in batches for r in bt for k in r}
            carry = [p for p in pending if p[0] not in placed]
            self._groups.append(_Group(i, yielded, batches, carry))
            i += 1
            for bt in batches:
                yielded += 1
                # Recorded before the batch goes out (tagged with its number), so
                # covered_seqs(n) is complete as soon as the n-th batch was handed out.
                self._settle(owed, [k for r in bt for k in r], yielded)
                yield yielded, bt[self.rank]
        if carry:  # fewer than `world` records: one each, the rest an empty batch
            yielded += 1
            self._settle(owed, [k for k, _ in carry], yielded)
            yield yielded, [carry[self.rank][0]] if self.rank < len(carry) else []

    def _lengths(self, line: dict) -> list[int]:
        """A chunk's record lengths, from its header once its sha256 is checked: a chunk
        whose bytes changed is nacked and its redo waited for (a revision holds the same
        records, so the same lengths) as the dataset does."""
        reader, _ = open_checked(self.run_dir, line, who=f"rank {self.rank}", poll_s=self.poll_s,
                                 timeout_s=self.timeout_s, verified=self.verified)  # fmt: skip
        return [int(n) for n in (reader.offsets[1:] - reader.offsets[:-1]).tolist()]

    def _settle(self, owed: dict[int, int], keys: list[Key], yielded: int) -> None:
        for seq, _ in keys:
            owed[seq] -= 1
            if owed[seq] == 0:
                self._complete.append((yielded, seq))


def speculators_loader(
    run_dir: str | os.PathLike[str],
    total_seq_len: int,
    hidden_size: int,
    *,
    num_target_layers: int = 3,
    hidden_states_dtype: torch.dtype = torch.bfloat16,
    preprocess: Any = None,
    num_workers: int = 0,
    prefetch_factor: int | None = 4,
    rank: int = 0,
    world: int = 1,
    seed: int = 0,
    epochs_mode: str = StreamConfig.epochs_mode,
    timeout_s: float | None = None,
) -> DataLoader:
    """speculators' training ``DataLoader`` as its ``_setup_dataloader`` builds it (its
    ``CollateFn``, spawn workers, its worker init), over the stream: the dataset and the
    batch sampler are this module's.  ``loader.batch_sampler`` is the
    :class:`StreamPackingSampler` to ack and checkpoint with.

    Window: every rank reads the same chunk (the packer splits each chunk's records over
    the ranks), so ranks do not multiply it; the loader holds up to ``num_workers x
    prefetch_factor`` batches ahead, which may span chunks: count them in
    ``stream.prefetch_chunks``.
    """
    from speculators.train.data import CollateFn
    from speculators.train.dataloader import _worker_init_fn

    ds = StreamSpeculatorsDataset(run_dir, total_seq_len, hidden_states_dtype=hidden_states_dtype,
                                  epochs_mode=epochs_mode)  # fmt: skip
    sampler = StreamPackingSampler(run_dir, total_seq_len, rank=rank, world=world, seed=seed,
                                   epochs_mode=epochs_mode, timeout_s=timeout_s,
                                   verified=ds._stream.verified)  # fmt: skip
    workers = num_workers > 0
    return DataLoader(
        ds,
        batch_sampler=sampler,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if workers else None,
        collate_fn=CollateFn(
            total_seq_len,
            hidden_size,
            num_target_layers=num_target_layers,
            dtype=hidden_states_dtype,
            preprocess=preprocess,
        ),  # fmt: skip
        persistent_workers=workers,
        multiprocessing_context="spawn" if workers else None,
        worker_init_fn=_worker_init_fn if workers else None,
    )


class AckOnCheckpoint:
    """Acks for speculators' own ``Trainer`` (0.9.0) training from the stream (issue 39,
    item 4): a chunk is acknowledged only once a checkpoint the Trainer committed covers
    it, and that checkpoint resumes exactly.  ::

        trainer = Trainer(model, config, speculators_loader(run_dir, ...))
        AckOnCheckpoint(run_dir, checkpoint_chunks=8).attach(trainer)
        trainer.run_training()

    ``checkpoint_chunks`` is the workflow's ``stream.checkpoint_chunks``: the budget holds
    that many covered, unacked chunks, so the Trainer checkpoints (its own
    ``maybe_save_checkpoint``: model, optimizer, scheduler, ``training_state.json``) as
    soon as that many are covered, through ``train_epoch``'s ``step_callback``.  Why not
    its own schedule alone: ``checkpoint_freq`` >= 1 checkpoints once per epoch, so the
    whole pass would wait unacked (a budget below the pass deadlocks both sides), and
    ``checkpoint_freq`` < 1 counts steps of ``len(loader)``, an estimate here (the pass is
    being extracted), taking none in the last quarter interval nor past the estimate.
    Its own checkpoints still happen and are acked too.

    speculators writes every checkpoint of an epoch into the same ``<save_path>/<epoch>/``,
    in place and not atomically, so a kill during a save would tear the checkpoint whose
    chunks were already acked and deleted.  So each checkpoint of an epoch (not
    ``interrupted``, which speculators does not resume from) is written into
    ``<save_path>/hsextract-staging/<epoch>/``; rank 0 then checks its
    ``training_state.json`` records this very step, fsyncs its files (speculators does
    not), writes the sampler's state and the chunks covered so far beside them
    (:data:`STATE`, temp name + rename), swaps it in for ``<epoch>/`` (the old one renamed
    to ``<epoch>.hsextract-prev`` first), acks the chunks it covers with ``pass = epoch +
    1`` and removes the old one.  A kill before the swap leaves the last committed
    checkpoint in place; after it, the new one, committed: on attach rank 0 acks again what
    it covers (a kill may have come before the ack) and removes the leftovers.  Only a
    kill between the two renames leaves no ``<epoch>/``, which the Trainer has already
    resumed without: refused, saying the ``mv`` that restores it.  A Trainer resuming
    mid-epoch loads the sampler's state (speculators' fast-skip needs the whole epoch's
    batch list).
    """

    #: The sampler's state, in the Trainer's checkpoint directory of the epoch.
    STATE = "hsextract_stream.json"
    #: Where the Trainer writes a checkpoint before it replaces the epoch's (a name
    #: speculators' resume ignores: not an integer).
    STAGING = "hsextract-staging"
    #: The suffix of the epoch's previous checkpoint while the new one is swapped in.
    PREV = ".hsextract-prev"

    def __init__(self, run_dir: str | os.PathLike[str], *, checkpoint_chunks: int) -> None:
        if checkpoint_chunks < 1:
            raise ValueError(f"checkpoint_chunks {checkpoint_chunks} must be >= 1")
        self.run_dir = Path(run_dir)
        self.checkpoint_chunks = checkpoint_chunks
        self.acked: list[int] = []  # this epoch's, in ack order (every rank keeps them)
        self._epoch = 0
        self._step = 0  # the Trainer's local_step in the epoch
        self._saved: tuple[int, int] | None = None  # (epoch, local_step) last committed
        # The chunks covered by the checkpoint resumed from (its epoch's, before this run).
        self._before: list[int] = []

    def attach(self, trainer: Any) -> None:
        """Hook into ``trainer`` (before ``run_training``); refuses, in one sentence, a
        Trainer whose checkpoints could leave chunks unacked for good."""
        sampler = trainer.train_loader.batch_sampler
        if not isinstance(sampler, StreamPackingSampler):
            raise StreamError(
                f"speculators' Trainer reads with {type(sampler).__name__}, not "
                "hsextract.stream.speculators.StreamPackingSampler; build its train loader "
                "with speculators_loader so the chunks it covers are known"
            )
        tc = trainer.config  # speculators' TrainerConfig (cfg names ours)
        if tc.save_best:
            raise StreamError(
                "speculators' Trainer with save_best checkpoints only when validation "
                "improves, so chunks it trained on could stay unacked past stream.budget_gb; "
                "train from the stream with save_best off"
            )
        if tc.checkpoint_freq > 1:
            raise StreamError(
                f"speculators' Trainer with checkpoint_freq {tc.checkpoint_freq:g} saves no "
                "checkpoint in most epochs, so their chunks could never be acked; use "
                "checkpoint_freq <= 1 (AckOnCheckpoint adds one every checkpoint_chunks chunks)"
            )
        self.trainer, self.sampler = trainer, sampler
        self._rank = int(trainer.rank)
        if self._rank == 0:
            self._acker = AckWriter(self.run_dir)
        ck = trainer.checkpointer
        resume_at = int(getattr(trainer, "_resume_local_step", 0))
        # The epochs whose directories this run's saves replace (mid-epoch, _resume checks
        # the one resumed from).
        start = int(trainer.current_epoch) + (1 if resume_at > 0 else 0)
        self._recover(Path(ck.path), start, int(tc.num_epochs))
        if trainer.resume_from_checkpoint and ck.previous_epoch != -1:
            self._resume(Path(ck.path), int(ck.previous_epoch), resume_at)
        self._orig_save = trainer.maybe_save_checkpoint
        self._orig_epoch = trainer.train_epoch
        # Instance attributes shadow the methods: run_training and train_epoch call these.
        trainer.maybe_save_checkpoint = self._save
        trainer.train_epoch = self._train_epoch

    def _recover(self, root: Path, start: int, epochs: int) -> None:
        """What a kill during a save left: an epoch whose old checkpoint was renamed away
        and whose new one was not yet renamed in is refused (the Trainer, built before
        this, resumed without it); rank 0 removes a staged save and a replaced checkpoint
        (the new one is committed).  An epoch directory this run would replace that holds
        no :data:`STATE` is not ours to remove: refused."""
        for prev in sorted(root.glob(f"*{self.PREV}")):
            ckpt_dir = root / prev.name.removesuffix(self.PREV)
            if not (ckpt_dir / self.STATE).exists():
                raise StreamError(
                    f"the Trainer stopped while swapping in a checkpoint of epoch "
                    f"{ckpt_dir.name}, so it resumed without that epoch's last committed one: "
                    f"run `mv {prev} {ckpt_dir}` and start the training again"
                )
        for epoch in range(start, epochs):
            ckpt_dir = root / str(epoch)
            if ckpt_dir.is_dir() and not (ckpt_dir / self.STATE).exists():
                raise StreamError(
                    f"{ckpt_dir} holds a checkpoint AckOnCheckpoint did not write, which this "
                    "Trainer's checkpoints would replace; move it out of the Trainer's "
                    "save_path (or use another save_path) and start again"
                )
        if self._rank == 0:
            for leftover in [root / self.STAGING, *root.glob(f"*{self.PREV}")]:
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover)

    def _resume(self, root: Path, previous: int, at: int) -> None:
        """The Trainer resumed from ``<previous>/``: mid-epoch (``at`` > 0) the sampler
        resumes from its :data:`STATE`; either way rank 0 acks the chunks it covers that
        are not acked yet (the kill may have come between its commit and its ack)."""
        path = root / str(previous) / self.STATE
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            if at == 0:
                return  # an epoch's end not taken through AckOnCheckpoint: nothing to resume
            raise StreamError(
                f"{path} is missing or unreadable: the Trainer's checkpoint at step {at} was "
                "not taken through AckOnCheckpoint, so which chunks it covers (some may be "
                "acked and deleted) is unknown; resume from one AckOnCheckpoint wrote"
            ) from None
        if at == 0 and int(state["local_step"]) > 0:
            ts = {k: state[k] for k in ("epoch", "local_step", "global_step")}
            raise StreamError(
                f"{path.parent / 'training_state.json'} does not record step "
                f"{state['local_step']} of epoch {previous} that {path} covers, so the Trainer "
                f"would skip the rest of that pass; write {json.dumps(ts)} to it and start "
                "the training again"
            )
        if at > 0:
            if int(state["sampler"]["at"]) > at:
                raise StreamError(
                    f"{path} is of step {state['sampler']['at']}, after the Trainer's "
                    f"checkpoint step {at} in {path.parent}: not the same checkpoint; resume "
                    "from one AckOnCheckpoint wrote"
                )
            self.sampler.load_state_dict(state["sampler"], at=at)
            self._before = [int(s) for s in state.get("covered", [])]
        if self._rank == 0:
            acked = read_state(stream_dir(self.run_dir)).acked
            todo = [s for s in state.get("covered", []) if acked.get(s, (0,))[0] < previous + 1]
            self._acker.ack(todo, pass_=previous + 1, step=int(state["global_step"]))

    def _train_epoch(self, epoch: int, **kwargs: Any) -> None:
        t = self.trainer
        self._epoch = epoch
        # The Trainer's local_step goes on from the checkpoint it resumed from.
        resumed = epoch == getattr(t, "current_epoch", epoch)
        self._step = int(getattr(t, "_resume_local_step", 0)) if resumed else 0
        self.acked = []
        if not resumed:
            self._before = []
        theirs = kwargs.pop("step_callback", None)

        def on_step() -> None:
            self._step += 1
            if theirs is not None:
                theirs()
            covered = self.sampler.covered_seqs(self._step)
            if len(covered) - len(self.acked) >= self.checkpoint_chunks:
                t.maybe_save_checkpoint(epoch, local_step=self._step)

        self._orig_epoch(epoch, step_callback=on_step, **kwargs)

    def _save(self, epoch: int | str, local_step: int = 0) -> None:
        if not isinstance(epoch, int):  # speculators resumes only from an epoch's checkpoint
            self._orig_save(epoch, local_step=local_step)
            return
        if local_step > 0 and self._saved == (epoch, local_step):
            return  # this very step was just checkpointed (ours, then the Trainer's own)
        ck = self.trainer.checkpointer
        root = Path(ck.path)
        staging = root / self.STAGING
        if self._rank == 0:
            if (staging / str(epoch)).is_dir():  # a save of this run that raised
                shutil.rmtree(staging / str(epoch))
            staging.mkdir(parents=True, exist_ok=True)
            command = root / ck.TRAIN_COMMAND_FILENAME  # the Trainer copies it in
            if command.is_file():
                shutil.copy2(command, staging / command.name)
        # The Trainer writes everything under its checkpointer's path (model, optimizer,
        # scheduler, training_state.json, the epoch<e>_step<n> link): aside, until
        # _commit swaps it in whole.
        ck.path = staging
        try:
            self._orig_save(epoch, local_step=local_step)
        finally:
            ck.path = root
        # The end of an epoch (local_step 0) covers what was trained in it: with max_steps
        # the Trainer stops mid-pass and still calls it the end.
        steps = local_step if local_step > 0 else self._step
        new = [s for s in self.sampler.covered_seqs(steps) if s not in self.acked]
        if self._rank == 0:
            self._commit(epoch, local_step, steps, new)
        self.acked += new
        self._saved = (epoch, local_step)

    def _commit(self, epoch: int, local_step: int, steps: int, new: list[int]) -> None:
        """Rank 0, after the Trainer saved aside: make it durable, swap it in for the
        epoch's checkpoint, ack what it covers, then remove the one it replaced."""
        t = self.trainer
        root = Path(t.checkpointer.path)
        staged = root / self.STAGING / str(epoch)
        state_path = staged / "training_state.json"
        try:
            saved = json.loads(state_path.read_text())
        except (OSError, ValueError):
            saved = {}
        if saved.get("local_step") != local_step or saved.get("global_step") != t.global_step:
            raise StreamError(
                f"{state_path} does not record step {t.global_step} after speculators' "
                "Trainer saved its checkpoint there, so no chunk is acked; is its "
                "checkpointer writing elsewhere?"
            )
        for f in sorted(staged.iterdir()):
            if f.is_file() and not f.is_symlink():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        state = {"epoch": epoch, "local_step": local_step, "global_step": t.global_step,
                 "sampler": self.sampler.state_dict(steps),
                 "covered": self._before + self.acked + new}  # fmt: skip
        _write_atomic(staged / self.STATE, json.dumps(state).encode())
        _fsync_dir(staged)
        ckpt_dir, prev = root / str(epoch), root / f"{epoch}{self.PREV}"
        if ckpt_dir.exists():
            ckpt_dir.rename(prev)
        staged.rename(ckpt_dir)
        for old in root.glob(f"epoch{epoch}_*"):
            if old.is_symlink():
                old.unlink()
        for link in staged.parent.glob(f"epoch{epoch}_*"):
            if link.is_symlink():
                link.rename(root / link.name)
        shutil.rmtree(staged.parent)  # what is left there is ours (train_command.txt's copy)
        _fsync_dir(root)
        self._acker.ack(new, pass_=epoch + 1, step=t.global_step)
        if prev.is_dir():
            shutil.rmtree(prev)
