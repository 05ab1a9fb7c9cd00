"""Does the data train a drafter?  EAGLE-3 drafters trained on hsextract's states accept
as many tokens as drafters trained on an independent reference; corrupted data does not.

The pipeline (docs/acceptance.md):

1. the committed target (tests/data/acceptance_target/, bench/acceptance_target.py);
2. records as drafter data is made: prompts of the target's language plus the target's own
   greedy continuations, the loss mask on the continuation;
3. extraction by the workflow (Snakemake, reference engine on the CPU, ``prenorm_final``,
   a stream budget so the journal is written), read three ways: the SpecForge export,
   the speculators export, and the stream (``hsextract.stream``);
4. the reference: the same records through a plain HF forward of the same weights, laid
   out as each trainer's own extraction lays them out (bench/acceptance_reference.py,
   which imports nothing of hsextract);
5. drafters trained with each trainer's own model and loss (SpecForge 0.2.0's
   ``OnlineEagle3Model`` + ``Eagle3TrainStrategy``; speculators 0.9.0's ``Eagle3DraftModel``
   with its ``kl_div`` loss), same seed, same steps, same record order, from each source;
6. acceptance on held-out prompts, two ways: the trainers' own teacher-forced figures
   (SpecForge's ``Evaluator`` ``simulated_acc_len``: sum of products of marginal
   accuracies, no bonus token; speculators: 1 + sum of ``full_acc_k``, the bonus token
   counted), and greedy speculative decoding written here (k draft tokens, the target
   verifying; mean tokens per verify step, the bonus token counted);
7. negative controls: the reference's data corrupted (states shifted by one position,
   aux layers permuted, the other final-norm convention, the loss mask shifted by one),
   first measured for what the drafter sees, then trained on and evaluated on true data.

CPU-only substitutions (the issue's): SpecForge's ``LogSoftmaxLoss`` (a Triton kernel) is
replaced by ``specforge.core.loss._compute_loss``, its own reference formula; speculators
runs with eager attention and its eager loss.  ``torch.compile`` is off (its wrappers on
SpecForge's helpers would build C++ kernels on a CPU; the code they run is unchanged).

``python bench/acceptance.py`` runs the full matrix and prints the table;
tests/test_acceptance.py runs the CI subset through the same functions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

import acceptance_reference as reference  # noqa: E402
import acceptance_target as target_lang  # noqa: E402

TARGET = Path(
    os.environ.get("HSX_ACCEPTANCE_TARGET", REPO / "tests" / "data" / "acceptance_target")
)
CONTROLS = ("shift", "permute", "norm", "mask")
Sample = dict[str, torch.Tensor]


@dataclass
class Sizes:
    n_train: int = 64
    n_eval: int = 16
    prompt_len: int = 16
    cont_len: int = 32
    steps: int = 200
    batch: int = 4
    lr: float = 3e-3
    ttt: int = 3  # TTT length in training = draft tokens k in decoding
    draft_intermediate: int = 128


def _specforge_reference_loss():
    """SpecForge's ``core/loss.py`` with its Triton kernel replaced by the file's own
    reference formula, ``_compute_loss`` (the kernel's forward computes the same
    -mean over (B, T) of sum(mask * p * log_softmax(logits))).  The module imports
    triton at its top, which a CPU machine lacks, so the function's source is taken from
    the installed file itself (its decorator, torch.compile, dropped) and bound in a
    module registered under that name."""
    import ast
    import importlib.util
    import types

    spec = importlib.util.find_spec("specforge")
    path = Path(spec.origin).parent / "core" / "loss.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_compute_loss")
    fn.decorator_list = []
    mod = types.ModuleType("specforge.core.loss")
    mod.__file__ = str(path)
    mod.torch, mod.nn = torch, torch.nn
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), mod.__dict__)

    class LogSoftmaxLoss:
        """``LogSoftmaxLoss.apply`` as the TTT loop calls it, through the formula."""

        @staticmethod
        def apply(logits, target_p, position_mask):
            return mod._compute_loss(logits, target_p, position_mask)

    mod.LogSoftmaxLoss = LogSoftmaxLoss
    return mod


def setup_cpu() -> None:
    """The CPU substitutions above, applied to the trainers' modules (idempotent)."""
    import torch._dynamo

    torch._dynamo.config.disable = True
    if "specforge.core.loss" not in sys.modules:
        sys.modules["specforge.core.loss"] = _specforge_reference_loss()


