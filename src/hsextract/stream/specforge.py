"""SpecForge's offline loader fed from a run in progress (issue 39, item 6).

SpecForge 0.2.0 trains offline from one ``torch.save`` file per record
(``input_ids``, ``loss_mask``, ``hidden_state``, ``aux_hidden_state``) that its EAGLE-3
algorithm turns into the draft model's inputs with its own factories
(``specforge.algorithms.eagle3.data``: ``build_offline_normalizer`` -- truncate to
``max_len``, mask the last token, aux states as ``hidden_state``, the final state as
``target`` -- and ``build_offline_collator``, SpecForge's ``DataCollatorWithPadding``).
Here those factories run on :class:`StreamDataset` samples (its ``specforge`` layout is
that file's content), so nothing is written per record and the stream's split, shuffle,
sha256 check, padding of a short rank and resume (:class:`StreamLoader`) hold unchanged;
:func:`specforge_loader` builds that loader.
SpecForge's ``DistributedSampler`` over the whole set is not used: it draws from every
record at once, which a budget cannot keep on disk.  USP (sequence-parallel) preprocessing
is not wired: it needs SpecForge's process groups.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer
from torch.utils.data import IterableDataset

from hsextract.config_types import StreamConfig
from hsextract.stream.loader import StreamLoader
from hsextract.stream.reader import StreamDataset


class SpecForgeStreamDataset(IterableDataset):
    """:class:`StreamDataset` (``layout="specforge"``) through SpecForge's own EAGLE-3
    offline normalizer; ``id``, ``seq`` and ``pad`` ride along (acks, bookkeeping).

    Stateful like the dataset it wraps (torchdata's protocol), so a :class:`StreamLoader`
    resumes it mid-pass (or at a pass's end: to nothing of it); :func:`consumed_seqs` works
    on its loader states (every rank's: the ranks read each chunk together), and
    ``StreamLoader.checkpoint_due`` on its loader.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        max_len: int = 2048,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
        epochs_mode: str = StreamConfig.epochs_mode,
        timeout_s: float | None = None,
    ) -> None:
        self.stream = StreamDataset(run_dir, rank=rank, world=world, seed=seed,
                                    layout="specforge", epochs_mode=epochs_mode,
                                    timeout_s=timeout_s)  # fmt: skip
        self.normalize = build_offline_normalizer(max_len)

    def state_dict(self) -> dict[str, int]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.stream.load_state_dict(state)

    def set_pass(self, pass_: int) -> None:
        self.stream.set_pass(pass_)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for s in self.stream:
            out = self.normalize(s)
            yield {**out, "pad": s["pad"], "seq": s["seq"], "id": s["id"]}


class SpecForgeCollator:
    """SpecForge's EAGLE-3 offline collator on the tensors, the stream's bookkeeping
    (``id``, ``seq``, ``pad``) kept as lists beside them."""

    KEEP = ("id", "seq", "pad")

    def __init__(self) -> None:
        self.inner = build_offline_collator()

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        tensors = [{k: v for k, v in f.items() if k not in self.KEEP} for f in features]
        out = self.inner(tensors)
        for k in self.KEEP:
            out[k] = [f[k] for f in features]
        return out


def specforge_loader(
    run_dir: str | os.PathLike[str],
    *,
    batch_size: int,
    max_len: int = 2048,
    num_workers: int = 0,
    rank: int = 0,
    world: int = 1,
    seed: int = 0,
    epochs_mode: str = StreamConfig.epochs_mode,
    timeout_s: float | None = None,
    **loader_kwargs: Any,
) -> StreamLoader:
    """SpecForge's offline batches from a run in progress: :class:`SpecForgeStreamDataset`
    in a :class:`StreamLoader` with :class:`SpecForgeCollator`.  Its ``state_dict`` is the
    checkpoint's loader state (resume: ``load_state_dict``), ``checkpoint_due`` says when
    a checkpoint is due, and ``consumed_seqs`` of every rank's state what it covers.
    ``loader_kwargs`` go to the loader (``prefetch_factor``, ``pin_memory``, ...)."""
    ds = SpecForgeStreamDataset(run_dir, max_len=max_len, rank=rank, world=world, seed=seed,
                                epochs_mode=epochs_mode, timeout_s=timeout_s)  # fmt: skip
    return StreamLoader(ds, batch_size=batch_size, num_workers=num_workers,
                        collate_fn=SpecForgeCollator(), **loader_kwargs)  # fmt: skip
