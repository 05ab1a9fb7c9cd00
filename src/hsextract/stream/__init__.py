"""Train while extracting: a crash-safe file stream from the workflow to a trainer.

Four planes, all plain files under ``<run dir>/stream/`` (see DESIGN.md beside this file):
the journal (the producer announces verified chunks), the acks (the trainer says which
chunks a committed checkpoint covers, or that one failed its sha256), the budget (a chunk
job waits before sending while too many bytes are unacknowledged) and the reader (a torch
``IterableDataset`` that follows the journal).

Only the workflow side and the trainer import this package; the server process never
does (it imports :mod:`hsextract.capture` alone), and nothing here imports the server.
``journal`` and ``budget`` are stdlib-only so a chunk job's gate costs no torch import;
``reader`` imports torch.
"""

#: The trainer's names, importable as ``from hsextract.stream import StreamLoader``; loaded
#: on first use, so the gate's import of this package stays free of torch.
_TRAINER = {
    "StreamDataset": "hsextract.stream.reader",
    "consumed_seqs": "hsextract.stream.reader",
    "checkpoint_due": "hsextract.stream.reader",
    "StreamLoader": "hsextract.stream.loader",
    "AckWriter": "hsextract.stream.journal",
}


def __getattr__(name: str) -> object:
    if name in _TRAINER:
        import importlib

        return getattr(importlib.import_module(_TRAINER[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