# -- records --------------------------------------------------------------------------


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """The target's greedy continuation of each prompt, ``[B, n]``."""
    out = model(input_ids=prompts, use_cache=True)
    pkv, nxt, got = out.past_key_values, out.logits[:, -1].argmax(-1), []
    for _ in range(n):
        got.append(nxt)
        out = model(input_ids=nxt[:, None], past_key_values=pkv, use_cache=True)
        pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
    return torch.stack(got, 1)


def make_records(model, n: int, sizes: Sizes, seed: int, prefix: str) -> list[dict]:
    prompts = target_lang.sample(n, sizes.prompt_len, seed=seed)
    cont = greedy(model, prompts, sizes.cont_len)
    recs = []
    for i in range(n):
        ids = prompts[i].tolist() + cont[i].tolist()
        mask = [0] * sizes.prompt_len + [1] * sizes.cont_len
        recs.append({"id": f"{prefix}{i:04d}", "input_ids": ids, "loss_mask": mask})
    return recs


def write_jsonl(recs: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


# -- extraction by the workflow -------------------------------------------------------


def workflow_config(records: Path, root: Path, codec: str, max_seq_len: int) -> dict:
    import yaml

    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg.update(
        {
            "inputs": [str(records)],
            "output_root": str(root / "out"),
            "n_chunks": 2,
            "max_seq_len": max_seq_len,
            "prenorm_final": True,
            "seed": 0,
        }
    )
    cfg["demo"]["enabled"] = False
    cfg["model"] = {"path": str(TARGET), "dtype": "float32", "revision": "acceptance-v1"}
    cfg["storage"] = {"codec": codec}
    cfg["server"]["chunked_prefill_size"] = 64  # extend passes with a prefix, as SGLang's
    cfg["dump"] = {"dir": str(root / "dump"), "shm_budget_gb": 0.5}
    # A budget far above the run: nothing waits, but every chunk is announced in the
    # journal the stream readers follow.
    cfg["stream"] = {"budget_gb": 50.0}
    return cfg


def extract(records: Path, root: Path, codec: str = "none", max_seq_len: int = 64) -> Path:
    """``snakemake -j1 extract_all`` on the records, then ``hsextract export specforge`` and
    ``hsextract export speculators`` on its manifest; returns the run dir.  (Under a
    stream budget a chunk's Snakemake target is its receipt, so the export rules, which
    take chunk files as inputs, do not plan: the CLI exports the finished run.)"""
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(
        yaml.safe_dump(workflow_config(records, root, codec, max_seq_len))
    )
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "Snakefile"),
        "--directory",
        str(root),
        "-j1",
        "extract_all",
    ]
    _run(cmd, root)
    out = _run(
        [sys.executable, "-m", "hsextract.cli", "run-dir", "--configfile", "config.yaml"], root
    )
    rd = root / out.strip()
    for fmt in ("specforge", "speculators"):
        _run(
            [
                sys.executable,
                "-m",
                "hsextract.cli",
                "export",
                fmt,
                "--manifest",
                str(rd / "manifest.json"),
            ],
            root,
        )
    return rd


def _run(cmd: list[str], cwd: Path) -> str:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p.stdout


def train_ids(run_dir: Path) -> list[str]:
    """Record ids by their line in merged/train.jsonl (the exports' file index)."""
    lines = (run_dir / "merged" / "train.jsonl").read_text().splitlines()
    return [json.loads(line)["id"] for line in lines]


# -- the sources, read by each trainer's own reader -----------------------------------


