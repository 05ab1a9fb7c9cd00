"""Helpers of the live-SGLang tests (marker ``sglang_live``; run on the H200 by h200/run.sh).

Tiny models built on the machine from a config (seeded, no download), with the checkpoint
key names real checkpoints have, so SGLang's loaders and HF's read the same file; the
extraction config for them; HF forwards of the same saved weights as the reference; and
the per-layer error table the fidelity tests assert on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]

#: What every live server gets beyond extraction mode: the recipe's (sglang-h200/README):
#: the slimmed sgl-kernel has no FA3, so triton attention; no tokenizer (we send ids);
#: a fixed KV pool, so several small servers can share the one GPU.
LIVE_EXTRA_ARGS = [
    "--attention-backend", "triton", "--sampling-backend", "pytorch",
    "--skip-tokenizer-init", "--max-total-tokens", "65536",
]  # fmt: skip
#: /health otherwise runs a one-token generation.
LIVE_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}


def installed_release():
    """The declaration (``hsextract.sglang.versions``) of the SGLang release this python has
    installed: what the workflow's own ``launch.release`` picks for :func:`live_config`'s
    configs, which leave ``sglang.version`` null.  On the H200 it must be the release
    ``h200/run.sh`` unpacked (``/tmp/site/.hsextract-sglang-version``)."""
    from hsextract.sglang import versions
    from hsextract.sglang.launch import installed_root, installed_version
    from hsextract.sglang.patching import installed_version as version_in

    version = installed_version(sys.executable)
    root = installed_root(sys.executable)
    found = version_in(root)
    assert found == version, f"{root}: _version.py says {found}, its metadata {version}"
    marker = root.parent / ".hsextract-sglang-version"
    if marker.is_file():  # h200/run.sh's site
        assert marker.read_text().strip() == version, f"{marker} vs installed {version}"
    return versions.get(version)


def deterministic_chunk(rel) -> int | None:
    """The chunked prefill ``--enable-deterministic-inference`` needs with the live attention
    backend (:data:`LIVE_EXTRA_ARGS`), from the release's declaration
    (``deterministic_align``, ``prefill_backend_args``); None if it declares no alignment."""
    from hsextract.sglang.launch import _option_value

    args = (_option_value(LIVE_EXTRA_ARGS, f) for f in rel.prefill_backend_args)
    backend = next((v for v in args if v), None)
    for name, env_var, default in rel.deterministic_align:
        if name == backend:
            return int(LIVE_ENV.get(env_var, default))
    return None


def _w(g: torch.Generator, *shape: int, std: float = 0.02) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)


def build_tiny_dsv3(out: Path, seed: int = 0, layers: int = 8) -> Path:
    """A random DeepSeek-V3 (MLA with DeepSeek-V3's own head dims, dense layer 0, then MoE
    with 8 experts, top-2), bf16.  Routing with n_group = topk_group = 1 and a routed
    scaling of 1.0 takes SGLang's precompiled gate and sum kernels (no JIT)."""
    c = dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
        vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=layers, first_k_dense_replace=1, moe_layer_freq=1,
        num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, routed_scaling_factor=1.0, hidden_act="silu",
        rms_norm_eps=1e-6, initializer_range=0.02, max_position_embeddings=16384,
        rope_theta=10000.0, rope_scaling=None, attention_bias=False, attention_dropout=0.0,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16",
        use_cache=True, num_nextn_predict_layers=0,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    h, v = c["hidden_size"], c["vocab_size"]
    nh, nope, rope, vd = 4, 128, 64, 128
    ql, kvl, mi, e = c["q_lora_rank"], c["kv_lora_rank"], c["moe_intermediate_size"], 8
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    sd = {"model.embed_tokens.weight": _w(g, v, h), "model.norm.weight": ones(h),
          "lm_head.weight": _w(g, v, h)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = ones(h)
        sd[p + "post_attention_layernorm.weight"] = ones(h)
        a = p + "self_attn."
        sd[a + "q_a_proj.weight"] = _w(g, ql, h)
        sd[a + "q_a_layernorm.weight"] = ones(ql)
        sd[a + "q_b_proj.weight"] = _w(g, nh * (nope + rope), ql)
        sd[a + "kv_a_proj_with_mqa.weight"] = _w(g, kvl + rope, h)
        sd[a + "kv_a_layernorm.weight"] = ones(kvl)
        sd[a + "kv_b_proj.weight"] = _w(g, nh * (nope + vd), kvl)
        sd[a + "o_proj.weight"] = _w(g, h, nh * vd)
        m = p + "mlp."
        if i < c["first_k_dense_replace"]:
            inter = c["intermediate_size"]
            sd[m + "gate_proj.weight"] = _w(g, inter, h)
            sd[m + "up_proj.weight"] = _w(g, inter, h)
            sd[m + "down_proj.weight"] = _w(g, h, inter)
            continue
        sd[m + "gate.weight"] = _w(g, e, h)
        sd[m + "gate.e_score_correction_bias"] = torch.zeros(e, dtype=torch.float32)
        for k in range(e):
            x = f"{m}experts.{k}."
            sd[x + "gate_proj.weight"] = _w(g, mi, h)
            sd[x + "up_proj.weight"] = _w(g, mi, h)
            sd[x + "down_proj.weight"] = _w(g, h, mi)
        sd[m + "shared_experts.gate_proj.weight"] = _w(g, mi, h)
        sd[m + "shared_experts.up_proj.weight"] = _w(g, mi, h)
        sd[m + "shared_experts.down_proj.weight"] = _w(g, h, mi)
    return _save(out, c, sd)


def build_tiny_qwen3(out: Path, seed: int = 0, layers: int = 8) -> Path:
    """A random Qwen3 (GQA with q/k norms, SwiGLU), bf16: a second architecture for the
    hooks, with nothing of DeepSeek's."""
    c = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=4096,
        hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_act="silu",
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=16384,
        attention_bias=False, tie_word_embeddings=False, torch_dtype="bfloat16",
        bos_token_id=0, eos_token_id=1, use_cache=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    h, v, nh, nkv, hd, inter = 256, 4096, 4, 2, 64, 512
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    sd = {"model.embed_tokens.weight": _w(g, v, h), "model.norm.weight": ones(h),
          "lm_head.weight": _w(g, v, h)}  # fmt: skip
    _gqa_layers(sd, g, layers, (h, nh, nkv, hd, inter), ones, qk_norm=True)
    return _save(out, c, sd)


def build_tiny_llama(out: Path, seed: int = 0, layers: int = 8) -> Path:
    """A random Llama (GQA, SwiGLU), bf16, with norm weights that are not all ones: the
    final state before and after the last norm then differ in what a drafter sees, so a
    capture that took the wrong one shows (the audit's third architecture)."""
    c = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096,
        hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_act="silu",
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=16384,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1, use_cache=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    h, v, nh, nkv, hd, inter = 256, 4096, 4, 2, 64, 512

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.5 * torch.randn(n, generator=g)).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": _w(g, v, h), "model.norm.weight": norm(h),
          "lm_head.weight": _w(g, v, h)}  # fmt: skip
    _gqa_layers(sd, g, layers, (h, nh, nkv, hd, inter), norm, qk_norm=False)
    return _save(out, c, sd)


