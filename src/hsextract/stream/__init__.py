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
