"""The trainer's checkpoint schedule the budget assumes, in words either side can say.

The budget is sized for a trainer that checkpoints, then acks, at least every
``stream.checkpoint_chunks`` chunks (its window: ``prefetch_chunks + checkpoint_chunks +
1`` chunks, ``gate.check_window``).  A trainer that checkpoints less often reads up to the
last chunk the gate let in and waits for the next, while every chunk job waits at the shut
gate for the acks only that trainer's next checkpoint would write: both wait for good,
and neither side sees an error.  The gate (a chunk job's log, ``hsextract status``) and
the reader (its waiting warning) name that deadlock with these words.

Stdlib only: the gate imports it without torch.  When a trainer must checkpoint is
:func:`hsextract.stream.reader.checkpoint_due` (it reads the trainer's loader state).
"""

from __future__ import annotations

#: The reader's and the gate's explanation of a shut gate that waits for a trainer.
LATE_CHECKPOINT = (
    "a trainer that checkpoints (then acks) less often than stream.checkpoint_chunks "
    "chunks waits here for good, and the workflow with it; checkpoint when "
    "hsextract.stream.checkpoint_due says (a step count cannot say it: chunks hold "
    "different numbers of records), and have a resumed trainer ack at once what its "
    "checkpoint covers"
)


def late_checkpoint_text(checkpoint_chunks: int, prefetch_chunks: int, unacked: int) -> str:
    """What a chunk job waiting at a shut gate adds to its waiting line: if the trainer
    waits for a chunk too, it checkpoints less often than the run declares, which no
    amount of waiting resolves.  ``unacked``: the chunks announced and not acknowledged.

    Said as a condition: the gate cannot tell a trainer that is slow (it has not read
    those chunks yet) from one that checkpoints too rarely (it has read them all)."""
    window = prefetch_chunks + checkpoint_chunks + 1
    return (
        f"; if the trainer waits for a chunk too, it holds {unacked} chunk(s) unacknowledged "
        f"against the {window} of its window (prefetch_chunks {prefetch_chunks} + "
        f"checkpoint_chunks {checkpoint_chunks} + 1): {LATE_CHECKPOINT}"
    )
