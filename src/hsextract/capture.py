"""The server-side half of the dump protocol: one piece per (rid, start) of an extend pass.

Imported inside the SGLang server process (through the patch or the forward hooks) and by
the reference engine, so the protocol exists once.  It may use only what SGLang's process
already has: the standard library, torch and safetensors.

A piece is ``<dump_dir>/<rid>/<start:09d>.safetensors`` holding the tokens
``[start, start+n)`` of request ``rid``: ``input_ids`` [n] int64, ``hidden_states`` [n, H]
(final, post-norm) and ``aux_hidden_states`` [n, k*H] (the residual stream entering each
aux layer, concatenated in ``aux_layers`` order).  It is written under a dot-prefixed
temporary name and renamed, so a reader never sees half a piece.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

DUMP_DIR_ENV = "SGLANG_HS_DUMP_DIR"
AUX_LAYERS_ENV = "HSEXTRACT_AUX_LAYERS"
PIECE_SUFFIX = ".safetensors"


def piece_name(start: int) -> str:
    return f"{start:09d}{PIECE_SUFFIX}"


def _safe_rid(rid: str) -> str:
    # rids come from our client (hex/uuid-like); refuse anything that could escape the dir.
    if not rid or "/" in rid or rid.startswith(".") or "\x00" in rid:
        raise ValueError(f"refusing unsafe request id for a dump path: {rid!r}")
    return rid


class DumpWriter:
    """Writes the pieces of one extend pass; synchronous reference implementation."""

    def __init__(self, dump_dir: str | os.PathLike[str], aux_layers: Sequence[int] | None = None):
        self.dump_dir = Path(dump_dir)
        if self.dump_dir.is_symlink() or not self.dump_dir.is_dir():
            raise RuntimeError(
                f"{DUMP_DIR_ENV}={self.dump_dir} is not an existing real directory; "
                "the hsextract client creates it (mode 0700) before the server starts"
            )
        self.aux_layers = list(aux_layers) if aux_layers is not None else None

    def write_batch(
        self,
        rids: Sequence[str],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        aux: Sequence[torch.Tensor],
        aux_layers: Sequence[int] | None = None,
    ) -> None:
        """Split a flat [T, ...] extend batch into per-request pieces and write them.

        ``input_ids`` is [T], ``hidden`` [T, H], each of ``aux`` [T, H]; request j owns rows
        ``sum(extend_lens[:j])`` to ``sum(extend_lens[:j+1])`` and those rows are its tokens
        ``[prefix_lens[j], prefix_lens[j] + extend_lens[j])``.
        """
        layers = list(aux_layers) if aux_layers is not None else self.aux_layers
        if layers is None:
            raise ValueError("aux_layers unknown: pass them or set HSEXTRACT_AUX_LAYERS")
        if len(aux) != len(layers):
            raise ValueError(f"got {len(aux)} aux tensors for aux_layers {layers}")
        total = int(sum(extend_lens))
        if input_ids.shape[0] != total or hidden.shape[0] != total:
            raise ValueError(
                f"batch rows {hidden.shape[0]} / ids {input_ids.shape[0]} != sum(extend_lens) {total}"
            )
        aux_cat = torch.cat([a.reshape(total, -1) for a in aux], dim=-1) if aux else hidden[:, :0]
        offset = 0
        for rid, start, n in zip(rids, prefix_lens, extend_lens, strict=True):
            n = int(n)
            start = int(start)
            if n > 0:
                self._write_piece(
                    _safe_rid(str(rid)),
                    start,
                    input_ids[offset : offset + n],
                    hidden[offset : offset + n],
                    aux_cat[offset : offset + n],
                    layers,
                )
            offset += n

    def _write_piece(
        self,
        rid: str,
        start: int,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        aux: torch.Tensor,
        layers: list[int],
    ) -> None:
        rdir = self.dump_dir / rid
        rdir.mkdir(mode=0o700, exist_ok=True)
        final = rdir / piece_name(start)
        tmp = rdir / f".{start:09d}.{os.getpid()}.tmp"
        tensors = {
            "input_ids": ids.detach().to("cpu", torch.int64).contiguous(),
            "hidden_states": hidden.detach().to("cpu").contiguous(),
            "aux_hidden_states": aux.detach().to("cpu").contiguous(),
        }
        meta = {
            "rid": rid,
            "start": str(start),
            "n": str(int(ids.shape[0])),
            "aux_layers": json.dumps(layers),
        }
        save_file(tensors, str(tmp), metadata=meta)
        os.rename(tmp, final)

    def flush(self) -> None:
        """Block until every piece handed over so far is on disk (no-op when synchronous)."""

    def close(self) -> None:
        self.flush()


_WRITER: DumpWriter | None = None
_WRITER_DIR: str | None = None


def get_writer() -> DumpWriter | None:
    """The process-wide writer, or None when ``SGLANG_HS_DUMP_DIR`` is unset (capture off)."""
    global _WRITER, _WRITER_DIR
    d = os.environ.get(DUMP_DIR_ENV)
    if not d:
        return None
    if _WRITER is None or _WRITER_DIR != d:
        layers_env = os.environ.get(AUX_LAYERS_ENV)
        layers = json.loads(layers_env) if layers_env else None
        _WRITER = DumpWriter(d, layers)
        _WRITER_DIR = d
    return _WRITER
