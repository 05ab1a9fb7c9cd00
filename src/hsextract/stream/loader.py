"""The loader a trainer reads the stream with: torchdata's ``StatefulDataLoader``, with
the end of a pass resuming to nothing of that pass.

torchdata (0.11) marks a state taken after the loader's iterator ran out
(``_iterator_finished``) and, with loader workers, resumes it at the start of the next
epoch: the workers' positions are dropped and the pass is read again from the top (40 of
40 records yielded again in a minimal case).  A trainer's last checkpoint is taken right
there, after its loop, so a trainer killed after it and resumed would train the whole pass
twice -- and meet the chunks that checkpoint acked, deleted by then.  Without workers the
dataset's own position happens to survive; with them it does not.  So :class:`StreamLoader`
resumes such a state as a position like any other (every worker at its end: nothing more of
that pass), whatever ``num_workers``; the next pass starts after ``set_pass`` as always.

Its states are marked, and a state without the mark (a plain ``StatefulDataLoader``'s, or
not a loader's) is refused at resume in one sentence: loaded into a plain loader it would
silently restart an ended pass, and nothing here can tell that from a real start.
"""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader

from hsextract.stream.journal import StreamError
from hsextract.stream.reader import StreamDataset, checkpoint_due

#: The mark of a :class:`StreamLoader` state (its value: the state's format).
MARK = "hsextract_stream_loader"
#: torchdata's key for "the iterator ran out" (its ``_ITERATOR_FINISHED``).
FINISHED = "_iterator_finished"


def _stream_of(dataset: Any) -> StreamDataset | None:
    """The :class:`StreamDataset` a loader reads, itself or wrapped (``.stream``, as
    SpecForge's adapter holds it)."""
    for ds in (dataset, getattr(dataset, "stream", None)):
        if isinstance(ds, StreamDataset):
            return ds
    return None


class StreamLoader(StatefulDataLoader):
    """``StatefulDataLoader`` for :class:`StreamDataset` (or a dataset wrapping one as
    ``.stream``): same arguments, same ``state_dict`` / ``load_state_dict``, plus

    - a state taken after a pass ended resumes to nothing of that pass, with or without
      loader workers (torchdata's own restarts the pass with workers);
    - ``load_state_dict`` refuses a state its ``state_dict`` did not make;
    - :meth:`checkpoint_due`: when the run's ``stream.checkpoint_chunks`` requires a
      checkpoint.
    """

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), MARK: 1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict == {}:  # torchdata's "start afresh"
            super().load_state_dict(state_dict)
            return
        if not isinstance(state_dict, dict) or MARK not in state_dict:
            raise StreamError(
                "this loader state was not made by hsextract.stream.StreamLoader (a plain "
                "torchdata StatefulDataLoader's, whose state taken after a pass ended "
                "restarts that pass, or none at all); take states with StreamLoader."
                "state_dict(), or start the pass afresh by loading none"
            )
        state = {k: v for k, v in state_dict.items() if k != MARK}
        # An ended pass resumes as a position (its workers' states at their ends), not as
        # torchdata's new epoch.
        state[FINISHED] = False
        super().load_state_dict(state)

    def checkpoint_due(self, checkpoint_chunks: int, since: dict[str, Any] | None = None) -> bool:
        """:func:`hsextract.stream.reader.checkpoint_due` for this loader's state now:
        whether ``checkpoint_chunks`` chunks were covered since the checkpoint whose loader
        state is ``since`` (None: the start).  Call it after each step, on every rank."""
        ds = _stream_of(self.dataset)
        if ds is None:
            raise StreamError(
                f"checkpoint_due needs the loader's dataset to be a StreamDataset (or hold "
                f"one as .stream); this one's is {type(self.dataset).__name__}"
            )
        return checkpoint_due(ds.run_dir, self.state_dict(), since,
                              checkpoint_chunks=checkpoint_chunks, rank=ds.rank, world=ds.world,
                              epochs_mode=ds.epochs_mode, poll_s=ds.poll_s,
                              timeout_s=ds.timeout_s)  # fmt: skip
