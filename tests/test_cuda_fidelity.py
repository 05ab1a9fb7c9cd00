"""The reference engine on a GPU: async capture (side stream, pinned pool, writer threads)
through the real client, every record checked against a direct forward on the same GPU.

Deselected by default (no GPU in CI); run on a GPU machine with ``pytest -m gpu``.
"""

from __future__ import annotations

import copy
import inspect
import os
from pathlib import Path

import pytest
import torch
import yaml

from hsextract import server
from hsextract.client import extract_chunk
from hsextract.config import typed
from hsextract.demo import build_demo_data, build_demo_model
from hsextract.records import merge_and_shuffle, split_chunks

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["model"]["path"] = str(root / "model")
    cfg["output_root"] = str(root / "results")
    _fill_defaults(cfg, yaml.safe_load((REPO / "schemas" / "config.schema.yaml").read_text()))
    build_demo_model(root / "model", cfg["demo"])
    shards = [root / f"shard_{i}.jsonl" for i in range(2)]
    build_demo_data(shards, cfg["demo"], cfg["max_seq_len"])
    merge_and_shuffle(
        shards, root / "merged", max_seq_len=cfg["max_seq_len"], overlength="truncate",
        seed=0, vocab_size=cfg["demo"]["vocab_size"], max_reject_fraction=0.0,
    )  # fmt: skip
    chunks = [root / "chunks" / f"chunk_{i:05d}.jsonl" for i in range(2)]
    split_chunks(root / "merged" / "train.jsonl", chunks, root / "chunks" / "index.json")
    return {"root": root, "cfg": cfg, "chunks": chunks}


def _fill_defaults(node: dict, schema: dict) -> None:
    """Schema defaults without Snakemake/jsonschema, which a bare GPU image may lack."""
    for key, sub in schema.get("properties", {}).items():
        if key not in node and "default" in sub:
            node[key] = copy.deepcopy(sub["default"])
        if isinstance(node.get(key), dict):
            _fill_defaults(node[key], sub)


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 0.0)])
def test_gpu_engine_output_equals_direct_forward(gpu_demo, tmp_path, dtype, tol):
    from transformers import AutoModelForCausalLM

    from hsextract.chunks import ChunkReader

    cfg = copy.deepcopy(gpu_demo["cfg"])
    cfg["server"]["device"] = "cuda"
    cfg["server"]["chunked_prefill_size"] = 64
    cfg["model"]["dtype"] = dtype
    cfg["dump"]["dir"] = str(tmp_path / "dump")
    cfg = typed(cfg)
    spec = server.build_spec(cfg, run_dir=tmp_path, log_path=tmp_path / "server.log")
    state = server.start(spec, owner=os.getpid())
    outs = []
    try:
        for chunk in gpu_demo["chunks"]:
            out = tmp_path / f"{chunk.stem}.safetensors"
            extract_chunk(
                cfg, chunk_path=chunk, index_path=chunk.parent / "index.json", out_path=out,
                sidecar_path=tmp_path / f"{chunk.stem}.json", ensure=lambda: state,
                progress=False,
            )  # fmt: skip
            outs.append(out)
    finally:
        server.stop(state)
    model = AutoModelForCausalLM.from_pretrained(cfg["model"]["path"], dtype=getattr(torch, dtype))
    model.to("cuda").eval()
    n = 0
    worst = 0.0
    for out in outs:
        reader = ChunkReader(out)
        for item in reader:
            # The same segmentation the engine used (64-token extends, KV carried) when a
            # bf16 comparison must be exact; float32 is compared with a plain forward.
            ids = item["input_ids"].long().tolist()
            hs = _forward(model, ids, 64 if tol == 0.0 else None)
            h = hs[0].shape[-1]
            diffs = [(item["hidden_states"].cuda().float() - hs[-1].float()).abs().max().item()]
            for i, layer in enumerate(reader.aux_layers):
                got = item["aux_hidden_states"][:, i * h : (i + 1) * h].cuda().float()
                diffs.append((got - hs[layer].float()).abs().max().item())
            worst = max(worst, *diffs)
            n += 1
    assert n > 0
    assert worst <= tol, f"{dtype}: max abs error {worst} > {tol}"


@torch.inference_mode()
def _forward(model, ids: list[int], segment: int | None) -> list[torch.Tensor]:
    from transformers import DynamicCache

    if segment is None:
        out = model.model(torch.tensor([ids], device="cuda"), output_hidden_states=True)
        return [h[0] for h in out.hidden_states]
    cache = DynamicCache(config=model.config)
    params = inspect.signature(model.model.forward).parameters
    kw = "cache" if "cache" in params else "past_key_values"
    parts: list[list[torch.Tensor]] = []
    for s in range(0, len(ids), segment):
        seg = ids[s : s + segment]
        out = model.model(
            torch.tensor([seg], device="cuda"),
            position_ids=torch.arange(s, s + len(seg), device="cuda")[None],
            use_cache=True,
            output_hidden_states=True,
            **{kw: cache},
        )
        parts.append([h[0] for h in out.hidden_states])
    return [torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))]