def specforge_from_files(root: Path, ids: list[str], max_len: int) -> dict[str, Sample]:
    """SpecForge's ``build_offline_eagle3_dataset`` over a directory of ``data_{i}.ckpt``
    (its normalizer applied); ``ids[i]`` is the record of file ``i``."""
    from specforge.data.preprocessing import build_offline_eagle3_dataset

    ds = build_offline_eagle3_dataset(str(root), max_len=max_len)
    out = {}
    for k, path in enumerate(ds.datapaths):
        idx = int(Path(path).name.split("_")[1].split(".")[0])
        out[ids[idx]] = ds[k]
    return out


def specforge_from_stream(run_dir: Path, max_len: int) -> dict[str, Sample]:
    from hsextract.stream.specforge import SpecForgeStreamDataset

    out = {}
    for s in SpecForgeStreamDataset(run_dir, max_len=max_len, seed=0, timeout_s=120):
        if not s["pad"]:
            out[s["id"]] = {k: v for k, v in s.items() if k not in ("pad", "seq", "id")}
    return out


def speculators_from_files(root: Path, ids: list[str], max_len: int) -> dict[str, Sample]:
    """speculators' ``ArrowDataset`` (rows = ``ids`` order), ``shift_batch`` applied."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset

    ds = ArrowDataset(
        max_len=max_len, datapath=str(root), on_missing="raise", hidden_states_dtype=torch.float32
    )
    return {ids[i]: shift_batch(ds[i]) for i in range(len(ds))}


def speculators_from_stream(run_dir: Path, max_len: int) -> dict[str, Sample]:
    """The stream's ``StreamSpeculatorsDataset`` (speculators' ``BaseDataset``), every
    announced chunk's every record, ``shift_batch`` applied."""
    from speculators.models.eagle3.data import shift_batch

    from hsextract.chunks import ChunkReader
    from hsextract.stream.journal import read_state
    from hsextract.stream.reader import stream_dir
    from hsextract.stream.speculators import StreamSpeculatorsDataset

    ds = StreamSpeculatorsDataset(run_dir, max_len, hidden_states_dtype=torch.float32)
    out = {}
    for seq, line in sorted(read_state(stream_dir(run_dir)).chunks.items()):
        rids = ChunkReader(run_dir / line["path"]).record_ids
        for j, rid in enumerate(rids):
            out[rid] = shift_batch(ds[(seq, j)])
    return out


# -- negative controls (applied to one trainer's samples) -----------------------------


