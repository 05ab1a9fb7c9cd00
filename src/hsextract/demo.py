"""The embedded default: a synthetic dataset and a tiny random-weight DeepSeek-V3.

Built locally and seeded, so CI and a laptop run the real pipeline with no download.  The
model keeps DeepSeek-V3's structure (MLA attention, dense then MoE layers, grouped routing)
so the capture and assembly code meet the same shapes of problem as production.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import orjson

#: The demo model's max_position_embeddings (see demo_model_config).
DEMO_MAX_POSITIONS = 16384


def demo_model_config(demo: dict):
    from transformers import DeepseekV3Config

    h = int(demo["hidden_size"])
    return DeepseekV3Config(
        vocab_size=int(demo["vocab_size"]),
        hidden_size=h,
        intermediate_size=2 * h,
        moe_intermediate_size=h // 2,
        num_hidden_layers=int(demo["num_hidden_layers"]),
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=2,  # dense layers 0-1, MoE after: both kinds are captured
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        # Fixed, not max_seq_len: the weights (and the run's fingerprint) must not change
        # when only the data's length policy does.  Without rope scaling it changes nothing
        # a forward computes.
        max_position_embeddings=DEMO_MAX_POSITIONS,
        rope_scaling=None,
        tie_word_embeddings=False,
    )


def build_demo_model(out_dir: Path, demo: dict) -> None:
    """Save a seeded random DeepSeek-V3 with ``save_pretrained``; atomic via a temp dir."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    out_dir = Path(out_dir)
    torch.manual_seed(int(demo["seed"]))
    model = DeepseekV3ForCausalLM(demo_model_config(demo)).eval()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def demo_lengths(n: int, max_seq_len: int, rng: random.Random) -> list[int]:
    """Varied lengths with the edges that break things: 1, max_seq_len, and one over it."""
    edges = [1, max_seq_len, max_seq_len + 7, 2]
    body = [max(1, min(max_seq_len, int(rng.lognormvariate(4.3, 0.8)))) for _ in range(n)]
    return (edges + body)[:n]


def build_demo_data(out_paths: list[Path], demo: dict, max_seq_len: int) -> None:
    """Write JSON-lines shards; record ids are global, one record carries extra keys."""
    rng = random.Random(int(demo["seed"]))
    n = int(demo["n_records"])
    vocab = int(demo["vocab_size"])
    lengths = demo_lengths(n, max_seq_len, rng)
    shards: list[list[bytes]] = [[] for _ in out_paths]
    for i, length in enumerate(lengths):
        ids = [rng.randrange(vocab) for _ in range(length)]
        # Prompt tokens carry no loss, the response does: a realistic 0...0 1...1 mask.
        cut = rng.randrange(length) if length > 1 else 0
        rec: dict = {
            "id": f"demo-{i:05d}",
            "input_ids": ids,
            "loss_mask": [0] * cut + [1] * (length - cut),
        }
        if i % 7 == 3:
            rec["source"] = {"dataset": "synthetic", "turns": i % 3}
        shards[i % len(out_paths)].append(orjson.dumps(rec))
    for path, lines in zip(out_paths, shards, strict=True):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in lines))
        os.replace(tmp, path)
