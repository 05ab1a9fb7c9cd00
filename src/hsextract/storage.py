"""How a chunk file stores its hidden-state rows: ``storage.codec`` = none | lossless | fp8.

* ``none``: the raw rows, the v1 layout (readers slice them straight from an mmap).
* ``lossless``: each record's rows cut into frames of about :data:`FRAME_BYTES`, each
  frame's elements split into byte planes (byte *i* of every element, contiguous) and
  each plane compressed with zstd -- or stored as it is when zstd does not gain, which is
  the case for bf16's low byte (seven mantissa bits and one exponent bit: noise).  A
  record decodes from its own frames only, so random access is kept.  Why this and not
  blosc2's shuffle + zstd, which gives the same ratio: blosc2 always runs the codec over
  the mantissa stream too, ~40 % of its time for nothing (``bench/codec.py`` measures
  both in one run); the plane split is one numpy copy, the compression is the zstandard
  library.
* ``fp8``: float8 e4m3 with one scale per token per layer (``amax / 448``), the scheme
  vLLM speculators stores; lossy, half the bytes of bf16.  The writer measures the error
  against the captured states per layer and records it in the file.

Everything here is pure: bytes in, bytes out, no file handling (that is ``chunks``).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import numpy as np
import torch

from hsextract.chunkfile import CODECS, FRAME_COLUMNS  # noqa: F401 - defined beside the layout

#: Raw bytes per lossless frame (rows are never split; a frame holds at least one row).
FRAME_BYTES = 4 << 20
#: A plane is stored compressed only if zstd makes it at least this much smaller.
KEEP_IF_BELOW = 0.98
#: Bytes of a plane compressed first to tell noise from data (see compress_frame).
PROBE_BYTES = 64 << 10
#: zstd's fast strategy with the smallest hash table it takes (2^6 entries): on bf16
#: exponent planes it compresses as well as level 1 (within 0.1 bit per byte, both near
#: the plane's order-0 entropy: the gain is the Huffman coding of literals, matches are
#: rare) at ~2x its speed.  Why so small: a bigger table only finds more short, false
#: matches, each a mispredicted branch; 2^10 entries cost 1.45-1.8x the time of 2^6 for
#: the same size (issue 40, trained and random-weight states; bench/codec.py prints both).
#: ``window_log`` stays 17: below it zstd cuts blocks smaller than 128 KiB, ~3x slower.
#: Frames are self-describing, so a reader needs none of this.
ZSTD_PARAMS = {
    "window_log": 17,
    "hash_log": 6,
    "chain_log": 6,
    "search_log": 1,
    "min_match": 7,
    "target_length": 0,
    "strategy": "fast",
}
FP8_MAX = 448.0  # largest finite float8_e4m3fn

_local = threading.local()  # zstd contexts are not thread-safe: one per thread


def zstd_compressor(params: dict = ZSTD_PARAMS):
    """A zstd compressor for planes, from ``params`` (:data:`ZSTD_PARAMS`'s keys)."""
    import zstandard

    params = dict(params)
    params["strategy"] = getattr(zstandard, "STRATEGY_" + params["strategy"].upper())
    # The frame checksum (xxhash64) makes a damaged plane fail to decode instead of
    # decoding to wrong numbers; it costs ~8 % of compression time (issue 40).
    params["write_checksum"] = True
    return zstandard.ZstdCompressor(
        compression_params=zstandard.ZstdCompressionParameters(**params)
    )


def _compressor():
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstd_compressor()
    return c


def _decompressor():
    d = getattr(_local, "dctx", None)
    if d is None:
        import zstandard

        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def codec_params(codec: str) -> dict:
    """What a file records about how it was encoded (for people: decoding needs none)."""
    if codec == "lossless":
        import zstandard

        return {
            "planes": "byte",
            "library": f"zstandard {zstandard.__version__}",
            "zstd": ZSTD_PARAMS,
            "frame_bytes": FRAME_BYTES,
            "keep_if_below": KEEP_IF_BELOW,
            "probe_bytes": PROBE_BYTES,
        }
    if codec == "fp8":
        return {"dtype": "float8_e4m3fn", "scale": "per token per layer, amax/448"}
    return {}


def compress_frame(data: memoryview | np.ndarray, esize: int) -> tuple[list, list[int]]:
    """Encode one frame: the planes' bytes and their lengths (negative: stored raw)."""
    planes = split_planes(np.frombuffer(data, dtype=np.uint8), esize)
    cctx = _compressor()
    parts: list = []
    lengths: list[int] = []
    for plane in planes:
        # A plane whose first 64 KiB do not shrink is noise (bf16's mantissa byte): store it
        # without running zstd over all of it.  A misjudged plane costs size, never bytes.
        n = plane.nbytes
        probe = n > 2 * PROBE_BYTES and (
            len(cctx.compress(plane[:PROBE_BYTES])) >= KEEP_IF_BELOW * PROBE_BYTES
        )
        packed = None if probe else cctx.compress(plane)
        if packed is not None and len(packed) < KEEP_IF_BELOW * n:
            parts.append(packed)
            lengths.append(len(packed))
        else:
            parts.append(plane)
            lengths.append(-n)
    return parts, lengths


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def split_planes(u: np.ndarray, esize: int) -> np.ndarray:
    """``[esize, n]``: byte ``p`` of every element in plane ``p`` (memory order).

    Little-endian, by shifts of whole elements into each plane, the low byte kept: 3.7x
    faster than one transposed byte copy for bf16 (0.35 vs 1.29 ms a 4 MB frame, ~14 %
    of a frame's encoding, issue 40; bench/codec.py prints both), the same bytes.  The
    transposed copy stays for big-endian hosts, where shifts order the planes by value."""
    if esize == 1:
        return u[None].copy()  # a plane kept raw must outlive ``u`` (chunks._Rows.read)
    if sys.byteorder != "little":
        return u.reshape(-1, esize).T.copy()
    word = u.view(_UINT[esize])
    planes = np.empty((esize, word.size), dtype=np.uint8)
    np.copyto(planes[0], word, casting="unsafe")  # uint to uint8 keeps the low byte
    for p in range(1, esize):
        np.right_shift(word, 8 * p, out=planes[p], casting="unsafe")
    return planes


def decompress_frame(
    blob: memoryview, offset: int, lengths: list[int], nbytes: int, out: np.ndarray
) -> None:
    """Decode one frame from ``blob[offset:]`` into ``out`` (uint8, ``nbytes`` long)."""
    esize = len(lengths)
    if out.nbytes != nbytes or nbytes % esize:
        raise ValueError(f"frame of {nbytes} bytes cannot fill {out.nbytes} as {esize} planes")
    n = nbytes // esize
    dctx = _decompressor()
    planes = []
    pos = offset
    for p, length in enumerate(lengths):
        if length < 0:
            plane = np.frombuffer(blob[pos : pos - length], dtype=np.uint8)
            pos -= length
        else:
            plane = np.frombuffer(
                dctx.decompress(blob[pos : pos + length], max_output_size=n), dtype=np.uint8
            )
            pos += length
        if plane.nbytes != n:
            raise ValueError(f"plane {p} decodes to {plane.nbytes} bytes, expected {n}")
        planes.append(plane)
    if esize == 1:
        out[:] = planes[0]
    elif sys.byteorder == "little":
        # Interleave by shifts on whole elements: 2.4x faster than strided byte stores.
        word = out.view(_UINT[esize])
        np.left_shift(planes[-1], 8 * (esize - 1), out=word, dtype=word.dtype)
        for p in range(esize - 1):
            word |= np.left_shift(planes[p], 8 * p, dtype=word.dtype) if p else planes[p]
    else:
        out.reshape(-1, esize)[:] = np.stack(planes, axis=1)


@dataclass
class Fp8Error:
    """Running error of fp8 against the captured states, one slot per layer."""

    n_layers: int

    def __post_init__(self) -> None:
        self.sq_err = np.zeros(self.n_layers)
        self.sq_ref = np.zeros(self.n_layers)
        self.max_abs = np.zeros(self.n_layers)
        self.count = np.zeros(self.n_layers, dtype=np.int64)
        self._lock = threading.Lock()

    def add(self, layer0: int, sq_err, sq_ref, max_abs, count: int) -> None:
        with self._lock:
            sl = slice(layer0, layer0 + len(sq_err))
            self.sq_err[sl] += sq_err
            self.sq_ref[sl] += sq_ref
            np.maximum(self.max_abs[sl], max_abs, out=self.max_abs[sl])
            self.count[sl] += count

    def report(self, names: list[str]) -> dict[str, dict[str, float]]:
        out = {}
        for i, name in enumerate(names):
            rel = float(np.sqrt(self.sq_err[i] / self.sq_ref[i])) if self.sq_ref[i] > 0 else 0.0
            out[name] = {"rel_rms": rel, "max_abs": float(self.max_abs[i])}
        return out


def fp8_quantize(x: torch.Tensor, err: Fp8Error | None = None, layer0: int = 0):
    """``x`` [rows, L, H] -> (float8 e4m3 [rows, L, H], float32 scales [rows, L])."""
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x32 / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    if err is not None:
        diff = q.to(torch.float32) * scale.unsqueeze(-1) - x32
        err.add(
            layer0,
            diff.square().sum(dim=(0, 2)).double().numpy(),
            x32.square().sum(dim=(0, 2)).double().numpy(),
            diff.abs().amax(dim=(0, 2)).double().numpy() if x.shape[0] else 0.0,
            int(x.shape[0] * x.shape[2]),
        )
    return q, scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize` (up to its error), in the file's captured dtype."""
    return (q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)).to(dtype)