def _shift_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Row p holds row p-1 (row 0 repeated): a capture off by one position."""
    idx = torch.arange(t.shape[dim]).sub(1).clamp(min=0)
    return t.index_select(dim, idx)


def _permute_aux(t: torch.Tensor, k: int = 3) -> torch.Tensor:
    h = t.shape[-1] // k
    parts = t.split(h, dim=-1)
    return torch.cat([parts[(i + 1) % k] for i in range(k)], dim=-1)


def _shift_mask(m: torch.Tensor, dim: int) -> torch.Tensor:
    out = _shift_rows(m, dim).clone()
    out.select(dim, 0).zero_()
    return out


def corrupt_specforge(s: Sample, what: str, other_final: torch.Tensor) -> Sample:
    """``other_final``: the record's pre-norm final state [T, H] (SpecForge's target is
    the post-norm one)."""
    s = dict(s)
    if what == "shift":
        s["hidden_state"] = _shift_rows(s["hidden_state"], 1)
        s["target"] = _shift_rows(s["target"], 1)
    elif what == "permute":
        s["hidden_state"] = _permute_aux(s["hidden_state"])
    elif what == "norm":
        s["target"] = other_final[: s["target"].shape[1]].unsqueeze(0)
    elif what == "mask":
        s["loss_mask"] = _shift_mask(s["loss_mask"], 1)
    return s


def corrupt_speculators(s: Sample, what: str, other_final: torch.Tensor) -> Sample:
    """On the shifted sample (``shift_batch``: row t holds g_t, y_{t+1}, x_{t+1});
    ``other_final``: the record's post-norm final state [T, H] (speculators' is pre-norm)."""
    s = dict(s)
    if what == "shift":
        s["hidden_states"] = _shift_rows(s["hidden_states"], 0)
        s["verifier_last_hidden_states"] = _shift_rows(s["verifier_last_hidden_states"], 0)
    elif what == "permute":
        s["hidden_states"] = _permute_aux(s["hidden_states"])
    elif what == "norm":
        s["verifier_last_hidden_states"] = other_final[1:]
    elif what == "mask":
        s["loss_mask"] = _shift_mask(s["loss_mask"], 0)
    return s


# -- the trainers ---------------------------------------------------------------------


def _target_weights() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(TARGET / "model.safetensors"))


def _draft_llama_config(sizes: Sizes, cfg):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=sizes.draft_intermediate,
        num_hidden_layers=1,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=256,
        rms_norm_eps=cfg.rms_norm_eps,
    )


class SpecForgeTrainer:
    """SpecForge 0.2.0: ``LlamaForCausalLMEagle3`` (embedding loaded from the target and
    frozen, as its trainer does), ``OnlineEagle3Model`` (TTT), ``Eagle3TrainStrategy`` with
    the offline ``TargetHead`` (the LM head re-run over the stored final state)."""

    name = "specforge"

    def __init__(self, sizes: Sizes, seed: int) -> None:
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from specforge.modeling.target.target_head import TargetHead
        from specforge.training.strategies.base import Eagle3TrainStrategy
        from transformers import AutoConfig

        tcfg = AutoConfig.from_pretrained(str(TARGET))
        dcfg = _draft_llama_config(sizes, tcfg)
        dcfg.draft_vocab_size = tcfg.vocab_size
        torch.manual_seed(seed)
        self.draft = LlamaForCausalLMEagle3(dcfg, attention_backend="sdpa")
        self.draft.load_embedding(str(TARGET))
        self.draft.freeze_embedding()
        self.model = OnlineEagle3Model(self.draft, length=sizes.ttt, attention_backend="sdpa")
        head = TargetHead(str(TARGET))
        head.load_weights(str(TARGET))
        head.freeze_weights()
        self.head = head.eval()
        self.strategy = Eagle3TrainStrategy(self.model, target_head=self.head)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=sizes.lr)

    def batch(self, samples: list[Sample], ids: list[str]):
        from specforge.algorithms.eagle3.data import build_offline_collator
        from specforge.runtime.contracts import TrainBatch

        tensors = build_offline_collator()(samples)
        return TrainBatch(
            sample_ids=ids,
            strategy="eagle3",
            tensors=tensors,
            metadata={"target_repr": "hidden_state"},
        )

    def step(self, samples: list[Sample], ids: list[str]) -> float:
        self.model.train()
        out = self.strategy.forward_loss(self.batch(samples, ids))
        self.opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)
        self.opt.step()
        return float(out.loss)

    def teacher_forced(self, samples: list[Sample], ids: list[str]) -> dict[str, Any]:
        """SpecForge's ``Evaluator``: ``simulated_acc_len`` over the eval set."""
        from specforge.eval.evaluator import Evaluator

        self.model.eval()
        batches = [self.batch([s], [i]) for s, i in zip(samples, ids, strict=True)]
        m = Evaluator().run(self.strategy.forward_loss, batches)
        return {
            "specforge_simulated_acc_len": m["eval/simulated_acc_len"],
            "per_position_acc": m["eval/per_position_acc"],
        }

    @torch.no_grad()
    def propose(self, aux: torch.Tensor, ids: list[int], k: int) -> list[int]:
        """k draft tokens after the last position: ``aux`` [t+1, 3H] the target's aux
        states of positions 0..t, ``ids`` x_1..x_{t+1}.  The steps of
        ``OnlineEagle3Model.forward`` (embed, backbone with its TTT cache, logits), with
        the drafter's own token fed at the last position instead of the teacher's."""
        d = self.draft
        d.eval()
        hs = d.project_hidden_states(aux[None])
        n = hs.shape[1]
        mask = d.prepare_decoder_attention_mask(
            attention_mask=torch.ones(1, n, dtype=torch.bool),
            hidden_states=hs,
            batch_size=1,
            seq_length=n,
            past_key_values_length=0,
        )
        pos = torch.arange(n)[None]
        x = torch.tensor([ids])
        cache: list[list] = [[], []]
        out = []
        for _ in range(k):
            emb = d.embed_input_ids(x).to(hs.dtype)
            hs = d.backbone(
                input_embeds=emb,
                hidden_states=hs,
                cache_hidden=cache,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=None,
                use_cache=True,
            )
            tok = int(d.compute_logits(hs)[0, -1].argmax())
            tok = tok + int(d.d2t[tok])
            out.append(tok)
            x = torch.cat([x[:, 1:], torch.tensor([[tok]])], dim=1)
        return out


