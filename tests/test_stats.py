"""Activation statistics in each chunk's sidecar: sampled while packing, checked here
against exact statistics of the chunk file's own records."""

from __future__ import annotations

import json

import pytest
import torch

from hsextract.chunks import ChunkReader
from hsextract.stats import SAMPLE_EVERY, LayerStats


@pytest.mark.workflow
def test_sidecar_stats_match_the_chunk_files(demo_run):
    rd = demo_run["run_dir"]
    for c in demo_run["manifest"]["chunks"]:
        sidecar = json.loads((rd / c["path"]).with_suffix(".json").read_text())
        stats = sidecar["activation_stats"]
        assert stats["sample_every"] == SAMPLE_EVERY
        assert list(stats["layers"]) == ["aux_2", "aux_4", "aux_5", "final"]
        reader = ChunkReader(rd / c["path"])
        h = reader.hidden_size
        exact: dict[str, list[torch.Tensor]] = {k: [] for k in stats["layers"]}
        for rec in reader:
            for i, layer in enumerate(reader.aux_layers):
                exact[f"aux_{layer}"].append(rec["aux_hidden_states"][:, i * h : (i + 1) * h])
            exact["final"].append(rec["hidden_states"])
        for name, parts in exact.items():
            x = torch.cat(parts).double()
            got = stats["layers"][name]
            rms, mx = float(x.square().mean().sqrt()), float(x.abs().max())
            assert got["rms"] == pytest.approx(rms, rel=0.1), name
            assert 0.3 * mx <= got["max_abs"] <= mx * (1 + 1e-6), name
            assert got["values"] > 0


def test_stats_are_exact_on_the_sampled_rows():
    torch.manual_seed(0)
    x = torch.randn(50, 3 * 4)
    s = LayerStats(["a", "b", "c", "final"])
    s.add_rows(0, x, 3)
    s.add_rows(3, x[:, :4] * 0, 1)  # a layer of zeros shows as rms 0, max 0
    sample = x[::SAMPLE_EVERY].view(-1, 3, 4)
    rep = s.report()["layers"]
    for i, name in enumerate("abc"):
        want = sample[:, i]
        assert rep[name]["rms"] == pytest.approx(float(want.square().mean().sqrt()), rel=1e-5)
        assert rep[name]["max_abs"] == pytest.approx(float(want.abs().max()), rel=1e-6)
    assert rep["final"]["rms"] == 0 and rep["final"]["max_abs"] == 0
