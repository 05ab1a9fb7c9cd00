"""The trainers' own code reads a run in progress under a budget (issue 39, item 6).

Chunks are written with the real ChunkWriter and passed through the real gate and journal
by a producer thread (as tests/test_stream.py does), so no workflow runs; the consumers
are speculators' and SpecForge's own classes.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from hsextract.stream import gate, journal
from hsextract.stream.receipts import redo_nacked
from tests.stream_speculators_rank import V, speculators_on_cpu, start_rank
from tests.stream_speculators_rank import make_trainer as _trainer
from tests.stream_speculators_rank import shift_small_ids as _shift_small_ids
from tests.test_stream import (
    H,
    K,
    announce,
    consume_in_thread,
    corrupt,
    nack_lines,
    wait_for,
    write_chunk,
)

N_CHUNKS, RECORDS, TOKENS = 10, 4, 300


def _bytes_per_token(tmp: Path) -> int:
    """A like chunk's bytes per token, from a scratch copy (the gate's estimate)."""
    side = write_chunk(tmp, 0, RECORDS, tokens=TOKENS, prenorm=True)
    return (tmp / side["path"]).stat().st_size // side["tokens"] + 1


class Producer(threading.Thread):
    """The workflow's side: each chunk passes the budget gate, is written, announced."""

    def __init__(self, run_dir: Path, ss: gate.StreamSettings, bpt: int) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.ss, self.bpt = run_dir, ss, bpt
        self.error: BaseException | None = None
        self.peak = 0
        self.waited = False  # the gate held a chunk back for the trainer's acks
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            tok = RECORDS * TOKENS
            for i in range(N_CHUNKS):
                if self.stop.is_set():
                    return
                gate.wait_for_room(self.run_dir, self.ss, chunk=f"chunk_{i:05d}", tokens=tok,
                                   raw_bytes_per_token=self.bpt, largest_tokens=tok,
                                   run_tokens=N_CHUNKS * tok, on_wait=self.on_wait)  # fmt: skip
                side = write_chunk(self.run_dir, i, RECORDS, tokens=TOKENS, prenorm=True)
                announce(self.run_dir, side, N_CHUNKS)
                gate.release(self.run_dir, side["chunk"])
                self.sample()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def on_wait(self, info: dict) -> None:
        self.waited = True

    def sample(self) -> None:
        info = gate.summary(self.run_dir, budget_bytes=self.ss.budget_bytes)
        self.peak = max(self.peak, info["unacked_bytes"])


def _settings(bpt: int) -> gate.StreamSettings:
    """Room for the trainer's window (2 open chunks + 1 between checkpoints + 1 being
    written) and not much more: well under the run's bytes, so the producer waits."""
    est = RECORDS * TOKENS * bpt
    return gate.StreamSettings(budget_gb=4.5 * est / gate.GB, low_mark=0.75, prefetch_chunks=2,
                               checkpoint_chunks=1, poll_s=0.05)  # fmt: skip


def all_keys() -> Counter:
    return Counter((i, j) for i in range(N_CHUNKS) for j in range(RECORDS))


# -- speculators ----------------------------------------------------------------------