class SpeculatorsTrainer:
    """speculators 0.9.0: ``Eagle3DraftModel`` (eager attention), embedding, verifier norm
    and LM head copied from the target (what its ``load_verifier_weights`` loads), its
    ``kl_div`` loss (eager), batches packed by its ``CollateFn``."""

    name = "speculators"

    def __init__(self, sizes: Sizes, seed: int) -> None:
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.losses import resolve_loss_config
        from speculators.models.eagle3 import Eagle3SpeculatorConfig
        from speculators.models.eagle3.core import Eagle3DraftModel
        from speculators.proposals.greedy import GreedyTokenProposalConfig
        from transformers import AutoConfig

        tcfg = AutoConfig.from_pretrained(str(TARGET))
        self.sizes, self.h = sizes, tcfg.hidden_size
        tl = _draft_llama_config(sizes, tcfg)
        tl._attn_implementation = "eager"
        cfg = Eagle3SpeculatorConfig(
            transformer_layer_config=tl,
            draft_vocab_size=tcfg.vocab_size,
            norm_before_residual=True,
            eagle_aux_hidden_state_layer_ids=reference.aux_default(tcfg.num_hidden_layers),
            speculators_config=SpeculatorsConfig(
                algorithm="eagle3",
                default_proposal_method="greedy",
                proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=sizes.ttt)],
                verifier=VerifierConfig.from_config(tl, name_or_path=None),
            ),
        )
        torch.manual_seed(seed)
        m = Eagle3DraftModel(cfg)
        with torch.no_grad():  # its constructor leaves weights uninitialised (post_init off)
            for p in m.parameters():
                p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
            w = _target_weights()
            m.embed_tokens.weight.copy_(w["model.embed_tokens.weight"])
            m.verifier_lm_head.weight.copy_(w["lm_head.weight"])
            m.verifier_norm.weight.copy_(w["model.norm.weight"])
        self.model = m
        self.loss_config = resolve_loss_config("kl_div", "eager")
        params = [p for p in m.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=sizes.lr)

    def batch(self, samples: list[Sample]) -> dict:
        from speculators.train.data import CollateFn

        n = sum(int(s["lengths"].sum()) for s in samples)
        b = CollateFn(n, self.h, 3, torch.float32)(samples)
        b.pop("error_records", None)
        return b

    def _forward(self, b: dict):
        return self.model(
            hidden_states=b["hidden_states"],
            input_ids=b["input_ids"],
            document_ids=b["document_ids"],
            loss_mask=b["loss_mask"],
            position_ids=b["position_ids"],
            verifier_last_hidden_states=b["verifier_last_hidden_states"],
            ttt_steps=self.sizes.ttt,
            ttt_step_loss_decay=1.0,
            loss_config=self.loss_config,
        )

    def step(self, samples: list[Sample], ids: list[str]) -> float:
        self.model.train()
        _, loss, _ = self._forward(self.batch(samples))
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)
        self.opt.step()
        return float(loss)

    @torch.no_grad()
    def teacher_forced(self, samples: list[Sample], ids: list[str]) -> dict[str, Any]:
        """speculators' EAGLE-3 metrics: 1 + sum over steps of full_acc_k (eval-set sums)."""
        self.model.eval()
        sums = [0.0] * self.sizes.ttt
        tots = [0.0] * self.sizes.ttt
        for s in samples:
            _, _, m = self._forward(self.batch([s]))
            for k in range(self.sizes.ttt):
                sums[k] += float(m[f"full_acc_{k}_sum"])
                tots[k] += float(m[f"full_acc_{k}_total"])
        full = [a / max(b, 1.0) for a, b in zip(sums, tots, strict=True)]
        return {"speculators_1_plus_full_acc": 1 + sum(full), "full_acc": full}

    @torch.no_grad()
    def propose(self, aux: torch.Tensor, ids: list[int], k: int) -> list[int]:
        """k draft tokens after the last position through ``Eagle3DraftModel.forward``
        itself: its TTT step j reads input ids shifted by j, so each round appends the
        drafts so far (rows past the last position only feed the last one's later steps,
        masked causally) and reads step j's token at the last real position."""
        self.model.eval()
        n = aux.shape[0]
        drafts: list[int] = []
        for j in range(k):
            x = torch.tensor([ids + drafts])
            hs = torch.cat([aux, aux.new_zeros(len(drafts), aux.shape[1])])[None]
            toks = self.model(
                hidden_states=hs,
                input_ids=x,
                document_ids=torch.zeros_like(x),
                position_ids=1 + torch.arange(x.shape[1])[None],
                ttt_steps=j + 1,
            )
            drafts.append(int(toks[j][0, n - 1]))
        return drafts


