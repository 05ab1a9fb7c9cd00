"""The embedded default: a synthetic dataset and a tiny random-weight DeepSeek-V3.

Built locally and seeded, so CI and a laptop run the real pipeline with no download.  The
model keeps DeepSeek-V3's structure (MLA attention, dense then MoE layers, grouped routing)
so the capture and assembly code meet the same shapes of problem as production.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import orjson

from hsextract.errors import ConfigError, name_list

#: The demo model's max_position_embeddings (see demo_model_config).
DEMO_MAX_POSITIONS = 16384
#: In model.path: the demo built the model there; lists the files it wrote (JSON).
DEMO_MARKER = ".hsextract-demo-model"
#: What demos before the marker wrote (save_pretrained, and the rule's settings file).
_LEGACY_FILES = {"config.json", "generation_config.json", "model.safetensors"}
_SETTINGS = re.compile(r"settings-[0-9a-f]{12}\.json")  # rules/common.smk, settings_key


def _own_files(model_dir: Path) -> set[str] | None:
    """The names the demo wrote in ``model_dir`` per its marker; None if unmarked."""
    try:
        data = json.loads((model_dir / DEMO_MARKER).read_text())
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list):
        return None
    return {str(f) for f in files if "/" not in str(f) and str(f) not in ("", ".", "..")}


def demo_model_refusal(model_dir: Path) -> str | None:
    """Why the demo may not write its model into ``model_dir``, or None.

    The demo replaces only its own files: it writes into a new or empty directory, or one
    it built before (its marker lists what it wrote, and only those are replaced; one
    built before the marker holds only the names it wrote and a settings file).  Anything
    else -- a real model, a README, a subdirectory in a directory the demo did not
    create -- is someone's, and the demo refuses to run there.
    """
    model_dir = Path(model_dir)
    if not os.path.lexists(model_dir):
        return None
    if model_dir.is_symlink() or not model_dir.is_dir():
        problem = "is a symlink" if model_dir.is_symlink() else "is not a directory"
    else:
        if _own_files(model_dir) is not None:
            return None  # the demo's: it replaces only the files its marker lists
        names = sorted(os.listdir(model_dir))
        legacy = any(_SETTINGS.fullmatch(n) for n in names)
        known = (_LEGACY_FILES if legacy else set()) | {f"{DEMO_MARKER}.tmp"}
        foreign = [n for n in names if n not in known and not _SETTINGS.fullmatch(n)]
        if not foreign:
            return None
        problem = f"holds files the demo did not write ({name_list(foreign)})"
    return (
        f"model.path={str(model_dir)!r} {problem}, and demo.enabled is true: the demo writes "
        "its random-weight model (config.json, model.safetensors) only into a new or empty "
        "directory or one it built, never over someone's files. To extract with the model "
        "there set demo.enabled=false (and inputs); to run the demo, point model.path at a "
        "new directory"
    )


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
    """Save a seeded random DeepSeek-V3 with ``save_pretrained`` into ``out_dir``.

    Refused where :func:`demo_model_refusal` says (checked again here: the directory may
    have changed since the plan).  Each file is written to a temporary dir and renamed into
    place, replacing only a file of the same name the demo wrote before; the marker lists
    the union first, so an interrupted build is still recognised as the demo's.
    """
    import torch
    from transformers import DeepseekV3ForCausalLM

    out_dir = Path(out_dir)
    why = demo_model_refusal(out_dir)
    if why:
        raise ConfigError(why)
    torch.manual_seed(int(demo["seed"]))
    model = DeepseekV3ForCausalLM(demo_model_config(demo)).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        names = sorted(os.listdir(tmp))
        before = _own_files(out_dir) or set()
        _write_marker(out_dir, before | set(names))
        for name in names:
            os.replace(tmp / name, out_dir / name)
        for gone in before - set(names):  # the demo's own files of an older build
            (out_dir / gone).unlink(missing_ok=True)
        _write_marker(out_dir, set(names))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # our own mkdtemp


def _write_marker(model_dir: Path, files: set[str]) -> None:
    tmp = model_dir / f"{DEMO_MARKER}.tmp"
    tmp.write_text(json.dumps({"files": sorted(files)}) + "\n")
    os.replace(tmp, model_dir / DEMO_MARKER)


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
