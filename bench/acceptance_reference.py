"""The acceptance harness's independent reference: the same records through a plain
HF forward of the same weights, written as each trainer's *own* extraction writes them.

It must not import hsextract (the comparison would be circular); it reads the records
(JSON lines: ``id``, ``input_ids``, ``loss_mask``) and the model directory, nothing else.

Layouts, from the trainers' own sources:

- SpecForge 0.2.0, ``scripts/prepare_hidden_states.py`` (read back by
  ``specforge.data.preprocessing.OfflineEagle3Dataset.process_data``): one ``torch.save``
  dict per record, ``input_ids``/``loss_mask`` int64 [T], ``aux_hidden_state`` [1, T, k*H]
  (the EAGLE-3 aux layers, in order: the residual stream *entering* layers
  ``[2, L//2, L-3]``, i.e. HF ``hidden_states[i]``), ``hidden_state`` [1, T, H] (the last
  layer's output *after* the final norm: HF's last ``hidden_states`` entry).
- speculators 0.9.0, its vLLM hidden-states generator as ``speculators.train.data``'s
  ``ArrowDataset`` reads it: an Arrow dataset (``input_ids``, ``loss_mask``, ``seq_len``
  per row; ``datasets.save_to_disk``) and ``hidden_states/hs_{row}.safetensors`` with
  ``token_ids`` [T] and ``hidden_states`` [T, k+1, H]: the k aux layers, then the last
  layer's output *before* the final norm (``ArrowDataset`` splits off ``[:, -1]`` as
  ``verifier_last_hidden_states``, which the drafter passes through the verifier's norm).

HF's ``output_hidden_states`` has L+1 entries and its last is already normed (the model
applies ``norm`` before appending it), so the pre-norm final state is captured with a
forward hook on the last decoder layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def aux_default(num_layers: int) -> list[int]:
    """SGLang's (and SpecForge's) EAGLE-3 default aux layers."""
    return [2, num_layers // 2, num_layers - 3]


def load_model(model_dir: str | Path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def forward(model, input_ids: list[int], aux: list[int]) -> dict[str, torch.Tensor]:
    """One record's states: aux [T, k*H], post-norm final [T, H], pre-norm final [T, H]."""
    got: dict[str, torch.Tensor] = {}

    def hook(_mod, _inp, out):
        got["prenorm"] = (out[0] if isinstance(out, tuple) else out)[0].detach().clone()

    h = model.model.layers[-1].register_forward_hook(hook)
    try:
        out = model(input_ids=torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        h.remove()
    hs = out.hidden_states
    return {
        "aux": torch.cat([hs[i][0] for i in aux], dim=-1),
        "final": hs[-1][0],
        "prenorm": got["prenorm"],
        "logits": out.logits[0],
    }


def write_specforge(records: list[dict], model, aux: list[int], out: Path) -> list[Path]:
    """prepare_hidden_states.py's files, one per record, in record order."""
    paths = []
    for i, rec in enumerate(records):
        s = forward(model, rec["input_ids"], aux)
        p = out / f"rows_{i // 2000 * 2000}-{i // 2000 * 2000 + 2000}" / f"data_{i}.ckpt"
        p.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "input_ids": torch.tensor(rec["input_ids"], dtype=torch.int64),
                "loss_mask": torch.tensor(rec["loss_mask"], dtype=torch.int64),
                "hidden_state": s["final"].unsqueeze(0).contiguous(),
                "aux_hidden_state": s["aux"].unsqueeze(0).contiguous(),
            },
            p,
        )
        paths.append(p)
    return paths


def write_speculators(records: list[dict], model, aux: list[int], out: Path) -> Path:
    """The Arrow dataset and hs_{row}.safetensors files, rows in record order."""
    from datasets import Dataset
    from safetensors.torch import save_file

    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    h = model.config.hidden_size
    for i, rec in enumerate(records):
        s = forward(model, rec["input_ids"], aux)
        t = len(rec["input_ids"])
        layers = s["aux"].reshape(t, len(aux), h)
        states = torch.cat([layers, s["prenorm"].reshape(t, 1, h)], dim=1).contiguous()
        save_file(
            {
                "token_ids": torch.tensor(rec["input_ids"], dtype=torch.int64),
                "hidden_states": states,
            },
            str(out / "hidden_states" / f"hs_{i}.safetensors"),
        )
    ds = Dataset.from_dict(
        {
            "input_ids": [r["input_ids"] for r in records],
            "loss_mask": [r["loss_mask"] for r in records],
            "seq_len": [len(r["input_ids"]) for r in records],
        }
    )
    ds.set_format(type="torch")  # ArrowDataset's rows are torch tensors (it .tolist()s them)
    ds.save_to_disk(str(out))
    return out


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