TRAINERS: dict[str, type] = {"specforge": SpecForgeTrainer, "speculators": SpeculatorsTrainer}


def order(ids: list[str], sizes: Sizes, seed: int) -> list[list[str]]:
    """The batches of a run: seeded shuffles of the training ids, ``steps`` of them."""
    rng = random.Random(seed)
    out: list[list[str]] = []
    while len(out) < sizes.steps:
        perm = sorted(ids)
        rng.shuffle(perm)
        out += [
            perm[i : i + sizes.batch] for i in range(0, len(perm) - sizes.batch + 1, sizes.batch)
        ]
    return out[: sizes.steps]


def train(kind: str, data: dict[str, Sample], sizes: Sizes, seed: int):
    t = TRAINERS[kind](sizes, seed)
    losses = [t.step([data[i] for i in b], b) for b in order(list(data), sizes, seed)]
    t.losses = losses
    return t


# -- greedy speculative decoding ------------------------------------------------------


@torch.no_grad()
def speculative_decoding(
    drafter, model, prompts: list[list[int]], n_new: int, k: int, aux_layers: list[int]
) -> float:
    """Mean tokens per target verify step (accepted drafts + the target's own token), over
    ``prompts``, each decoded greedily until ``n_new`` tokens past its first."""
    steps = made = 0
    for prompt in prompts:
        seq = list(prompt)
        out = model(input_ids=torch.tensor([seq]), output_hidden_states=True)
        seq.append(int(out.logits[0, -1].argmax()))
        hs = out.hidden_states
        aux = torch.cat([hs[i][0] for i in aux_layers], -1)  # positions 0..len-2
        start = len(seq)
        while len(seq) - start < n_new:
            drafts = drafter.propose(aux, seq[1:], k)
            out = model(input_ids=torch.tensor([seq + drafts]), output_hidden_states=True)
            pred = out.logits[0, len(seq) - 1 :].argmax(-1).tolist()  # k + 1 target tokens
            a = 0
            while a < k and drafts[a] == pred[a]:
                a += 1
            seq += drafts[:a] + [pred[a]]
            steps += 1
            made += a + 1
            hs = out.hidden_states
            aux = torch.cat([hs[i][0, : len(seq) - 1] for i in aux_layers], -1)
    return made / steps


# -- what the drafter sees: the corruption measured -----------------------------------