def _gqa_layers(sd: dict, g: torch.Generator, layers: int, dims: tuple, norm, *, qk_norm: bool):
    """The decoder layers Llama and Qwen3 share (GQA attention, SwiGLU MLP), drawn from
    ``g`` in checkpoint order; ``norm(n)`` makes each norm weight, and Qwen3 adds its
    per-head q/k norms."""
    h, nh, nkv, hd, inter = dims
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(h)
        sd[p + "post_attention_layernorm.weight"] = norm(h)
        sd[p + "self_attn.q_proj.weight"] = _w(g, nh * hd, h)
        sd[p + "self_attn.k_proj.weight"] = _w(g, nkv * hd, h)
        sd[p + "self_attn.v_proj.weight"] = _w(g, nkv * hd, h)
        sd[p + "self_attn.o_proj.weight"] = _w(g, h, nh * hd)
        if qk_norm:
            sd[p + "self_attn.q_norm.weight"] = norm(hd)
            sd[p + "self_attn.k_norm.weight"] = norm(hd)
        sd[p + "mlp.gate_proj.weight"] = _w(g, inter, h)
        sd[p + "mlp.up_proj.weight"] = _w(g, inter, h)
        sd[p + "mlp.down_proj.weight"] = _w(g, h, inter)


def _save(out: Path, config: dict, sd: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


def write_records(path: Path, lengths: list[int], vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    recs = []
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            ids = torch.randint(2, vocab, (n,), generator=g).tolist()
            cut = int(torch.randint(0, max(n, 1), (1,), generator=g))
            rec = {"id": f"live-{seed}-{i:04d}", "input_ids": ids,
                   "loss_mask": [0] * cut + [1] * (n - cut)}  # fmt: skip
            f.write(json.dumps(rec) + "\n")
            recs.append(rec)
    return recs


def live_config(workdir: Path, model: Path, inputs: list[str], **overrides: Any) -> Path:
    """A workflow config for engine sglang on this machine's SGLang (this python); no
    ``sglang.version``, so the workflow runs the installed release (:func:`installed_release`)."""
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(
        engine="sglang",
        inputs=inputs,
        output_root=str(workdir / "results"),
        n_chunks=3,
        max_seq_len=512,
        model={"path": str(model), "dtype": "bfloat16", "revision": model.name},
        capture="patch",
    )
    cfg["demo"] = {"enabled": False}
    cfg["server"].update(chunked_prefill_size=64, max_running_requests=8, health_timeout_s=240)
    cfg["client"].update(
        requests_in_flight=8, request_timeout_s=120, piece_timeout_s=30, retries=2, backoff_s=2.0
    )
    cfg["dump"] = {"dir": None, "shm_budget_gb": 4.0}
    # Fail fast: a busy GPU here is a test bug (the fault test waits longer, on purpose).
    cfg["gpu"] = {"max_used_mib": 2000, "wait_s": 10}
    cfg["sglang"] = {
        "python": sys.executable,
        "tp_size": 1,
        "mem_fraction_static": 0.5,
        "extra_args": list(LIVE_EXTRA_ARGS),
        "extra_env": dict(LIVE_ENV),
    }
    for key, value in overrides.items():
        node = cfg
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))
    return workdir / "config.yaml"


