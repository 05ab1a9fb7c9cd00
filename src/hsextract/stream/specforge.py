"""SpecForge's offline loader fed from a run in progress (issue 39, item 6).

SpecForge 0.2.0 trains offline from one ``torch.save`` file per record
(``input_ids``, ``loss_mask``, ``hidden_state``, ``aux_hidden_state``) that its
``OfflineEagle3Dataset`` turns into the draft model's inputs (``process_data``: truncate
to ``max_len``, mask the last token, aux states as ``hidden_state``, the final state as
``target``) and its ``DataCollatorWithPadding`` pads into batches.  Here the same two
pieces of SpecForge's own code run on :class:`StreamDataset` samples (its ``specforge``
layout is that file's content), so nothing is written per record and the stream's split,
shuffle, sha256 check, padding of a short rank and resume (``StatefulDataLoader``) hold
unchanged.  SpecForge's ``DistributedSampler`` over the whole set is not used: it draws
from every record at once, which a budget cannot keep on disk.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from specforge.data.preprocessing import OfflineEagle3Dataset
from specforge.data.utils import DataCollatorWithPadding
from torch.utils.data import IterableDataset

from hsextract.stream.reader import StreamDataset


class SpecForgeStreamDataset(IterableDataset):
    """:class:`StreamDataset` (``layout="specforge"``) through SpecForge's own
    ``OfflineEagle3Dataset.process_data``; ``pad`` and ``seq`` ride along for acks.

    Stateful like the dataset it wraps (torchdata's protocol), so a
    ``StatefulDataLoader`` resumes it mid-pass; :func:`consumed_seqs` works on its state.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        max_len: int = 2048,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
        epochs_mode: str = "keep",
        timeout_s: float | None = None,
    ) -> None:
        self.stream = StreamDataset(run_dir, rank=rank, world=world, seed=seed,
                                    layout="specforge", epochs_mode=epochs_mode,
                                    timeout_s=timeout_s)  # fmt: skip
        self.max_len = max_len

    def state_dict(self) -> dict[str, int]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.stream.load_state_dict(state)

    def set_pass(self, pass_: int) -> None:
        self.stream.set_pass(pass_)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for s in self.stream:
            out = OfflineEagle3Dataset.process_data(s, self.max_len)
            yield {**out, "pad": s["pad"], "seq": s["seq"], "id": s["id"]}


class SpecForgeCollator:
    """SpecForge's ``DataCollatorWithPadding`` on the tensors, the stream's bookkeeping
    (``id``, ``seq``, ``pad``) kept as lists beside them."""

    KEEP = ("id", "seq", "pad")

    def __init__(self) -> None:
        self.inner = DataCollatorWithPadding()

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        tensors = [{k: v for k, v in f.items() if k not in self.KEEP} for f in features]
        out = self.inner(tensors)
        for k in self.KEEP:
            out[k] = [f[k] for f in features]
        return out