@torch.no_grad()
def corruption_effect(
    what: str,
    ref_sf: dict[str, Sample],
    prenorm: dict[str, torch.Tensor],
    head: Callable,
    norm: Callable,
    eval_ids: list[str],
) -> dict[str, Any]:
    """On held-out records, SpecForge's layout: for the teacher side, the fraction of
    continuation positions whose teacher top-1 changes; for the input side, the relative
    L2 change of the aux input (permute) or the fraction of trained positions that change
    (mask)."""
    changed = total = 0.0
    for rid in eval_ids:
        s = ref_sf[rid]
        m = s["loss_mask"][0].bool()
        c = corrupt_specforge(s, what, prenorm[rid])
        if what in ("shift", "norm"):
            a = head(s["target"][0]).argmax(-1)
            b = head(c["target"][0]).argmax(-1)
            changed += float((a != b)[m].sum())
            total += float(m.sum())
        elif what == "permute":
            changed += float((c["hidden_state"] - s["hidden_state"]).norm() ** 2)
            total += float(s["hidden_state"].norm() ** 2)
        else:
            cm = c["loss_mask"][0].bool()
            changed += float((cm ^ m).sum())
            total += float(m.sum())
    frac = changed / total if what != "permute" else (changed / total) ** 0.5
    measure = {
        "shift": "teacher top-1 changed",
        "norm": "teacher top-1 changed",
        "permute": "relative L2 change of the aux input",
        "mask": "trained positions changed / masked",
    }[what]
    return {"control": what, "measure": measure, "value": frac}


# -- the harness ----------------------------------------------------------------------


