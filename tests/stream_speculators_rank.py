"""One rank of speculators' own ``Trainer`` reading a run in progress (issue 39, item 6).

The body both of its tests run, so what CI checks of the GPU test's ranks is this code:
tests/test_stream_trainers.py calls :func:`start_rank` in its own process (world 1, on the
CPU), and tests/live/test_stream_ddp_live.py starts this file under torchrun (world 2, one
GPU a rank, speculators' own ``maybe_setup_distributed``: NCCL)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/stream_speculators_rank.py --run-dir R --out O --log-dir L [--resume]

A rank builds speculators' loader over the stream (``speculators_loader``), its EAGLE-3
draft model (tiny) and its ``Trainer``, attaches ``AckOnCheckpoint`` and runs
``Trainer.run_training``.  What the tests assert on, it writes as it goes (one JSON line
each, flushed, so a rank SIGKILLed leaves what it did):

- ``batches.<rank>.jsonl``: every batch its sampler handed out, numbered in the pass
  (batch ``n`` is trained at the epoch's local step ``n``; the loader prefetches, so the
  last lines of a killed rank may not have been trained);
- ``acks.checked.jsonl`` (rank 0): each ack, once the Trainer's checkpoint of that very
  step was found on disk (``training_state.json``, the sampler state, the weights) --
  an assertion fails the rank otherwise;
- ``result.<rank>.json`` once ``run_training`` trained the whole pass: the steps, whether
  the weights moved and are finite, and a digest of them (DDP keeps ranks equal).

``--die-at-step S --die-rank R``: rank R SIGKILLs itself after step S's optimizer step,
before the Trainer decides to checkpoint it (so that step is trained and not committed).
``--cpu``: the ranks on the CPU over gloo (a check of this harness where no GPU is;
speculators' own set-up needs an accelerator), with :func:`speculators_on_cpu`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hsextract.stream import journal
from tests.test_stream import H, K  # write_chunk's hidden size and aux layers

V = 64  # the tiny models' vocabulary: write_chunk's ids (chunk x 1000 + record) mod V

Key = tuple[int, int]


def tiny_eagle3():
    """speculators' own EAGLE-3 draft model, tiny, eager attention (CPU)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    tl = LlamaConfig(hidden_size=H, intermediate_size=8, num_hidden_layers=1,
                     num_attention_heads=1, num_key_value_heads=1, vocab_size=V,
                     max_position_embeddings=64)  # fmt: skip
    tl._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=V, norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=2)],
            verifier=VerifierConfig.from_config(tl, name_or_path=None)),
    )  # fmt: skip
    torch.manual_seed(0)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():  # the constructor leaves weights uninitialised
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return model


def speculators_on_cpu(setattr_: Callable[[Any, str, Any], None] = setattr) -> None:
    """The CPU-only substitutions speculators' Trainer needs (0.9.0 has no knob for any):
    it moves the model and each batch to ``get_local_rank()`` (the int 0, i.e. cuda:0),
    its step timer calls ``torch.accelerator.synchronize()``, which raises without an
    accelerator, and its checkpointer loads onto ``get_current_device()`` ("cuda:0"
    without one).  Here the device is "cpu" and synchronizing does nothing (CPU work is
    synchronous).  Its autocast("cuda") disables itself on a CPU, with a warning.
    ``setattr_``: pytest's ``monkeypatch.setattr`` in a test (undone after it)."""
    import speculators.train.checkpointer as checkpointer_mod
    import speculators.train.trainer as trainer_mod

    setattr_(trainer_mod, "get_local_rank", lambda: "cpu")
    setattr_(checkpointer_mod, "get_current_device", lambda: "cpu")
    setattr_(torch.accelerator, "synchronize", lambda *a, **k: None)


def make_trainer(run: Path, out: Path, dl, *, resume: bool = False, **config):
    """speculators' ``Trainer`` (AdamW, linear schedule, its checkpointer in ``out``) of
    :func:`tiny_eagle3` over ``dl``."""
    from speculators.losses import resolve_loss_config
    from speculators.train.trainer import Trainer, TrainerConfig

    kw = {"ttt_steps": 2, "ttt_step_loss_decay": 1.0,
          "loss_config": resolve_loss_config("kl_div", "eager")}  # fmt: skip
    cfg = TrainerConfig(lr=1e-2, num_epochs=1, save_path=str(out), resume_from_checkpoint=resume,
                        train_call_kwargs=kw, hidden_states_dtype=torch.float32,
                        **config)  # fmt: skip
    return Trainer(tiny_eagle3(), cfg, dl)


