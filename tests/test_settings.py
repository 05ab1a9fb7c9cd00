"""hsextract.settings: the generated schema and typed config are up to date, every key the
code reads is declared, and every key's declared kind is what a change of it does."""

from __future__ import annotations

import copy
import re

import pytest
import yaml
from snakemake.utils import validate as sm_validate

from hsextract import settings
from hsextract.config import (
    SCHEMA_PATH,
    fingerprint,
    load_config,
    read_config,
    run_dir,
    settings_digest,
    typed,
)
from hsextract.errors import ConfigError
from hsextract.export.specforge import settings_file as specforge_settings_file
from hsextract.settings import GROUPS, SETTINGS, STAGES, kinds_with
from hsextract.stages import stage_settings
from tests.fixtures_demo import REPO, planned_jobs, run_snakemake

#: The demo's run dir since before this module existed: declaring the settings moved nothing.
DEMO_FINGERPRINT = "05c8dd86c3d5"


def test_generated_schema_and_types_are_up_to_date():
    # docs/configuration.md is generated too: tests/test_settings_doc.py checks it.
    assert SCHEMA_PATH.read_text() == settings.schema_yaml(), (
        "schemas/config.schema.yaml is stale: python -m hsextract.settings --schema > "
        "schemas/config.schema.yaml"
    )
    types = REPO / "src" / "hsextract" / "config_types.py"
    assert types.read_text() == settings.python_types(), (
        "src/hsextract/config_types.py is stale: python -m hsextract.settings --types > "
        "src/hsextract/config_types.py"
    )


def test_the_typed_config_holds_every_declared_key_as_validated():
    """typed(cfg): each declared key at its dotted attribute, with the validated value (a
    list as a tuple); a key left out of the dict gets its declared default."""
    for path in [REPO / "config.yaml", *sorted((REPO / "configs").glob("*.yaml"))]:
        cfg = load_config(path)
        obj = typed(cfg)
        assert obj.raw is cfg
        for key in SETTINGS:
            want = _get(cfg, key)
            want = tuple(want) if isinstance(want, list) else want
            assert _attr(obj, key) == want, f"{path.name}: {key}"
    bare = {"output_root": "r", "max_seq_len": 8, "seed": 0, "engine": "sglang"}
    obj = typed({**bare, "model": {"path": "m", "dtype": "bfloat16"}})
    for s in SETTINGS.values():
        if not s.required:
            want = tuple(s.default) if isinstance(s.default, list) else s.default
            assert _attr(obj, s.key) == want, s.key
    with pytest.raises(ConfigError, match="model"):
        typed(bare)


def _attr(obj, key: str):
    for p in key.split("."):
        obj = getattr(obj, p)
    return obj