def test_speculators_own_trainer_trains_from_a_run_in_progress_under_a_budget(
    tmp_path, monkeypatch
):
    """speculators' ``Trainer.run_training`` (its loop, AdamW + linear schedule, its
    checkpointer) reads a run in progress through ``speculators_loader``, with
    ``AckOnCheckpoint`` acking after each checkpoint it commits (each ack checked against
    the checkpoint on disk first).  The rank's body is tests/stream_speculators_rank.py's,
    which tests/live/test_stream_ddp_live.py runs on 2 GPUs.  CPU-only substitution:
    ``speculators_on_cpu`` (the device it moves tensors to; a no-op synchronize)."""
    speculators_on_cpu(monkeypatch.setattr)
    run, out = tmp_path / "run", tmp_path / "ckpt"
    bpt = _bytes_per_token(tmp_path / "scratch")
    ss = _settings(bpt)
    producer = Producer(run, ss, bpt)
    # speculators' loader settings: its CollateFn, a spawned worker, prefetch (1 batch =
    # half a chunk here, within the 2 chunks the window gives a rank).
    r = start_rank(run, out, tmp_path / "log", batch_tokens=2 * TOKENS, num_workers=1,
                   prefetch_factor=1, checkpoint_chunks=ss.checkpoint_chunks)  # fmt: skip
    trainer = r.trainer
    producer.start()
    try:
        trainer.run_training()
    finally:
        producer.stop.set()
        journal.AckWriter(run).ack(list(range(N_CHUNKS)))  # unblock a waiting producer
        producer.join(60)
    assert producer.error is None, producer.error
    # 10 chunks x 4 records of 300 tokens, 2 records a 600-token batch: every record once.
    assert trainer.global_step == N_CHUNKS * RECORDS // 2
    assert Counter(k for _, b in r.batches for k in b) == all_keys()
    after = list(trainer.model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, r.before, strict=True))
    acks = r.acks
    assert sorted(s for seqs, _, _ in acks for s in seqs) == list(range(N_CHUNKS))
    assert len(acks) >= N_CHUNKS // 2  # checkpoints within the pass, not only at its end
    assert acks[0][2] < N_CHUNKS and producer.waited  # a run in progress, held by the budget
    assert producer.peak <= ss.budget_bytes < N_CHUNKS * RECORDS * TOKENS * bpt
    deleted = journal.read_lines(run / "stream" / "deleted.jsonl")
    assert len(deleted) >= N_CHUNKS - 4  # freed by the gate while the run went on


def test_speculators_own_trainer_resumes_mid_pass_without_the_chunks_it_acked(
    tmp_path, monkeypatch
):
    """speculators' Trainer dies mid-pass; a new one resumes from its last checkpoint
    (``resume_from_checkpoint``) with the acked chunks deleted, and trains on exactly the
    records that checkpoint did not cover.  CPU-only substitution: speculators_on_cpu."""
    from hsextract.stream.speculators import AckOnCheckpoint, speculators_loader

    speculators_on_cpu(monkeypatch.setattr)
    run, out, n_chunks, tokens = tmp_path / "run", tmp_path / "ckpt", 6, 30
    for i in range(n_chunks):
        announce(run, write_chunk(run, i, RECORDS, tokens=tokens, prenorm=True), n_chunks)
    fetched: list[tuple[int, tuple[int, int]]] = []  # (global step when read, record)

    def trainer(resume: bool):
        dl = speculators_loader(run, 2 * tokens, H, num_target_layers=K,
                                preprocess=_shift_small_ids, hidden_states_dtype=torch.float32,
                                seed=3, timeout_s=60)  # fmt: skip
        t = _trainer(run, out, dl, resume=resume, checkpoint_freq=1)
        read = dl.dataset._get_raw_data

        def spy(key):
            fetched.append((t.global_step, key))  # num_workers 0: read as the step starts
            return read(key)

        dl.dataset._get_raw_data = spy
        AckOnCheckpoint(run, checkpoint_chunks=1).attach(t)
        return t

    first = trainer(resume=False)
    step = first._optimizers_step

    def dies_at_step_8() -> None:
        if first.global_step == 7:
            raise RuntimeError("killed")
        step()

    first._optimizers_step = dies_at_step_8
    with pytest.raises(RuntimeError, match="killed"):
        first.run_training()
    saved = json.loads((out / "0" / "training_state.json").read_text())
    acked = {s for a in journal.read_lines(run / "stream" / "acks.jsonl") for s in a["seqs"]}
    assert 0 < saved["local_step"] < 7 and 0 < len(acked) < n_chunks
    for seq in acked:  # deleted, as the workflow does: the resumed trainer must not need them
        (run / "hidden" / f"chunk_{seq:05d}.safetensors").unlink()
    done = [k for g, k in fetched if g < saved["global_step"]]
    fetched.clear()
    second = trainer(resume=True)
    second.run_training()
    again = [k for _, k in fetched]
    assert Counter(done) + Counter(again) == Counter(
        (i, j) for i in range(n_chunks) for j in range(RECORDS)
    )
    assert second.global_step == n_chunks * RECORDS // 2  # the pass's steps, once each
    acked = {s for a in journal.read_lines(run / "stream" / "acks.jsonl") for s in a["seqs"]}
    assert acked == set(range(n_chunks))