def shift_small_ids(item: dict) -> dict:
    """speculators' ``shift_batch``, ids folded into the tiny model's vocabulary."""
    from speculators.models.eagle3.data import shift_batch

    return shift_batch({**item, "input_ids": item["input_ids"] % V})


def _append(path: Path, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()


@dataclass
class RankRun:
    """A rank ready to train (``trainer.run_training()``), and what it records."""

    rank: int
    world: int
    trainer: Any
    hook: Any
    before: list[torch.Tensor]
    batches: list[tuple[int, list[Key]]] = field(default_factory=list)
    # Rank 0: (seqs, step, chunks announced then), one per ack the hook made.
    acks: list[tuple[list[int], int, int]] = field(default_factory=list)


def start_rank(
    run: Path,
    out: Path,
    log_dir: Path,
    *,
    rank: int = 0,
    world: int = 1,
    batch_tokens: int,
    seed: int = 1,
    checkpoint_chunks: int = 1,
    num_workers: int = 1,
    prefetch_factor: int = 1,
    resume: bool = False,
    timeout_s: float = 60,
) -> RankRun:
    """speculators' loader, draft model and Trainer for this rank, ``AckOnCheckpoint``
    attached; every batch the sampler hands out is recorded, and (rank 0) every ack is
    checked against the checkpoint on disk first."""
    from hsextract.stream.speculators import AckOnCheckpoint, speculators_loader

    dl = speculators_loader(run, batch_tokens, H, num_target_layers=K, preprocess=shift_small_ids,
                            hidden_states_dtype=torch.float32, num_workers=num_workers,
                            prefetch_factor=prefetch_factor, rank=rank, world=world, seed=seed,
                            timeout_s=timeout_s)  # fmt: skip
    # checkpoint_freq 1 (speculators' default): its own checkpoint only ends the epoch.
    trainer = make_trainer(run, out, dl, resume=resume, checkpoint_freq=1)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    hook = AckOnCheckpoint(run, checkpoint_chunks=checkpoint_chunks)
    hook.attach(trainer)
    log_dir.mkdir(parents=True, exist_ok=True)
    r = RankRun(rank, world, trainer, hook, before)
    _record_batches(r, dl.batch_sampler, log_dir / f"batches.{rank}.jsonl")
    if rank == 0:
        _check_acks(r, run, out, log_dir / "acks.checked.jsonl")
    return r


def _record_batches(r: RankRun, sampler, path: Path) -> None:
    """Record each batch as the sampler hands it out, with its number in the pass (the
    loader iterates the batch sampler in the rank's own process, workers or not)."""
    numbered = sampler._numbered

    def recorded():
        # What __iter__ skips on a resume (packed again, not handed out) is not recorded.
        skip = 0 if sampler._resume is None else int(sampler._resume["skip_to"])
        for n, batch in numbered():
            if n > skip:
                r.batches.append((n, batch))
                _append(path, {"n": n, "keys": [list(k) for k in batch]})
            yield n, batch

    sampler._numbered = recorded


def _check_acks(r: RankRun, run: Path, out: Path, path: Path) -> None:
    """Rank 0: an ack goes out only once the Trainer's checkpoint of this very step is on
    disk (its training state, our sampler state, its weights); recorded before it goes."""
    from hsextract.stream.speculators import AckOnCheckpoint

    real_ack = r.hook._acker.ack
    t = r.trainer

    def checked_ack(seqs, *, pass_, step):
        state = json.loads((out / "0" / "training_state.json").read_text())
        ours = json.loads((out / "0" / AckOnCheckpoint.STATE).read_text())
        assert state["global_step"] == ours["global_step"] == step == t.global_step, (
            state,
            ours["global_step"],
            step,
            t.global_step,
        )
        assert (out / "0" / "model.safetensors").exists() and pass_ == 1
        announced = len(journal.read_state(run / "stream").chunks)
        r.acks.append((list(seqs), step, announced))
        _append(path, {"seqs": sorted(seqs), "step": step, "announced": announced,
                       "local_step": state["local_step"]})  # fmt: skip
        real_ack(seqs, pass_=pass_, step=step)

    r.hook._acker.ack = checked_ack


def die_at(r: RankRun, step: int) -> None:
    """SIGKILL this rank after the optimizer step ``step``, before the Trainer decides to
    checkpoint it (``AckOnCheckpoint`` calls the Trainer's step callback first)."""
    t = r.trainer
    train_epoch = t.train_epoch

    def killed(*, step_callback=None) -> None:
        if step_callback is not None:
            step_callback()
        if t.global_step == step:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # this step's collectives done: the peer is not owed
            os.kill(os.getpid(), signal.SIGKILL)

    def epoch(e: int, **kwargs: Any) -> None:
        theirs = kwargs.pop("step_callback", None)
        train_epoch(e, step_callback=lambda: killed(step_callback=theirs), **kwargs)

    t.train_epoch = epoch


def digest(params) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def finish(r: RankRun, log_dir: Path) -> dict:
    """What the rank trained, written once ``run_training`` returned after the whole
    pass (speculators' interrupt handler also returns, after SIGTERM: not a result)."""
    after = list(r.trainer.model.parameters())
    moved = (not torch.equal(a.cpu(), b.cpu()) for a, b in zip(after, r.before, strict=True))
    res = {
        "rank": r.rank,
        "world": r.world,
        "global_step": r.trainer.global_step,
        "batches": len(r.batches),
        "finite": all(bool(torch.isfinite(p).all()) for p in after),
        "changed": any(moved),
        "digest": digest(after),
    }
    tmp = log_dir / f".result.{r.rank}.json.tmp"
    tmp.write_text(json.dumps(res))
    os.replace(tmp, log_dir / f"result.{r.rank}.json")
    return res


def _cpu_distributed(rank: int, world: int) -> None:
    """What speculators' ``maybe_setup_distributed`` sets up, over gloo on the CPU (it
    refuses without an accelerator): the process group, its topology, the DP groups."""
    import speculators.train.distributed as sd
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    sd._local_rank, sd._rank, sd._world_size, sd._is_distributed = rank, rank, world, True
    sd._init_sp_process_groups(rank, world, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="the Trainer's save_path")
    p.add_argument("--log-dir", type=Path, required=True)
    p.add_argument("--batch-tokens", type=int, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--checkpoint-chunks", type=int, default=1)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=120)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--die-at-step", type=int)
    p.add_argument("--die-rank", type=int, default=0)
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args(argv)
    from speculators.train.distributed import maybe_destroy_distributed, maybe_setup_distributed

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if args.cpu:
        speculators_on_cpu()
        if world > 1:
            _cpu_distributed(rank, world)
    else:
        maybe_setup_distributed()  # speculators' own: NCCL, cuda:LOCAL_RANK
    try:
        r = start_rank(args.run_dir, args.out, args.log_dir, rank=rank, world=world,
                       batch_tokens=args.batch_tokens, seed=args.seed,
                       checkpoint_chunks=args.checkpoint_chunks, num_workers=args.workers,
                       prefetch_factor=args.prefetch, resume=args.resume,
                       timeout_s=args.timeout_s)  # fmt: skip
        if args.die_at_step is not None and rank == args.die_rank:
            die_at(r, args.die_at_step)
        done = []
        epoch = r.trainer.train_epoch

        def whole(e: int, **kwargs: Any) -> None:
            epoch(e, **kwargs)
            done.append(e)  # returned: not cut short by speculators' interrupt handler

        r.trainer.train_epoch = whole
        r.trainer.run_training()
        if not done:
            sys.exit(f"rank {rank}: the epoch was interrupted (see above)")
        finish(r, args.log_dir)
    finally:
        maybe_destroy_distributed()


if __name__ == "__main__":
    # Imported by its package name, so what the loader's spawned workers unpickle
    # (shift_small_ids) is tests.stream_speculators_rank's, not __main__'s.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.stream_speculators_rank import main as _main

    _main()
