"""The trainers' own code reads a run in progress under a budget (issue 39, item 6).

Chunks are written with the real ChunkWriter and passed through the real gate and journal
by a producer thread (as tests/test_stream.py does), so no workflow runs; the consumers
are speculators' and SpecForge's own classes.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from hsextract.stream import gate, journal
from hsextract.stream.receipts import redo_nacked
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
V = 64  # the tiny models' vocabulary: write_chunk's ids (chunk x 1000 + record) mod V


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
    """Room for the trainer's window (1 rank x 2 open chunks + 1 between checkpoints + 1
    being written) and not much more: well under the run's bytes, so the producer waits."""
    est = RECORDS * TOKENS * bpt
    return gate.StreamSettings(budget_gb=4.5 * est / gate.GB, low_mark=0.75, trainer_ranks=1,
                               prefetch_chunks=2, checkpoint_chunks=1, poll_s=0.05)  # fmt: skip


def all_keys() -> Counter:
    return Counter((i, j) for i in range(N_CHUNKS) for j in range(RECORDS))


# -- speculators ----------------------------------------------------------------------


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


def test_speculators_trains_from_a_run_in_progress_under_a_budget(tmp_path):
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch

    from hsextract.stream.speculators import speculators_loader

    run = tmp_path / "run"
    bpt = _bytes_per_token(tmp_path / "scratch")
    ss = _settings(bpt)
    producer = Producer(run, ss, bpt)
    max_len = 2 * TOKENS  # two records a batch
    # speculators' loader settings: its CollateFn, a spawned worker, prefetch (1 batch =
    # half a chunk here, within the 2 chunks the window gives a rank).
    dl = speculators_loader(run, max_len, H, num_target_layers=K, preprocess=shift_batch,
                            hidden_states_dtype=torch.float32, num_workers=1,
                            prefetch_factor=1, seed=1, timeout_s=60)  # fmt: skip
    sampler = dl.batch_sampler
    model = tiny_eagle3()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_cfg = resolve_loss_config("kl_div", "eager")
    acker = journal.AckWriter(run)
    losses, acked = [], []
    producer.start()
    try:
        for step, batch in enumerate(dl, 1):
            if step == 1:
                at_start = len(journal.read_state(run / "stream").chunks)
            batch["input_ids"] %= V
            _, loss, _ = model(**batch, ttt_steps=2, ttt_step_loss_decay=1.0,
                               loss_config=loss_cfg)  # fmt: skip
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
            producer.sample()
            if step % 2 == 0:  # a checkpoint every 2 steps, then its ack
                torch.save(model.state_dict(), tmp_path / "ckpt.pt")
                seqs = [s for s in sampler.covered_seqs(step) if s not in acked]
                acker.ack(seqs, step=step)
                acked += seqs
    finally:
        producer.stop.set()
        journal.AckWriter(run).ack(list(range(N_CHUNKS)))  # unblock a waiting producer
        producer.join(60)
    assert producer.error is None, producer.error
    # 10 chunks x 4 records of 300 tokens, 2 records a batch: every record once.
    assert step == N_CHUNKS * RECORDS // 2
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] != losses[0]
    assert producer.peak <= ss.budget_bytes < N_CHUNKS * RECORDS * TOKENS * bpt
    assert at_start < N_CHUNKS and producer.waited  # a run in progress, held by the budget
    assert sorted(acked) == list(range(N_CHUNKS))  # each by the checkpoint covering it
    deleted = journal.read_lines(run / "stream" / "deleted.jsonl")
    assert len(deleted) >= N_CHUNKS - 4  # freed by the gate while the run went on


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
    from torchdata.stateful_dataloader import StatefulDataLoader

    from hsextract.stream.reader import consumed_seqs
    from hsextract.stream.specforge import SpecForgeCollator, SpecForgeStreamDataset

    run = tmp_path / "run"
    bpt = _bytes_per_token(tmp_path / "scratch")
    ss = _settings(bpt)
    producer = Producer(run, ss, bpt)
    ds = SpecForgeStreamDataset(run, max_len=64, seed=2, timeout_s=60)
    dl = StatefulDataLoader(ds, batch_size=2, num_workers=0, collate_fn=SpecForgeCollator())
    draft, teacher = tiny_specforge_draft()
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    acker = journal.AckWriter(run)
    seen: list[str] = []
    losses: list[float] = []
    acked: set[int] = set()
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
            state = dl.state_dict()  # the checkpoint's loader state, then its ack
            new = set(consumed_seqs(run, state, rank=0, world=1)) - acked
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