def _trained(model) -> list[torch.Tensor]:
    """The weights a checkpoint saves (the verifier's are not)."""
    return [p for p in model.parameters() if p.requires_grad]


class _Resumes:
    """A run of 6 chunks x 4 records (2 a batch: 12 steps) trained by speculators'
    Trainer through AckOnCheckpoint, killed and resumed: each record's global step when
    read, and the weights of each step a checkpoint was committed at (before its ack)."""

    def __init__(self, tmp: Path, checkpoint_chunks: int = 1) -> None:
        self.run, self.out, self.n_chunks, self.tokens = tmp / "run", tmp / "ckpt", 6, 30
        self.checkpoint_chunks = checkpoint_chunks
        for i in range(self.n_chunks):
            side = write_chunk(self.run, i, RECORDS, tokens=self.tokens, prenorm=True)
            announce(self.run, side, self.n_chunks)
        self.fetched: list[tuple[int, tuple[int, int]]] = []
        self.weights: dict[int, list[torch.Tensor]] = {}

    def trainer(self, resume: bool):
        from hsextract.stream.speculators import AckOnCheckpoint, speculators_loader

        dl = speculators_loader(self.run, 2 * self.tokens, H, num_target_layers=K,
                                preprocess=_shift_small_ids, hidden_states_dtype=torch.float32,
                                seed=3, timeout_s=60)  # fmt: skip
        t = _trainer(self.run, self.out, dl, resume=resume, checkpoint_freq=1)
        read = dl.dataset._get_raw_data

        def spy(key):
            self.fetched.append((t.global_step, key))  # num_workers 0: as the step starts
            return read(key)

        dl.dataset._get_raw_data = spy
        hook = AckOnCheckpoint(self.run, checkpoint_chunks=self.checkpoint_chunks)
        hook.attach(t)
        real_ack = hook._acker.ack

        def ack(seqs, *, pass_, step):
            self.weights[step] = [p.detach().clone() for p in _trained(t.model)]
            real_ack(seqs, pass_=pass_, step=step)

        hook._acker.ack = ack
        return t, hook

    def acked(self) -> set[int]:
        lines = journal.read_lines(self.run / "stream" / "acks.jsonl")
        return {s for a in lines if a["type"] == "ack" for s in a["seqs"]}

    def resume_and_check(self) -> None:
        """As the workflow does, delete the acked chunks; a new Trainer resumes from the
        last committed checkpoint (its weights) and trains exactly what it did not cover."""
        for seq in self.acked():
            (self.run / "hidden" / f"chunk_{seq:05d}.safetensors").unlink()
        second, _ = self.trainer(resume=True)
        at = second.global_step
        assert at in self.weights, (at, sorted(self.weights))
        for p, w in zip(_trained(second.model), self.weights[at], strict=True):
            assert torch.equal(p, w.bfloat16().float())  # the checkpointer saves bf16
        done = [k for g, k in self.fetched if g < at]
        self.fetched.clear()
        second.run_training()
        assert Counter(done) + Counter(k for _, k in self.fetched) == Counter(
            (i, j) for i in range(self.n_chunks) for j in range(RECORDS)
        )
        assert second.global_step == self.n_chunks * RECORDS // 2
        assert self.acked() == set(range(self.n_chunks))
        assert sorted(p.name for p in self.out.iterdir() if not p.is_symlink()) == ["0"]


