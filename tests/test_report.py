"""`snakemake --report` of a finished demo run holds every figure and table."""

from __future__ import annotations

import copy
import json
import re

import pytest
from fixtures_demo import run_snakemake
from PIL import Image

from hsextract.report import all_zero_layers

FIGURES = ("lengths.png", "rejects.png", "chunks.png", "activations.png", "run.html")


@pytest.mark.workflow
def test_report_contains_every_figure(demo_run, tmp_path):
    rd = demo_run["run_dir"]
    for name in FIGURES:  # extract_all made them
        assert (rd / "report" / name).stat().st_size > 0, name
    for name in FIGURES[:4]:
        with Image.open(rd / "report" / name) as im:
            assert im.size[0] > 400 and im.size[1] > 150, (name, im.size)
    run = (rd / "report" / "run.html").read_text()
    assert "--chunked-prefill-size" in run and rd.name in run and "lossless" in run
    out = tmp_path / "report.html"
    run_snakemake(demo_run["workdir"], "--report", str(out))
    page = out.read_text()
    for name in FIGURES:
        assert name in page, f"{name} not in the report"
    for caption in ("Record lengths after the merge", "Input lines the merge rejected",
                    "extraction throughput", "RMS and max", "the GPU gate"):  # fmt: skip
        assert caption in page, caption
    assert re.search(r"1\. Data|2\. Extraction|3\. Activations", page)


def test_a_layer_of_zeros_is_named():
    layers = {"aux_2": {"rms": 0.5, "max_abs": 2.0}, "aux_4": {"rms": 0.0, "max_abs": 0.0}}
    side = {"chunk": "chunk_00000", "activation_stats": {"sample_every": 8, "layers": layers}}
    other = copy.deepcopy(side)
    assert all_zero_layers([side, other]) == ["aux_4"]
    other["activation_stats"]["layers"]["aux_4"]["rms"] = 1e-3  # zero in one chunk only
    assert all_zero_layers([side, other]) == []
    assert json.dumps(all_zero_layers([{"chunk": "c"}])) == "[]"
