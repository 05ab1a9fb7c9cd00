"""The audit's layer-by-layer forward (hsextract.layered), for a model larger than memory.

It gives the in-memory forward's states bit for bit (tiny seeded Llama, Qwen3 with tied
embeddings and DeepSeek-V3 checkpoints sharded over several safetensors files with an
index, records of different lengths, float32 and the bf16 noise pass, the LM head's
top-1); it reads each decoder layer's tensors once and only those, and keeps nothing of a
module once past it; place() chooses it when the model does not fit and a layer does, and
refuses in one sentence when a layer does not fit either; and the audit stage run on the
demo with its memory forced small streams layer by layer and passes with the figures of
the in-memory forward.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from hsextract import audit, layered
from hsextract.config import load_config, typed
from hsextract.demo import demo_model_config

LAYERS = 4


def _save_sharded(kind: str, out: Path) -> Path:
    """A seeded random model saved in bf16 over several safetensors shards with an index;
    norm weights away from 1, so the final norm's input and output differ."""
    if kind == "llama":
        config = LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
            tie_word_embeddings=False,
        )  # fmt: skip
    elif kind == "qwen3":  # q/k norms; the mask chosen per layer type
        config = Qwen3Config(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
            tie_word_embeddings=True,
        )  # fmt: skip
    else:  # the demo's DeepSeek-V3: MLA, dense then MoE layers (experts fused on load)
        config = demo_model_config(
            {"hidden_size": 64, "num_hidden_layers": LAYERS, "vocab_size": 512}
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="100KB")
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3", "deepseek_v3"])
def test_the_layered_forward_gives_the_in_memory_states_exactly(tmp_path, monkeypatch, kind):
    path = _save_sharded(kind, tmp_path / kind)
    assert (path / layered.INDEX_FILE).exists()
    assert len(list(path.glob("*.safetensors"))) >= 2
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 17, 40)]
    wanted, noise_keys = set(range(LAYERS + 1)), {1, 2}

    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = [audit.forward_states(full, r, wanted, LAYERS) for r in ids]
    top1 = [audit.top1(full, r["final"]) for r in refs]
    full.to(torch.bfloat16)
    noise = [audit.forward_states(full, r, noise_keys, LAYERS) for r in ids]
    noise_top1 = [audit.top1(full, n["final"]) for n in noise]
    del full

    loads: list[tuple[str, list[str]]] = []
    load = layered._Skeleton.load

    def spy(self, where, keys=None):
        loads.append((where, list(self.keys[where] if keys is None else keys)))
        return load(self, where, keys)

    monkeypatch.setattr(layered._Skeleton, "load", spy)
    free = layered._Skeleton.free
    held: list[int] = []

    def freed(self, where):  # what stays in memory after each module: nothing of it
        free(self, where)
        held.append(sum(t.numel() for t in self.model.state_dict().values() if not t.is_meta))

    monkeypatch.setattr(layered._Skeleton, "free", freed)
    finals = [r["final"] for r in refs]
    got = layered.reference(path, ids, wanted, noise_keys, LAYERS, "cpu", "bfloat16", finals)

    for r in range(len(ids)):
        assert got.refs[r].keys() == refs[r].keys() == {*wanted, "final"}
        for k, t in refs[r].items():  # float32 compute, float64 copies: bit for bit
            assert torch.equal(got.refs[r][k], t), (kind, r, k, (got.refs[r][k] - t).abs().max())
        assert got.noise_refs is not None and got.noise_refs[r].keys() == noise[r].keys()
        for k, t in noise[r].items():
            assert torch.equal(got.noise_refs[r][k], t), (kind, r, k)
        assert torch.equal(got.ref_top1[r], top1[r]) and torch.equal(got.stored_top1[r], top1[r])
        assert got.noise_top1 is not None and torch.equal(got.noise_top1[r], noise_top1[r])
    assert held and set(held) == {0}, held
    # Each decoder layer read once, and only its own tensors.
    layer_loads = [(w, ks) for w, ks in loads if ".layers." in w]
    assert [w for w, _ in layer_loads] == [f"model.layers.{i}" for i in range(LAYERS)]
    for i, (_, ks) in enumerate(layer_loads):
        assert ks and all(k.startswith(f"model.layers.{i}.") for k in ks), ks