def _kill_in(what: str, t, hook, at: int) -> None:
    """Make the Trainer's ``at``-th checkpoint save (or its ack) raise partway through,
    leaving what a kill there leaves on disk."""
    ck, calls = t.checkpointer, Counter()

    def nth(name: str) -> bool:
        calls[name] += 1
        return calls[name] == at

    if what == "optimizer":  # the model written, the optimizer's file half written
        real = ck.save_checkpoint

        def save_checkpoint(model, optimizer, epoch, *a, **k):
            real(model, optimizer, epoch, *a, **k)
            if nth(what):
                path = ck.optimizer_path(epoch)
                path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
                raise RuntimeError("killed")

        ck.save_checkpoint = save_checkpoint
    elif what == "scheduler":  # model, optimizer and scheduler written, not training_state
        real = ck.save_scheduler_state_dict

        def save_scheduler_state_dict(schedulers, epoch):
            real(schedulers, epoch)
            if nth(what):
                raise RuntimeError("killed")

        ck.save_scheduler_state_dict = save_scheduler_state_dict
    elif what == "training_state":  # its write_text cut short
        real = t._save_training_state

        def save_training_state(epoch, local_step):
            real(epoch, local_step)
            if nth(what):
                path = t._training_state_path(epoch)
                path.write_text(path.read_text()[:10])
                raise RuntimeError("killed")

        t._save_training_state = save_training_state
    else:  # "ack": the checkpoint committed (its weights recorded), its chunks not acked
        real = hook._acker.ack

        def ack(seqs, *, pass_, step):
            real([] if nth(what) else seqs, pass_=pass_, step=step)
            if calls[what] == at:
                raise RuntimeError("killed")

        hook._acker.ack = ack


@pytest.mark.parametrize("what", ["optimizer", "scheduler", "training_state", "ack"])
def test_speculators_trainer_killed_while_checkpointing_resumes_from_a_whole_checkpoint(
    tmp_path, monkeypatch, what
):
    """speculators writes each checkpoint of an epoch over the last, in place: a kill
    during the third save (or after it, before its ack) must leave a checkpoint to resume
    from that matches the chunks acked (and deleted) so far, whose weights are those of
    its step, and whose chunks are acked once resumed.  CPU-only: speculators_on_cpu."""
    speculators_on_cpu(monkeypatch.setattr)
    r = _Resumes(tmp_path)
    first, hook = r.trainer(resume=False)
    _kill_in(what, first, hook, at=3)
    with pytest.raises(RuntimeError, match="killed"):
        first.run_training()
    assert 0 < len(r.acked()) < r.n_chunks
    r.resume_and_check()


def test_speculators_trainer_killed_before_the_ack_of_its_epoch_end_acks_it_on_resume(
    tmp_path, monkeypatch
):
    """Killed after the end-of-epoch checkpoint, before its ack: speculators resumes at
    the next epoch, which reads another pass; the chunks that checkpoint covered are acked
    on resume, not left unacked for good.  CPU-only: speculators_on_cpu."""
    speculators_on_cpu(monkeypatch.setattr)
    r = _Resumes(tmp_path, checkpoint_chunks=4)  # the epoch's end covers the last 2 chunks
    first, hook = r.trainer(resume=False)
    _kill_in("ack", first, hook, at=2)
    with pytest.raises(RuntimeError, match="killed"):
        first.run_training()
    assert first.global_step == r.n_chunks * RECORDS // 2 and len(r.acked()) == 4
    r.resume_and_check()


def test_speculators_trainer_killed_while_swapping_a_checkpoint_in_is_refused_with_the_fix(
    tmp_path, monkeypatch
):
    """Killed between renaming the epoch's checkpoint away and the new one in: the next
    Trainer (built before attach) resumed without it, so attach refuses in one sentence
    saying the mv that restores it; done, the resume is exact.  A training_state.json that
    no longer records the step the checkpoint covers is refused too, with what to write.
    CPU-only: speculators_on_cpu."""
    import os
    import re

    from hsextract.stream.speculators import AckOnCheckpoint

    speculators_on_cpu(monkeypatch.setattr)
    r = _Resumes(tmp_path)
    first, _ = r.trainer(resume=False)
    rename, renames = os.rename, Counter()

    def killed_rename(src, dst):
        src = Path(src)
        if src.parent.name == AckOnCheckpoint.STAGING and src.name == "0":
            renames[src] += 1
            if renames[src] == 3:
                raise RuntimeError("killed")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", killed_rename)
    with pytest.raises(RuntimeError, match="killed"):
        first.run_training()
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(journal.StreamError) as e:
        r.trainer(resume=True)
    said = str(e.value)
    assert "\n" not in said
    src, dst = re.search(r"`mv (\S+) (\S+)`", said).groups()
    os.rename(src, dst)
    state = r.out / "0" / "training_state.json"
    whole = state.read_text()
    state.write_text(whole[:10])  # torn: speculators reads it as the epoch's end
    with pytest.raises(journal.StreamError, match="does not record step") as e:
        r.trainer(resume=True)
    assert "\n" not in str(e.value)
    wrote = json.loads(re.search(r"write (\{.*?\}) to it", str(e.value)).group(1))
    assert wrote == json.loads(whole)
    state.write_text(json.dumps(wrote))
    r.resume_and_check()


