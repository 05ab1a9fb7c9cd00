"""The acceptance harness's target: a tiny Llama trained briefly on a seeded synthetic
language, committed as tests/data/acceptance_target/ (rebuild: ``python
bench/acceptance_target.py``; ~1 minute on 2 cores).

Random weights make acceptance meaningless (nothing to learn), so the target is trained
until its next token is predictable.  The language: a sequence opens with a mode token
``m`` in ``[0, MODES)``; each later token follows ``T[m][prev]`` with probability
``P_RULE``, else is uniform over the word tokens.  What comes next thus depends on the
current token *and* on a mode set far back, which the target's hidden states carry and
the drafter's one layer must otherwise dig out of its own context: the states matter.

The final RMSNorm weight is set far from uniform (log-normal) and kept there, so the
post-norm state and the pre-norm one give different top-1 tokens through the LM head
(the final-norm control needs that).  Saved as safetensors with an index (SpecForge's
``TargetHead`` reads the LM head through ``*.index.json``).

This file must not import hsextract: the reference extraction loads what it writes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "data" / "acceptance_target"

VOCAB, MODES, P_RULE, SEED = 256, 8, 0.85, 0
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


def rules(seed: int = SEED) -> torch.Tensor:
    """``T[m, tok]``: the likely successor of ``tok`` in mode ``m`` (a word token)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(MODES, VOCAB, (MODES, VOCAB), generator=g)


def sample(n: int, length: int, seed: int, table: torch.Tensor | None = None) -> torch.Tensor:
    """``n`` sequences of the language, ``[n, length]`` int64."""
    table = rules() if table is None else table
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, length, dtype=torch.int64)
    x[:, 0] = torch.randint(0, MODES, (n,), generator=g)
    x[:, 1] = torch.randint(MODES, VOCAB, (n,), generator=g)
    for t in range(2, length):
        follow = table[x[:, 0], x[:, t - 1]]
        noise = torch.randint(MODES, VOCAB, (n,), generator=g)
        keep = torch.rand(n, generator=g) < P_RULE
        x[:, t] = torch.where(keep, follow, noise)
    return x


def config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        **SHAPE,
    )


def build(out: Path = OUT, steps: int = 600, seed: int = SEED) -> dict:
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config())
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # non-uniform and frozen: the two conventions must differ
        w = torch.exp(torch.randn(SHAPE["hidden_size"], generator=g) * 0.8)
        model.model.norm.weight.copy_(w)
    model.model.norm.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    table = rules(seed)
    t0 = time.monotonic()
    for step in range(steps):
        x = sample(32, 64, seed=1000 + step, table=table)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.3f} ({time.monotonic() - t0:.0f} s)", flush=True)
    model.eval()
    x = sample(64, 64, seed=99, table=table)
    with torch.no_grad():
        pred = model(input_ids=x).logits[:, 1:-1].argmax(-1)
    rule = table[x[:, :1].expand(-1, 62), x[:, 1:-1]]
    acc = (pred == rule).float().mean().item()
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
        "weight_map": {k: "model.safetensors" for k in sd},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    info = {
        "final_loss": round(loss.item(), 4),
        "rule_top1": round(acc, 4),
        "steps": steps,
        "seed": seed,
        "vocab": VOCAB,
        "modes": MODES,
        "p_rule": P_RULE,
        **SHAPE,
        "params": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.monotonic() - t0, 1),
    }
    (out / "target_info.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--steps", type=int, default=600)
    args = p.parse_args()
    print(json.dumps(build(args.out, args.steps)))


if __name__ == "__main__":
    main()