def _cfg() -> SimpleNamespace:
    return SimpleNamespace(engine="reference", server=SimpleNamespace(device="cpu"))


def test_place_streams_a_model_larger_than_memory_and_refuses_a_layer_too_large(
    tmp_path, monkeypatch
):
    gib = 2**30
    sizes = audit.Sizes(params=70 * 10**9, tokens=20_000, passes=2, layer_params=10**9)
    monkeypatch.setattr(audit, "_mem_available", lambda: 64 * gib)
    said: list[str] = []
    where = audit.place(_cfg(), tmp_path, sizes, said.append)
    assert where.layered and where.device == "cpu" and where.estimate_s is not None
    assert where.text.startswith("layer by layer on the CPU, streaming the weights from disk")
    assert "at least" in where.text  # its time estimated up front

    monkeypatch.setattr(audit, "_mem_available", lambda: 4 * gib)  # one layer: ~4.8 GiB
    with pytest.raises(audit.AuditRefused) as exc:
        audit.place(_cfg(), tmp_path, sizes, said.append)
    msg = str(exc.value)
    assert "\n" not in msg and msg.count(". ") == 0, msg  # one sentence
    assert "needs about 339.0 GiB and the CPU's memory has 4.0 GiB free" in msg, msg
    assert "even layer by layer (one decoder layer in memory at a time" in msg, msg
    assert "it needs about 4.8 GiB" in msg and "audit.records: 0" in msg, msg

    quantized = audit.Sizes(params=70 * 10**9, tokens=20_000, passes=2, layered_refused="fp8")
    monkeypatch.setattr(audit, "_mem_available", lambda: 64 * gib)
    with pytest.raises(audit.AuditRefused, match=r"cannot run layer by layer \(fp8\)"):
        audit.place(_cfg(), tmp_path, quantized, said.append)
    assert said == []


def test_the_audit_streams_the_demo_layer_by_layer_with_the_same_figures(demo_copy, monkeypatch):
    """The audit stage on the demo (a DeepSeek-V3, 8 layers, 16 records over 4 chunks),
    once with the memory it has and once with less than the whole model needs: the second
    streams layer by layer, says so, and passes with exactly the figures of the first."""
    wd, rd = demo_copy["workdir"], demo_copy["run_dir"]
    conf = yaml.safe_load((wd / "config.yaml").read_text())
    conf["audit"]["records"] = 16
    (wd / "config.yaml").write_text(yaml.safe_dump(conf))
    monkeypatch.chdir(wd)
    cfg = typed(load_config(wd / "config.yaml"))

    said_full: list[str] = []
    t0 = time.monotonic()
    full = audit.run(cfg, rd, rd / "state" / "full.json", say=said_full.append)
    full_s = time.monotonic() - t0
    assert not full["layered"] and full["verdict"] == "pass"
    place = audit.place

    def squeezed(cfg, run_dir, sizes, say):  # less memory than the model, more than a layer
        assert sizes.layered_need() < sizes.need()
        free = (sizes.layered_need() + sizes.need()) // 2
        monkeypatch.setattr(audit, "_mem_available", lambda: free)
        return place(cfg, run_dir, sizes, say)

    monkeypatch.setattr(audit, "place", squeezed)

    said: list[str] = []
    t0 = time.monotonic()
    got = audit.run(cfg, rd, rd / audit.AUDIT_FILE, say=said.append)
    layered_s = time.monotonic() - t0
    assert got["layered"] and got["verdict"] == "pass", got
    assert any(s.startswith("auditing 16 records") and "layer by layer on the CPU" in s
               for s in said), said  # fmt: skip
    assert any(s.startswith("layer 0 of 8:") and "s left" in s for s in said), said
    assert got["layers"] == full["layers"]  # every figure, exactly
    assert json.loads((rd / audit.AUDIT_FILE).read_text())["layered"] is True
    print(f"demo audit: in memory {full_s:.1f}s, layer by layer {layered_s:.1f}s")