def _leaves(cfg: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        out |= _leaves(v, key + ".") if key in GROUPS else {key}
    return out


def test_every_key_is_declared_and_every_declared_key_exists():
    for path in [REPO / "config.yaml", *sorted((REPO / "configs").glob("*.yaml"))]:
        cfg = yaml.safe_load(path.read_text())
        sm_validate(cfg, str(SCHEMA_PATH), set_default=True)
        assert _leaves(cfg) <= set(SETTINGS), f"{path.name}: undeclared keys"
    # The embedded default, with the schema's defaults filled, holds every declared key.
    assert _leaves(cfg_default()) == set(SETTINGS)
    # Every literal key chain the code reads (cfg["server"]["host"], config['demo']...).
    # (src names the workflow config cfg; `config` there is a model's, as in hooks.py.)
    chain = r"""\[["'](\w+)["']\](?:\[["'](\w+)["']\])?"""
    files = [(f, "cfg") for f in (REPO / "src").rglob("*.py")]
    files += [(f, "config") for f in [*(REPO / "rules").glob("*.smk"), REPO / "Snakefile"]]
    for f, name in files:
        for m in re.finditer(rf"\b{name}{chain}", f.read_text()):
            top, sub = m.groups()
            key = f"{top}.{sub}" if top in GROUPS and sub else top
            assert key in SETTINGS or key in GROUPS, f"{f.name} reads undeclared {key}"
    # And every typed read (cfg.server.host; the rules' CFG).
    attrs = r"\.([a-z]\w*)(?:\.([a-z]\w*))?"
    files = [(f, "cfg") for f in (REPO / "src").rglob("*.py")]
    files += [(f, "CFG") for f in [*(REPO / "rules").glob("*.smk"), REPO / "Snakefile"]]
    for f, name in files:
        for m in re.finditer(rf"\b{name}{attrs}", f.read_text()):
            top, sub = m.groups()
            if top in ("get", "raw"):
                continue  # a dict's get (validation), the dict a Config was built from
            key = f"{top}.{sub}" if top in GROUPS and sub else top
            assert key in SETTINGS or key in GROUPS, f"{f.name} reads undeclared {key}"


def test_the_demo_fingerprint_is_unchanged():
    assert fingerprint(read_config(REPO / "config.yaml")) == DEMO_FINGERPRINT


def cfg_default() -> dict:
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    sm_validate(cfg, str(SCHEMA_PATH), set_default=True)
    return cfg


def _set(cfg: dict, key: str, value) -> dict:
    node = cfg
    *parents, last = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = copy.deepcopy(value)
    return cfg


def _get(cfg: dict, key: str):
    for p in key.split("."):
        cfg = cfg[p]
    return cfg


def names(cfg: dict) -> dict[str, str | None]:
    """What rules/common.smk derives from a config: the run dir and each stage's settings
    file name (None: the stage is not part of this config's workflow)."""
    c = typed(cfg)
    stages = stage_settings(c)
    out: dict[str, str | None] = {"run_dir": str(run_dir(c)), "fingerprint": fingerprint(c)}
    for stage in STAGES:
        out[stage] = settings_digest(stages[stage]) if stage in stages else None
    out["specforge"] = specforge_settings_file(".", cfg["export"]["specforge"]["gzip"]).name
    return out


def test_every_key_does_what_its_kind_says(demo_copy, monkeypatch):
    """For each declared key, on a finished demo run and on the same config with the sglang
    engine: a change of it to its sample gives a new run dir exactly when its kind is
    fingerprint, and renames exactly the settings files it declares (nothing for neither)."""
    monkeypatch.chdir(demo_copy["workdir"])
    wrong = []
    for engine in ("reference", "sglang"):
        for s in SETTINGS.values():
            base = _set(cfg_default(), "engine", engine)
            for k, v in s.sample_with.items():
                _set(base, k, v)
            if s.key == "engine" and _get(base, "engine") == s.sample:
                continue  # engine's sample is the other engine: checked on the reference base
            changed = _set(copy.deepcopy(base), s.key, s.sample)
            sm_validate(changed, str(SCHEMA_PATH), set_default=True)
            before, after = names(base), names(changed)
            kinds = kinds_with(s, engine)
            expect = {
                "fingerprint": "fingerprint" in kinds,
                "run_dir": bool({"fingerprint", "run location"} & set(kinds)),
                **{st: st in s.stages and kinds != ("neither",) for st in STAGES},
            }
            got = {name: before[name] != after[name] for name in expect}
            if got != expect:
                diff = {
                    n: f"declared {expect[n]}, does {got[n]}" for n in expect if got[n] != expect[n]
                }
                wrong.append(f"{s.key} ({engine} engine, {kinds}): {diff}")
    assert not wrong, "keys whose change disagrees with their declaration:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("key", "reruns", "keeps"),
    [
        ("client.retries", set(), set()),  # neither: nothing to do
        (
            "server.max_running_requests",
            {"launch_server"},
            {"merge_and_shuffle", "delete_stale_states"},
        ),
        # The stages after a rerun stage rerun too (launch_server after delete_stale_states).
        ("stale.keep_runs", {"delete_stale_states"}, {"merge_and_shuffle", "split_chunks"}),
        ("seed", {"merge_and_shuffle"}, {"demo_data", "demo_model"}),
    ],
)
def test_a_sample_of_kinds_through_snakemake(demo_copy, key, reruns, keeps):
    """The computed names above are what Snakemake plans on: a dry run after the change."""
    workdir = demo_copy["workdir"]
    assert "Nothing to be done" in run_snakemake(workdir, "-n", "extract_all").stdout
    cfg = yaml.safe_load((workdir / "config.yaml").read_text())
    (workdir / "config.yaml").write_text(yaml.safe_dump(_set(cfg, key, SETTINGS[key].sample)))
    out = run_snakemake(workdir, "-n", "extract_all").stdout
    jobs = set(planned_jobs(out))
    if not reruns:
        assert "Nothing to be done" in out, f"{key}: {jobs}"
    assert reruns <= jobs and not keeps & jobs, f"{key} planned {jobs}"