def snakemake(workdir: Path, *args: str, timeout: float = 900, env: dict | None = None):
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory",
           str(workdir), "--scheduler", "greedy", *args]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    proc.seconds = time.monotonic() - t0  # type: ignore[attr-defined]
    return proc


def gpu_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return int(out.split()[0])


def hf_states(model_dir: Path, dtype: torch.dtype, records: list[dict]) -> dict[str, list]:
    """Per record id: HF's hidden states -- the stream entering each layer (layer 0: the
    embeddings), then the final post-norm state -- one plain forward per record on the
    GPU, in ``dtype``.

    In a child process: a CUDA context left in the test process would hold GPU memory, and
    the workflow's GPU gate rightly refuses to start a server next to it.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        args = Path(tmp) / "args.pt"
        out = Path(tmp) / "states.pt"
        torch.save({"model": str(model_dir), "dtype": str(dtype), "records": records}, args)
        code = (
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import torch; "
            "from livekit import _hf_states; a = torch.load(sys.argv[1]); "
            "torch.save(_hf_states(a['model'], getattr(torch, a['dtype'].split('.')[-1]), "
            "a['records']), sys.argv[2])"
        )
        subprocess.run([sys.executable, "-c", code, str(args), str(out)], check=True)
        return torch.load(out)


@torch.inference_mode()
def _hf_states(model_dir: Path, dtype: torch.dtype, records: list[dict]) -> dict[str, list]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).cuda().eval()
    layers = int(model.config.num_hidden_layers)
    out = {}
    # The final norm's input: the stream "entering layer L", what prenorm_final captures.
    prenorm: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, a: prenorm.append(a[0]))
    for r in records:
        ids = torch.tensor([r["input_ids"]], device="cuda")
        prenorm.clear()
        res = model.model(ids, output_hidden_states=True)
        hs = res.hidden_states
        assert len(hs) == layers + 1, f"{len(hs)} hidden states for {layers} layers"
        entering = [h[0].float().cpu() for h in hs[:layers]]
        # Index L: the pre-norm state; the last: the final post-norm state.
        out[r["id"]] = [
            *entering,
            prenorm[0][0].float().cpu(),
            res.last_hidden_state[0].float().cpu(),
        ]
    hook.remove()
    del model
    torch.cuda.empty_cache()
    return out


class ErrorTable:
    """Max abs error and relative RMS error per layer, accumulated over records."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, float]] = {}

    def add(self, layer: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        row = self.rows.setdefault(layer, {"max_abs": 0.0, "sq_err": 0.0, "sq_ref": 0.0})
        d = got.float() - ref.float()
        row["max_abs"] = max(row["max_abs"], float(d.abs().max()) if d.numel() else 0.0)
        row["sq_err"] += float(d.pow(2).sum())
        row["sq_ref"] += float(ref.float().pow(2).sum())

    def rel_rms(self, layer: str) -> float:
        r = self.rows[layer]
        return (r["sq_err"] / r["sq_ref"]) ** 0.5 if r["sq_ref"] else 0.0

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {
            k: {"max_abs": v["max_abs"], "rel_rms": self.rel_rms(k)} for k, v in self.rows.items()
        }


def compare_run(
    chunk_files: list[Path], ref32: dict, ref16: dict, records: dict[str, dict], layers: list[int]
) -> tuple[ErrorTable, ErrorTable, int]:
    """SGLang's chunk files vs HF float32, and HF bf16 vs HF float32, per layer; token ids
    and loss masks must be exact.  Returns (sglang table, hf-bf16 table, records seen)."""
    from hsextract.chunks import ChunkReader

    sg, hf16 = ErrorTable(), ErrorTable()
    seen = 0
    for f in chunk_files:
        reader = ChunkReader(f)
        assert reader.aux_layers == layers
        for rec in reader:
            rid = rec["id"]
            src = records[rid]
            assert rec["input_ids"].tolist() == src["input_ids"][: len(rec["input_ids"])], rid
            assert rec["loss_mask"].tolist() == src["loss_mask"][: len(rec["loss_mask"])], rid
            n = rec["input_ids"].shape[0]
            want32, want16 = ref32[rid], ref16[rid]
            h = rec["hidden_states"].shape[1]
            for k, layer in enumerate(layers):
                got = rec["aux_hidden_states"][:, k * h : (k + 1) * h]
                sg.add(f"aux {layer}", got, want32[layer][:n])
                hf16.add(f"aux {layer}", want16[layer][:n], want32[layer][:n])
            sg.add("final", rec["hidden_states"], want32[-1][:n])
            hf16.add("final", want16[-1][:n], want32[-1][:n])
            if reader.prenorm:  # prenorm_final: index L, HF's final-norm input
                at = int(reader.metadata["num_layers"])
                sg.add("prenorm", rec["prenorm_hidden_states"], want32[at][:n])
                hf16.add("prenorm", want16[at][:n], want32[at][:n])
            seen += 1
    return sg, hf16, seen


def table_text(title: str, sg: ErrorTable, hf16: ErrorTable) -> str:
    lines = [
        f"{title}",
        f"{'layer':<8} {'sglang max|d|':>14} {'hf-bf16 max|d|':>15} {'sglang relRMS':>14} "
        f"{'hf-bf16 relRMS':>15} {'ratio':>6}",
    ]
    for layer in sg.rows:
        s, b = sg.as_dict()[layer], hf16.as_dict()[layer]
        ratio = s["rel_rms"] / b["rel_rms"] if b["rel_rms"] else float("inf")
        lines.append(
            f"{layer:<8} {s['max_abs']:>14.4g} {b['max_abs']:>15.4g} {s['rel_rms']:>14.4g} "
            f"{b['rel_rms']:>15.4g} {ratio:>6.2f}"
        )
    return "\n".join(lines)


def out_dir() -> Path:
    d = Path(os.environ.get("OUT") or "/tmp/hsextract-live-out")
    d.mkdir(parents=True, exist_ok=True)
    return d
