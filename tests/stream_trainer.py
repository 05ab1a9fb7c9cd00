"""A real (tiny) training loop reading a run in progress: tests/test_stream_e2e.py runs it.

Two DDP ranks over gloo, each with a ``StreamLoader`` of two workers over
``hsextract.stream.StreamDataset`` (SpecForge's layout), training a small drafter head
(aux states -> the final state).  Every ``--ckpt-every`` steps, and whenever
``checkpoint_due`` says ``--checkpoint-chunks`` chunks were covered since the last
checkpoint (the run's ``stream.checkpoint_chunks``: chunks hold different numbers of
records), the ranks gather their loader states and the record ids trained since the last
checkpoint; rank 0 commits the checkpoint (temp name, fsync, rename) and only then acks
the chunks it covers (those every rank's workers have passed: the ranks read each chunk
together).  So a trainer SIGKILLed anywhere resumes (``--resume``) with exactly the
records the last checkpoint did not cover -- from the checkpoint taken after its loop
too: ``StreamLoader`` resumes it to nothing of the pass --, rank 0 first acks again what
that checkpoint covers (the kill may have come between its commit and its ack), and the
final checkpoint's ``trained`` list says which records the model was trained on, once
each.

    python tests/stream_trainer.py --run-dir R --out O [--resume] [--checkpoint-chunks N]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hsextract.stream.journal import AckWriter
from hsextract.stream.loader import StreamLoader
from hsextract.stream.reader import StreamDataset, consumed_seqs


def commit(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rank_main(rank: int, args: argparse.Namespace) -> None:
    out = Path(args.out)
    dist.init_process_group(
        "gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=args.world
    )
    torch.manual_seed(0)
    ckpt_path = out / "ckpt.pt"
    ckpt = torch.load(ckpt_path, weights_only=False) if args.resume and ckpt_path.exists() else None
    ds = StreamDataset(args.run_dir, rank=rank, world=args.world, seed=7, layout="specforge")
    dl = StreamLoader(ds, batch_size=None, num_workers=args.workers)
    opt = None
    step = 0
    trained: list[list[str]] = [[] for _ in range(args.world)]  # per rank, committed
    acker = AckWriter(args.run_dir) if rank == 0 else None
    last = None  # this rank's loader state at the last checkpoint
    if ckpt is not None:
        dl.load_state_dict(ckpt["loader"][rank])
        step, trained, last = ckpt["step"], ckpt["trained"], ckpt["loader"][rank]
        if acker is not None:  # killed between the checkpoint's commit and its ack?
            acker.ack(consumed_seqs(args.run_dir, ckpt["loader"]), step=step)
    since: list[str] = []

    def checkpoint() -> None:
        nonlocal last
        gathered: list = [None] * args.world
        dist.all_gather_object(gathered, (dl.state_dict(), since))
        states = [g[0] for g in gathered]
        for r, g in enumerate(gathered):
            trained[r].extend(g[1])
        since.clear()
        if rank == 0:
            # A resumed trainer that trains nothing more keeps the checkpoint's weights.
            old = ckpt or {"model": None, "opt": None}
            weights = model.state_dict() if model is not None else old["model"]
            opt_state = opt.state_dict() if opt is not None else old["opt"]
            commit(ckpt_path, {"model": weights, "opt": opt_state,
                               "loader": states, "step": step, "trained": trained})  # fmt: skip
            # Every rank reads each chunk: one is covered once all ranks' workers passed it.
            acker.ack(consumed_seqs(args.run_dir, states), step=step)  # once it is durable
        last = states[rank]
        dist.barrier()

    model = None
    for sample in dl:
        aux, hid = sample["aux_hidden_state"].float(), sample["hidden_state"].float()
        if model is None:
            head = torch.nn.Linear(aux.shape[-1], hid.shape[-1])
            model = torch.nn.parallel.DistributedDataParallel(head)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            if ckpt is not None:
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["opt"])
        mask = sample["loss_mask"].float().view(1, -1, 1)
        loss = (((model(aux) - hid) ** 2) * mask).sum() / mask.sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if not sample["pad"]:
            since.append(sample["id"])
        (out / f"progress_{rank}.json").write_text(json.dumps({"step": step}))
        due = args.checkpoint_chunks and dl.checkpoint_due(args.checkpoint_chunks, since=last)
        if step % args.ckpt_every == 0 or due:  # every rank decides the same
            checkpoint()
    checkpoint()
    if rank == 0:
        (out / "done.json").write_text(json.dumps({"step": step, "trained": trained}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument(
        "--checkpoint-chunks",
        type=int,
        default=0,
        help="also checkpoint once this many chunks are covered (0: off)",
    )
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "store").unlink(missing_ok=True)  # gloo's rendezvous file, per start
    mp.spawn(rank_main, args=(args,), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