def test_speculators_trainer_settings_that_cannot_ack_are_refused_in_one_sentence(
    tmp_path, monkeypatch
):
    from torch.utils.data import DataLoader

    from hsextract.stream.speculators import AckOnCheckpoint, speculators_loader

    speculators_on_cpu(monkeypatch.setattr)
    announce(tmp_path, write_chunk(tmp_path, 0, 2, tokens=4, prenorm=True), 1)
    dl = speculators_loader(tmp_path, 8, H, num_target_layers=K, timeout_s=60)
    cases = {
        "no checkpoint in most epochs": _trainer(tmp_path, tmp_path / "a", dl, checkpoint_freq=2),
        "only when validation improves": _trainer(tmp_path, tmp_path / "b", dl, save_best=True),
        "not hsextract.stream.speculators.StreamPackingSampler": _trainer(
            tmp_path, tmp_path / "c", DataLoader(list(range(4)), batch_size=2)
        ),
    }
    for what, t in cases.items():
        with pytest.raises(journal.StreamError) as e:
            AckOnCheckpoint(tmp_path, checkpoint_chunks=1).attach(t)
        assert what in str(e.value) and "\n" not in str(e.value), what
    # A checkpoint taken without it: what it covers (maybe deleted) is unknown.
    (tmp_path / "d" / "0").mkdir(parents=True)
    t = _trainer(tmp_path, tmp_path / "d", dl)
    t.checkpointer.save_checkpoint(t.model, t.optimizers, 0)
    t._save_training_state(0, local_step=1)
    with pytest.raises(journal.StreamError, match="not taken through AckOnCheckpoint"):
        AckOnCheckpoint(tmp_path, checkpoint_chunks=1).attach(
            _trainer(tmp_path, tmp_path / "d", dl, resume=True)
        )
    # A new training over an epoch directory it did not write: its saves would replace it.
    t = _trainer(tmp_path, tmp_path / "d", dl)
    with pytest.raises(journal.StreamError, match="AckOnCheckpoint did not write") as e:
        AckOnCheckpoint(tmp_path, checkpoint_chunks=1).attach(t)
    assert "\n" not in str(e.value) and (tmp_path / "d" / "0" / "model.safetensors").exists()


