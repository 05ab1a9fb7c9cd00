"""Correctness is measured: every captured layer equals a direct HF forward of the same model.

Runs the real reference-engine server and the real client (the code `extract_chunk` runs)
over the demo's chunks with chunked prefill off / 64 / 257 tokens and 1 / 8 requests in
flight, then compares every record's aux layers and final state with
``output_hidden_states=True`` of a plain forward (float32: max abs error <= 1e-5).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch
from fixtures_demo import poll

from hsextract import budget, server
from hsextract.chunks import ChunkReader
from hsextract.client import extract_chunk
from hsextract.config import load_config, typed

TOL = 1e-5


@pytest.fixture(scope="module")
def reference(demo_run):
    """Direct HF forwards of every merged record, keyed by record id."""
    from transformers import AutoModelForCausalLM

    workdir = demo_run["workdir"]
    model = AutoModelForCausalLM.from_pretrained(
        workdir / "results/demo/model", dtype=torch.float32
    )
    model.eval()
    merged = demo_run["run_dir"] / "merged" / "train.jsonl"
    out = {}
    # HF's hidden_states end with the normed state; the stream before the final norm
    # (prenorm_final) is the norm's input.
    seen: list[torch.Tensor] = []
    model.model.norm.register_forward_pre_hook(lambda m, args: seen.append(args[0][0]))
    with torch.inference_mode():
        for line in merged.read_text().splitlines():
            rec = json.loads(line)
            hs = model.model(
                torch.tensor([rec["input_ids"]]), output_hidden_states=True
            ).hidden_states
            out[rec["id"]] = {"rec": rec, "hs": [h[0] for h in hs], "prenorm": seen.pop()}
    return out


def compare_chunk(path: Path, reference: dict) -> int:
    reader = ChunkReader(path)
    layers = reader.aux_layers
    for item in reader:
        ref = reference[item["id"]]
        assert item["input_ids"].tolist() == ref["rec"]["input_ids"]
        assert item["loss_mask"].tolist() == ref["rec"]["loss_mask"]
        hs = ref["hs"]
        err = (item["hidden_states"] - hs[-1]).abs().max().item()
        assert err <= TOL, f"{item['id']}: final hidden state off by {err}"
        h = hs[0].shape[-1]
        for i, layer in enumerate(layers):
            got = item["aux_hidden_states"][:, i * h : (i + 1) * h]
            err = (got - hs[layer]).abs().max().item()
            assert err <= TOL, f"{item['id']}: aux layer {layer} off by {err}"
        if reader.prenorm:
            err = (item["prenorm_hidden_states"] - ref["prenorm"]).abs().max().item()
            assert err <= TOL, f"{item['id']}: pre-norm final state off by {err}"
            # and it is not the normed one under another name
            assert (item["prenorm_hidden_states"] - hs[-1]).abs().max().item() > 100 * TOL
    return len(reader)


def test_workflow_output_equals_direct_forward(demo_run, reference):
    n = sum(compare_chunk(demo_run["run_dir"] / c["path"], reference)
            for c in demo_run["manifest"]["chunks"])  # fmt: skip
    assert n == len(reference)


GRID = [(cps, n, True, False) for cps in (-1, 64, 257) for n in (1, 8)]
# SGLang-like budget sharing and one padded forward per batch: odd chunk boundaries and
# real multi-request forwards (left-padded KV caches, masks) must be just as exact.
GRID += [(64, 8, False, False), (257, 8, False, False)]
# prenorm_final: the stream before the final norm, beside the aux layers.
GRID += [(-1, 1, True, True), (64, 8, False, True)]


@pytest.mark.parametrize(("chunked_prefill", "in_flight", "batch_invariant", "prenorm"), GRID)
def test_fidelity_grid(
    demo_run,
    reference,
    tmp_path,
    chunked_prefill,
    in_flight,
    batch_invariant,
    prenorm,
    monkeypatch,
):
    workdir, rd = demo_run["workdir"], demo_run["run_dir"]
    monkeypatch.chdir(workdir)
    cfg = load_config(workdir / "config.yaml")
    cfg = copy.deepcopy(cfg)
    cfg["server"]["chunked_prefill_size"] = chunked_prefill
    cfg["client"]["requests_in_flight"] = in_flight
    cfg["server"]["batch_invariant"] = batch_invariant
    cfg["prenorm_final"] = prenorm
    cfg["dump"]["dir"] = str(tmp_path / "dump")
    cfg = typed(cfg)
    spec = server.build_spec(cfg, run_dir=tmp_path, log_path=tmp_path / "server.log")
    state = server.start(spec, owner=__import__("os").getpid())
    try:
        total = 0
        for c in demo_run["manifest"]["chunks"]:
            name = Path(c["path"]).stem
            out = tmp_path / f"{name}.safetensors"
            extract_chunk(
                cfg,
                chunk_path=rd / "chunks" / f"{name}.jsonl",
                index_path=rd / "chunks" / "index.json",
                out_path=out,
                sidecar_path=tmp_path / f"{name}.json",
                ensure=lambda: state,
                progress=False,
            )
            total += compare_chunk(out, reference)
            assert ChunkReader(out).prenorm == prenorm
        assert total == len(reference)
        # Every piece was consumed and every reservation released: the dump dir holds
        # nothing but our marker and the (empty) budget ledger.
        dump = tmp_path / "dump"
        assert sorted(p.name for p in dump.iterdir()) == [".budget", ".hsextract-run", ".turns"]
        assert [p.name for p in (dump / ".budget").iterdir()] == ["lock"]
        assert [p.name for p in (dump / ".turns").iterdir()] == ["turn-0"]
    finally:
        server.stop(state)


def test_chunk_jobs_take_turns_to_send(demo_run, reference, tmp_path, monkeypatch):
    """client.sending_jobs=1 with two chunk jobs at once: one sends while the other waits,
    their sending spans never overlap, and both files are still exact."""
    from concurrent.futures import ThreadPoolExecutor

    workdir, rd = demo_run["workdir"], demo_run["run_dir"]
    monkeypatch.chdir(workdir)
    cfg = copy.deepcopy(load_config(workdir / "config.yaml"))
    cfg["client"]["sending_jobs"] = 1
    cfg["dump"]["dir"] = str(tmp_path / "dump")
    cfg = typed(cfg)
    spec = server.build_spec(cfg, run_dir=tmp_path, log_path=tmp_path / "server.log")
    state = server.start(spec, owner=__import__("os").getpid())
    names = [Path(c["path"]).stem for c in demo_run["manifest"]["chunks"]][:2]
    sidecars: dict[str, dict] = {}
    errors: list[BaseException] = []
    # The test takes the only turn first and hands it on once a job has asked for it, so
    # that job is held back by the turn whatever the machine's load (with the two jobs
    # merely started together, one could finish before the other asked: seen under xdist).
    holder = budget.SendingTurn(tmp_path / "dump", 1)
    asked: list[float] = []
    real_acquire = budget.SendingTurn.acquire

    def acquire(self) -> float:  # the real acquire, the time it was asked for noted
        asked.append(time.time())
        return real_acquire(self)

    monkeypatch.setattr(budget.SendingTurn, "acquire", acquire)
    real_acquire(holder)

    def job(name: str) -> None:
        try:
            sidecars[name] = extract_chunk(
                copy.deepcopy(cfg),
                chunk_path=rd / "chunks" / f"{name}.jsonl",
                index_path=rd / "chunks" / "index.json",
                out_path=tmp_path / f"{name}.safetensors",
                sidecar_path=tmp_path / f"{name}.json",
                ensure=lambda: state,
                progress=False,
            )
        except BaseException as exc:
            errors.append(exc)

    try:
        with ThreadPoolExecutor(len(names)) as pool:
            running = [pool.submit(job, n) for n in names]
            poll(lambda: asked, "a chunk job asking for its turn")
            handed_on = time.time()
            holder.release()
            for f in running:
                f.result()
    finally:
        holder.release()
        server.stop(state)
    assert not errors, errors
    first, second = sorted((sidecars[n]["sending"] for n in names), key=lambda s: s[0])
    assert first[0] <= first[1] <= second[0] <= second[1], (first, second)
    # The job that asked while the test held the turn sent only once it was handed on
    # (the sidecar's times are rounded to the millisecond).
    assert asked[0] < handed_on <= first[0] + 0.0005, (asked, handed_on, first)
    for n in names:
        compare_chunk(tmp_path / f"{n}.safetensors", reference)
    # No turn is held once the jobs are done: the dump dir goes, turns and all.
    assert server.remove_dump_dir_if_empty(tmp_path / "dump")
    assert not (tmp_path / "dump").exists()
