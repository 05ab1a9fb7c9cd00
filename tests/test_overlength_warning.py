"""Records cut or dropped at max_seq_len beyond merge.warn_overlength_fraction are said on
the terminal, naming where max_seq_len came from (issue 38, item 5): with the demo's
config.yaml layered under a user's file, its max_seq_len: 512 truncated 20 of 30 records
and only the merge's log said so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fixtures_demo import own_config, run_snakemake

from hsextract.config import where_set
from hsextract.steps import overlength_warning


def _stats(truncated: int, dropped: int, records_in: int = 30) -> dict:
    return {
        "params": {"max_seq_len": 512},
        "truncated": truncated,
        "dropped_over_length": dropped,
        "records_in": records_in,
    }


@pytest.mark.parametrize(
    ("truncated", "dropped", "said"),
    [(0, 0, None), (1, 0, None), (2, 0, None), (2, 1, "truncated (2) or dropped (1)"),
     (20, 0, "truncated to it"), (0, 4, "dropped")],
)  # fmt: skip
def test_the_warning_says_how_many_of_how_many_and_where_max_seq_len_came_from(
    truncated: int, dropped: int, said: str | None
) -> None:
    """Beyond the bound (0.07 of 30: more than 2 records) one sentence with the counts,
    max_seq_len, the file that set it, the key that silences it and what to do."""
    msg = overlength_warning(_stats(truncated, dropped), 0.07, "config file base.yaml")
    if said is None:
        assert msg is None
        return
    n = truncated + dropped
    assert msg is not None and msg.startswith(f"{n} of 30 records ({n / 30:.1%}) were longer ")
    assert "max_seq_len 512 (from config file base.yaml)" in msg and said in msg
    assert "merge.warn_overlength_fraction=0.07" in msg and "set it in your config" in msg


def test_where_set_names_the_source_load_config_took_the_value_from(tmp_path: Path) -> None:
    base, mine = tmp_path / "base.yaml", tmp_path / "my.yaml"
    base.write_text("max_seq_len: 512\nmerge: {overlength: drop}\n")
    mine.write_text("seed: 3\n")
    assert where_set("max_seq_len", [base, mine]) == f"config file {base}"
    mine.write_text("max_seq_len: 300\n")
    assert where_set("max_seq_len", [base, mine]) == f"config file {mine}"
    assert where_set("max_seq_len", [base, mine], {"max_seq_len": "64"}) == "--config"
    assert where_set("merge.overlength", [base, mine]) == f"config file {base}"
    assert where_set("merge.overlength", [mine], {"merge": {"overlength": "x"}}) == "--config"
    assert where_set("merge.max_reject_fraction", [base, mine]) == "the default"


@pytest.mark.workflow
def test_a_max_seq_len_from_another_file_that_cuts_most_records_is_said_on_the_terminal(
    demo_run, tmp_path
):
    """The workflow: a base file sets max_seq_len 40 (most demo records are longer), the
    user's file on top does not; the merge's stderr names the count and base.yaml."""
    cfg = own_config(demo_run, tmp_path)
    cfg.pop("max_seq_len")
    cfg["server"] = {"chunked_prefill_size": 16}
    base, mine = tmp_path / "base.yaml", tmp_path / "my.yaml"
    base.write_text(yaml.safe_dump({"max_seq_len": 40}))
    mine.write_text(yaml.safe_dump(cfg))
    files = [str(base), str(mine)]
    out = subprocess.run(
        [sys.executable, "-m", "hsextract.cli", "run-dir", "--configfile", *files],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    train = Path(out.stdout.strip()) / "merged" / "train.jsonl"
    proc = run_snakemake(tmp_path, "-j1", str(train), "--configfile", *files)
    said = [ln for ln in proc.stderr.splitlines() if "records (" in ln and "max_seq_len" in ln]
    assert len(said) == 1, proc.stderr[-3000:]
    assert said[0].startswith("hsextract [merge_and_shuffle]: ")
    assert f"were longer than max_seq_len 40 (from config file {base})" in said[0], said
    assert "merge.warn_overlength_fraction=0.05" in said[0]