def test_the_packing_sampler_yields_every_record_once_on_every_rank(tmp_path):
    from hsextract.stream.speculators import StreamPackingSampler

    sizes = [3, 5, 1, 4]
    for i, n in enumerate(sizes):
        announce(tmp_path, write_chunk(tmp_path, i, n, tokens=2 + i, prenorm=True), len(sizes))
    for world in (1, 2, 3):
        per_rank = [list(StreamPackingSampler(tmp_path, 8, rank=r, world=world, seed=5,
                                              timeout_s=60)) for r in range(world)]  # fmt: skip
        assert len({len(b) for b in per_rank}) == 1, world  # lockstep: same batch count
        got = Counter(k for batches in per_rank for b in batches for k in b)
        assert got == Counter((i, j) for i, n in enumerate(sizes) for j in range(n)), world
        for batches in per_rank:
            assert all(sum(2 + i for i, _ in b) <= 8 for b in batches)
    # covered_seqs(k): exactly the chunks whose every record is in the first k batches.
    s = StreamPackingSampler(tmp_path, 8, seed=5, timeout_s=60)
    batches = list(s)
    for k in range(len(batches) + 1):
        have = Counter(i for b in batches[:k] for i, _ in b)
        assert s.covered_seqs(k) == [i for i, n in enumerate(sizes) if have[i] == n], k
    assert s.covered_seqs(len(batches)) == [0, 1, 2, 3] and s.covered_seqs(0) == []
    assert 0 < len(s.covered_seqs(len(batches) - 1)) < 4  # some, not all, before the end
    # len(): an estimate from the tokens (no chunks/index.json here: those announced).
    assert len(s) == -(-sum(n * (2 + i) for i, n in enumerate(sizes)) // 8)


def test_the_packing_sampler_waits_for_the_redo_of_a_nacked_chunk(tmp_path):
    """A chunk whose bytes changed before the sampler read its lengths mid-pass: nacked,
    and its redo waited for and packed (every record once), as the dataset does."""
    from hsextract.stream.speculators import StreamPackingSampler

    sizes = [3, 4, 2]
    sides = [write_chunk(tmp_path, i, n, prenorm=True) for i, n in enumerate(sizes)]
    for s in sides[:2]:
        announce(tmp_path, s, len(sizes))
    corrupt(tmp_path / sides[1]["path"])
    got: list = []
    errors: list[Exception] = []
    t = consume_in_thread(iter(StreamPackingSampler(tmp_path, 8, timeout_s=60)), got, errors)
    try:

        def nacked():
            return bool(nack_lines(tmp_path) or errors)

        wait_for(nacked)
        assert not errors, errors
        # The plan of the next extract_all removes it; its redo is announced as revision 1.
        assert redo_nacked(tmp_path) == [sides[1]["path"]]
        assert announce(tmp_path, write_chunk(tmp_path, 1, 4, prenorm=True), 3) == (1, True)
        announce(tmp_path, sides[2], len(sizes))
    finally:
        t.join(60)
    assert not errors and not t.is_alive(), errors
    keys = Counter(k for b in got for k in b)
    assert keys == Counter((i, j) for i, n in enumerate(sizes) for j in range(n))


def test_speculators_own_random_sampler_is_refused_in_one_sentence(tmp_path):
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    from hsextract.stream.speculators import StreamSpeculatorsDataset

    announce(tmp_path, write_chunk(tmp_path, 0, 2, prenorm=True), 1)
    ds = StreamSpeculatorsDataset(tmp_path, 8, hidden_states_dtype=torch.float32)
    stock = MultipackDistributedBatchSamplerV2(8, [3, 3], num_replicas=1, rank=0)
    with pytest.raises(journal.StreamError) as e:
        ds[next(iter(stock))[0]]
    msg = str(e.value)
    assert "random order" in msg and "StreamPackingSampler" in msg and "\n" not in msg
    assert ds[(0, 1)]["hidden_states"].shape == (3, K * H)


# -- SpecForge ------------------------------------------------------------------------


def tiny_specforge_draft():
    """SpecForge's own EAGLE-3 draft model (LlamaForCausalLMEagle3), tiny, and a fixed
    random target head standing in for the target model's lm_head."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=H, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=H,
                      vocab_size=V, max_position_embeddings=2 * TOKENS)  # fmt: skip
    cfg.draft_vocab_size = V
    torch.manual_seed(0)
    return LlamaForCausalLMEagle3(cfg, attention_backend="sdpa"), torch.nn.Linear(H, V)


def test_specforge_loader_trains_from_a_run_in_progress_under_a_budget(tmp_path):
    """SpecForge's own normalizer, collator and draft model on the stream, checkpointing
    (here: acking) when ``checkpoint_due`` says the run's ``checkpoint_chunks`` were
    covered, under a budget that holds no more than that window."""
    from hsextract.stream.reader import consumed_seqs
    from hsextract.stream.specforge import specforge_loader

    run = tmp_path / "run"
    bpt = _bytes_per_token(tmp_path / "scratch")
    ss = _settings(bpt)
    producer = Producer(run, ss, bpt)
    dl = specforge_loader(run, batch_size=2, max_len=64, seed=2, timeout_s=60)
    draft, teacher = tiny_specforge_draft()
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    acker = journal.AckWriter(run)
    seen: list[str] = []
    losses: list[float] = []
    acked: set[int] = set()
    last = None  # the loader state of the last checkpoint
    producer.start()
    try:
        for step, batch in enumerate(dl, 1):
            if step == 1:
                at_start = len(journal.read_state(run / "stream").chunks)
            # SpecForge's names: aux layers as hidden_state, the final state as target.
            assert batch["hidden_state"].shape[-1] == K * H and batch["target"].shape[-1] == H
            assert int(batch["loss_mask"][:, -1].sum()) == 0  # process_data's last mask
            # One TTT step of SpecForge's draft model: its TTT loop (OnlineEagle3Model)
            # imports triton, which a CPU machine lacks.
            h = draft(batch["hidden_state"], draft.embed_input_ids(batch["input_ids"] % V),
                      batch["attention_mask"])  # fmt: skip
            logp = torch.log_softmax(draft.compute_logits(h), -1)
            with torch.no_grad():  # the target's distribution, from its final state
                p = torch.softmax(teacher(batch["target"]), -1)
            mask = batch["loss_mask"].float()
            loss = -((p * logp).sum(-1) * mask).sum() / mask.sum().clamp(min=1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
            seen += [i for i, p in zip(batch["id"], batch["pad"], strict=True) if not p]
            producer.sample()
            if dl.checkpoint_due(ss.checkpoint_chunks, since=last):
                last = dl.state_dict()  # the checkpoint's loader state, then its ack
                new = set(consumed_seqs(run, [last])) - acked  # one rank: its state
                assert len(new) >= ss.checkpoint_chunks
                acker.ack(new, step=step)
                acked |= new
    finally:
        producer.stop.set()
        journal.AckWriter(run).ack(list(range(N_CHUNKS)))
        producer.join(60)
    assert producer.error is None, producer.error
    assert Counter(seen) == Counter(f"r{i}-{j}" for i, j in all_keys())
    assert producer.peak <= ss.budget_bytes < N_CHUNKS * RECORDS * TOKENS * bpt
    assert at_start < N_CHUNKS and producer.waited  # a run in progress, held by the budget
    assert acked == set(range(N_CHUNKS))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_the_packing_sampler_resumes_without_the_chunks_acked_before(tmp_path):
    """A trainer killed after a checkpoint: from the sampler's state at that checkpoint a
    new sampler yields exactly the batches an uninterrupted pass would have, on every
    rank, without reading the chunks that checkpoint covered (acked, deleted)."""
    from hsextract.stream.speculators import StreamPackingSampler

    sizes = [3, 5, 1, 4, 2]
    for i, n in enumerate(sizes):
        announce(tmp_path, write_chunk(tmp_path, i, n, tokens=2 + i, prenorm=True), len(sizes))
    world = 3

    def sampler(rank: int) -> StreamPackingSampler:
        return StreamPackingSampler(tmp_path, 9, rank=rank, world=world, seed=1, timeout_s=60)

    whole = [list(sampler(r)) for r in range(world)]
    n = len(whole[0])
    for cut in range(1, n):
        s0 = sampler(0)
        it = iter(s0)
        for _ in range(cut):
            next(it)
        state = s0.state_dict(cut)
        covered = s0.covered_seqs(cut)
        del it
        gone = {}
        for seq in covered:  # acked and deleted: the resumed sampler must not need them
            p = tmp_path / "hidden" / f"chunk_{seq:05d}.safetensors"
            gone[p] = p.read_bytes()
            p.unlink()
        try:
            for r in range(world):
                s = sampler(r)
                s.load_state_dict(state)  # rank 0's state: every rank's is the same
                assert list(s) == whole[r][cut:], (cut, r)
        finally:
            for p, data in gone.items():
                p.write_bytes(data)