@dataclass
class Harness:
    """What the matrix shares: the target, the records, one extraction per codec, the
    reference, each source's samples per trainer."""

    root: Path
    sizes: Sizes = field(default_factory=Sizes)
    log: Callable[[str], None] = print

    def __post_init__(self) -> None:
        setup_cpu()
        torch.set_num_threads(1)
        self.model = reference.load_model(TARGET)
        cfg = self.model.config
        self.aux = reference.aux_default(cfg.num_hidden_layers)
        self.max_len = self.sizes.prompt_len + self.sizes.cont_len
        self.train_recs = make_records(self.model, self.sizes.n_train, self.sizes, 5000, "r")
        self.eval_recs = make_records(self.model, self.sizes.n_eval, self.sizes, 9000, "e")
        self.records = write_jsonl(self.train_recs, self.root / "records" / "train.jsonl")
        self.runs: dict[str, Path] = {}
        self.data: dict[tuple[str, str], dict[str, Sample]] = {}
        self.timings: dict[str, float] = {}
        self.cells: dict[tuple, dict[str, Any]] = {}

    def timed(self, what: str, fn: Callable, *a, **k):
        t0 = time.monotonic()
        try:
            return fn(*a, **k)
        finally:
            self.timings[what] = self.timings.get(what, 0.0) + time.monotonic() - t0

    def run(self, codec: str = "none") -> Path:
        if codec not in self.runs:
            self.runs[codec] = self.timed(
                f"extract {codec}",
                extract,
                self.records,
                self.root / f"wf-{codec}",
                codec,
                self.max_len,
            )
        return self.runs[codec]

    def reference_dirs(self) -> dict[str, Path]:
        d = {
            "specforge": self.root / "ref" / "specforge",
            "speculators": self.root / "ref" / "speculators",
        }
        if not d["specforge"].exists():

            def go():
                for name, recs in (("train", self.train_recs), ("eval", self.eval_recs)):
                    reference.write_specforge(recs, self.model, self.aux, d["specforge"] / name)
                    reference.write_speculators(recs, self.model, self.aux, d["speculators"] / name)

            self.timed("reference", go)
        return d

    def samples(self, kind: str, source: str, codec: str = "none") -> dict[str, Sample]:
        """``source``: reference | eval (the reference's held-out records) | export | stream."""
        key = (kind, f"{source}:{codec}")
        if key in self.data:
            return self.data[key]
        if source in ("reference", "eval"):
            recs = self.train_recs if source == "reference" else self.eval_recs
            sub = "train" if source == "reference" else "eval"
            root = self.reference_dirs()[kind] / sub
            ids = [r["id"] for r in recs]
            read = specforge_from_files if kind == "specforge" else speculators_from_files
            got = read(root, ids, self.max_len)
        else:
            rd = self.run(codec)
            if source == "export":
                ids = train_ids(rd)
                if kind == "specforge":
                    got = specforge_from_files(rd / "export" / "specforge", ids, self.max_len)
                else:
                    got = speculators_from_files(rd / "export" / "speculators", ids, self.max_len)
            else:
                fn = specforge_from_stream if kind == "specforge" else speculators_from_stream
                got = self.timed(f"stream read {kind}", fn, rd, self.max_len)
        self.data[key] = got
        return got

    @torch.no_grad()
    def prenorm(self, kind: str, recs: list[dict]) -> dict[str, torch.Tensor]:
        """The other final-norm convention per record: SpecForge gets pre-norm states,
        speculators post-norm ones (from a plain HF forward, as the reference)."""
        want = "prenorm" if kind == "specforge" else "final"
        return {
            r["id"]: reference.forward(self.model, r["input_ids"], self.aux)[want] for r in recs
        }

    def evaluate(self, t, decode: bool = True) -> dict[str, Any]:
        ev = self.samples(t.name, "eval")
        ids = [r["id"] for r in self.eval_recs]
        res = t.teacher_forced([ev[i] for i in ids], ids)
        if decode:
            prompts = [r["input_ids"][: self.sizes.prompt_len] for r in self.eval_recs]
            res["spec_decode_accept_len"] = self.timed(
                "decode",
                speculative_decoding,
                t,
                self.model,
                prompts,
                self.sizes.cont_len - 1,
                self.sizes.ttt,
                self.aux,
            )
        return res

    def cell(
        self,
        kind: str,
        source: str,
        seed: int = 0,
        codec: str = "none",
        control: str | None = None,
        decode: bool = True,
    ) -> dict[str, Any]:
        key = (kind, source, seed, codec, control, decode)
        if key in self.cells:
            return self.cells[key]
        data = self.samples(kind, source, codec)
        if control is not None:
            other = self.prenorm(kind, self.train_recs)
            corrupt = corrupt_specforge if kind == "specforge" else corrupt_speculators
            data = {i: corrupt(s, control, other[i]) for i, s in data.items()}
        t0 = time.monotonic()
        t = self.timed(f"train {kind}", train, kind, data, self.sizes, seed)
        res = self.evaluate(t, decode)
        res.update(
            {
                "trainer": kind,
                "source": source,
                "codec": codec,
                "seed": seed,
                "control": control,
                "loss_first": t.losses[0],
                "loss_last": t.losses[-1],
                "seconds": round(time.monotonic() - t0, 1),
            }
        )
        self.log(
            json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()})
        )
        self.cells[key] = res
        return res

    def effects(self) -> list[dict[str, Any]]:
        from specforge.modeling.target.target_head import TargetHead

        head = TargetHead(str(TARGET))
        head.load_weights(str(TARGET))
        ev = self.samples("specforge", "eval")
        pre = self.prenorm("specforge", self.eval_recs)
        ids = [r["id"] for r in self.eval_recs]
        return [corruption_effect(c, ev, pre, head, self.model.model.norm, ids) for c in CONTROLS]


TF = {"specforge": "specforge_simulated_acc_len", "speculators": "speculators_1_plus_full_acc"}


def metric_of(kind: str) -> str:
    return TF[kind]


def summary(rows: list[dict], kind: str, metric: str) -> tuple[float, float]:
    vals = [r[metric] for r in rows]
    return statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--root", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "hsx-acceptance"
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=Sizes.steps)
    p.add_argument("--trainers", default="specforge,speculators")
    p.add_argument("--codecs", default="none,lossless,fp8")
    p.add_argument("--out", type=Path, help="write every cell as JSON lines here")
    args = p.parse_args()
    h = Harness(args.root, Sizes(steps=args.steps))
    rows: list[dict] = []
    for c in h.effects():
        print(json.dumps(c))
    for kind in args.trainers.split(","):
        for seed in range(args.seeds):
            rows.append(h.cell(kind, "reference", seed))
        for codec in args.codecs.split(","):
            rows.append(h.cell(kind, "export", 0, codec))
        rows.append(h.cell(kind, "stream", 0))
        for c in CONTROLS:
            rows.append(h.cell(kind, "reference", 0, control=c))
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"timings_s": {k: round(v, 1) for k, v in h.timings.items()}}))


if __name__ == "__main__":
    main()
