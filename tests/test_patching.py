"""apply/verify/revert on a copy of each supported release's real ``deepseek_v2.py``, and its
patched ``DeepseekV2Model.forward`` executed on stand-in layers."""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fixtures_sglang import load_file_module
from safetensors import safe_open

from hsextract.capture import get_writer
from hsextract.sglang import patching, versions
from hsextract.sglang.patching import PatchError, apply, load_spec, revert, sha256_file, verify

TARGET = "srt/models/deepseek_v2.py"


@pytest.fixture
def root(release_pkg: Path, tmp_path: Path) -> Path:
    """A throwaway sglang package dir holding the real version file and patch target."""
    r = tmp_path / "site-packages" / "sglang"
    (r / "srt" / "models").mkdir(parents=True)
    shutil.copy2(release_pkg / "_version.py", r / "_version.py")
    shutil.copy2(release_pkg / TARGET, r / TARGET)
    return r


def test_manifest_records_the_real_pristine_sha(release: str, release_pkg: Path) -> None:
    spec = load_spec(release)
    assert spec.version == release and spec.target == TARGET
    assert sha256_file(release_pkg / TARGET) == spec.pristine_sha256
    assert patching.installed_version(release_pkg) == release


def test_the_0514_pristine_sha_is_the_recipes() -> None:
    # ../shared/sglang-h200/README.md: the file the live H200 server runs.
    assert load_spec("0.5.14").pristine_sha256 == (
        "947fdc256101f538a668090f82e5eb5f888e2434f2bbbf69a99cdaa628cf902e"
    )


def test_round_trip(root: Path, release: str) -> None:
    spec = load_spec(release)
    f = root / TARGET
    r = apply(root)
    assert r.action == "applied" and sha256_file(f) == spec.patched_sha256
    backup = f.with_name(f.name + patching.BACKUP_SUFFIX)
    assert sha256_file(backup) == spec.pristine_sha256
    ast.parse(f.read_text())  # the patched module still parses
    again = apply(root)
    assert again.action == "already-patched" and "already patched" in again.message
    assert sha256_file(f) == spec.patched_sha256
    assert verify(root).action == "verified"
    r = revert(root)
    assert r.action == "reverted" and sha256_file(f) == spec.pristine_sha256
    assert not backup.exists()
    assert revert(root).action == "already-pristine"
    with pytest.raises(PatchError, match="pristine"):
        verify(root)


def test_revert_without_backup_undoes_the_diff(root: Path, release: str) -> None:
    spec = load_spec(release)
    apply(root)
    (root / (TARGET + patching.BACKUP_SUFFIX)).unlink()
    revert(root)
    assert sha256_file(root / TARGET) == spec.pristine_sha256


@pytest.mark.parametrize("when", ["pristine", "patched"])
def test_tampered_file_is_refused_and_left_untouched(root: Path, when: str, release: str) -> None:
    f = root / TARGET
    if when == "patched":
        apply(root)
    f.write_text(f.read_text() + "# local edit\n")
    before = f.read_bytes()
    found = hashlib.sha256(before).hexdigest()
    spec = load_spec(release)
    for fn in (apply, revert, verify):
        with pytest.raises(PatchError) as e:
            fn(root)
        assert found in str(e.value)
        if fn is not verify:
            assert release in str(e.value) and spec.pristine_sha256 in str(e.value)
        assert f.read_bytes() == before


def test_unknown_version_is_refused_naming_the_known(root: Path, release: str) -> None:
    v = root / "_version.py"
    v.write_text(v.read_text().replace(release, "0.5.24"))
    before = (root / TARGET).read_bytes()
    with pytest.raises(PatchError, match="no patch for sglang 0.5.24") as e:
        apply(root)
    assert ", ".join(versions.known()) in str(e.value) and "capture: hooks" in str(e.value)
    assert "patches/port.py 0.5.24" in str(e.value)
    assert (root / TARGET).read_bytes() == before


def test_cli_writes_state(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], release: str
) -> None:
    parser = argparse.ArgumentParser()
    patching.register_cli(parser.add_subparsers())
    out = tmp_path / "state" / "patch.json"
    args = parser.parse_args(
        ["patch", "apply", "--sglang-root", str(root), "--state-out", str(out)]
    )
    assert args.func(args) == 0
    state = json.loads(out.read_text())
    spec = load_spec(release)
    assert state["version"] == release and state["action"] == "applied"
    assert state["path"] == str(root / TARGET)
    assert state["pristine_sha256"] == spec.pristine_sha256
    assert state["patched_sha256"] == spec.patched_sha256 == state["found_sha256"]
    args = parser.parse_args(["patch", "revert", "--sglang-root", str(root)])
    assert args.func(args) == 0
    args = parser.parse_args(["patch", "verify", "--sglang-root", str(root)])
    assert args.func(args) == 1
    assert "not patched" in capsys.readouterr().err


def test_patch_is_small_and_only_touches_the_forward(release: str, release_pkg: Path) -> None:
    spec = load_spec(release)
    diff = spec.diff.read_text()
    removed = [ln for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    added = [ln for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert len(removed) <= 4 and len(added) <= 48
    # hsextract is imported inside a function only (lazy), never at module level.
    patched = patching.apply_unified_diff((release_pkg / TARGET).read_text(), diff)
    tree = ast.parse(patched)
    top_imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert not any("hsextract" in ast.unparse(n) for n in top_imports)
    assert "from hsextract" in patched


def test_ensure_pinned_source_is_cached(
    release: str, release_pkg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A second call must not touch the network: make any subprocess a failure.
    def boom(*a: object, **k: object) -> None:
        raise AssertionError("ensure_pinned_source ran a subprocess on a warm cache")

    monkeypatch.setattr(patching.subprocess, "run", boom)
    assert patching.ensure_pinned_source(release) == release_pkg.parent
    assert (release_pkg / TARGET).is_file()


# --- the patched DeepseekV2Model.forward, executed (harness in fixtures_sglang.py) ---------

H = 8
L = 8
DEFAULT_LAYERS = [2, L // 2, L - 3]


@pytest.fixture
def fwd(release_forwards: SimpleNamespace) -> SimpleNamespace:
    """The release's patched and pristine forward and its stand-in model class."""
    return release_forwards


def _pass(
    h: Any,
    model: Any,
    reqs: list[tuple[str, torch.Tensor, int, int]],
    mode: str = "EXTEND",
) -> Any:
    """One forward over (rid, full ids, start, n) slices, shaped like SGLang's batch."""
    ids = torch.cat([full[s : s + n] for _, full, s, n in reqs])
    pos = torch.cat([torch.arange(s, s + n) for _, _, s, n in reqs])
    fb = SimpleNamespace(
        forward_mode=getattr(h.ForwardMode, mode),
        rids=[r for r, *_ in reqs],
        extend_prefix_lens_cpu=[s for _, _, s, _ in reqs],
        extend_seq_lens_cpu=[n for *_, n in reqs],
        can_run_tbo=False,
    )
    return h.forward(model, ids, pos, fb)


def _pieces(dump: Path) -> dict[str, list[tuple[int, dict[str, torch.Tensor], dict[str, str]]]]:
    w = get_writer()
    if w is not None:
        w.flush()  # the writer may be asynchronous
    out: dict[str, list[tuple[int, dict[str, torch.Tensor], dict[str, str]]]] = {}
    for f in sorted(dump.glob("*/*.safetensors")):
        with safe_open(str(f), "pt") as so:
            tensors = {k: so.get_tensor(k) for k in so.keys()}
            meta = so.metadata()
        out.setdefault(f.parent.name, []).append((int(f.stem), tensors, meta))
    return out


@pytest.fixture
def dump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "dump"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("SGLANG_HS_DUMP_DIR", str(d))
    monkeypatch.delenv("HSEXTRACT_AUX_LAYERS", raising=False)
    return d


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


def _check_request(model: Any, full: torch.Tensor, pieces: list, layers: list[int]) -> None:
    """Pieces cover [0, len) exactly once and hold the reference values."""
    pieces = sorted(pieces, key=lambda p: p[0])
    covered = []
    for start, t, meta in pieces:
        n = t["input_ids"].shape[0]
        covered.append((start, start + n))
        assert json.loads(meta["aux_layers"]) == layers
    assert covered[0][0] == 0 and covered[-1][1] == full.shape[0]
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))
    final, entering = model.reference(full)
    ids = torch.cat([t["input_ids"] for _, t, _ in pieces])
    hidden = torch.cat([t["hidden_states"] for _, t, _ in pieces])
    aux = torch.cat([t["aux_hidden_states"] for _, t, _ in pieces])
    assert torch.equal(ids, full)
    torch.testing.assert_close(hidden, final, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        aux, torch.cat([entering[i] for i in layers], dim=-1), rtol=1e-5, atol=1e-5
    )


def test_patched_forward_batch_of_several_requests(fwd: Any, dump: Path) -> None:
    model = fwd.Model(L, H)
    reqs = {f"r{i}": _ids(n, i) for i, n in enumerate([5, 3, 7])}
    out = _pass(fwd.patched, model, [(r, ids, 0, len(ids)) for r, ids in reqs.items()])
    assert isinstance(out, torch.Tensor)  # SGLang's own capture is off: output unchanged in kind
    got = _pieces(dump)
    assert sorted(got) == sorted(reqs)
    for rid, full in reqs.items():
        assert [p[0] for p in got[rid]] == [0]
        _check_request(model, full, got[rid], DEFAULT_LAYERS)


def test_patched_forward_request_split_over_extend_passes(fwd: Any, dump: Path) -> None:
    model = fwd.Model(L, H)
    a, b = _ids(10, 1), _ids(6, 2)
    # Chunked prefill: "a" arrives in three passes, sharing the middle one with "b".
    _pass(fwd.patched, model, [("a", a, 0, 4)])
    _pass(fwd.patched, model, [("b", b, 0, 6), ("a", a, 4, 3)])
    _pass(fwd.patched, model, [("a", a, 7, 3)])
    got = _pieces(dump)
    assert [p[0] for p in sorted(got["a"], key=lambda p: p[0])] == [0, 4, 7]
    _check_request(model, a, got["a"], DEFAULT_LAYERS)
    _check_request(model, b, got["b"], DEFAULT_LAYERS)


def test_patched_forward_configured_layers(
    fwd: Any, dump: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HSEXTRACT_AUX_LAYERS", json.dumps([0, 1, 6]))
    model = fwd.Model(L, H)
    full = _ids(9, 3)
    _pass(fwd.patched, model, [("c", full, 0, 9)])
    _check_request(model, full, _pieces(dump)["c"], [0, 1, 6])


def test_patched_forward_prenorm_final(
    fwd: Any, dump: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Aux index L (prenorm_final): the stream after the last layer, before the final
    norm, beside the aux layers; the final post-norm state unchanged."""
    monkeypatch.setenv("HSEXTRACT_AUX_LAYERS", json.dumps([2, 4, 5, L]))
    model = fwd.Model(L, H)
    a, b = _ids(9, 11), _ids(4, 12)
    _pass(fwd.patched, model, [("p", a, 0, 5)])
    _pass(fwd.patched, model, [("q", b, 0, 4), ("p", a, 5, 4)])
    got = _pieces(dump)
    _check_request(model, a, got["p"], [2, 4, 5, L])
    _check_request(model, b, got["q"], [2, 4, 5, L])
    final, entering = model.reference(a)
    assert not torch.allclose(entering[L], final)  # really before the norm, not after


@pytest.mark.parametrize("mode", ["DECODE", "IDLE", "TARGET_VERIFY"])
def test_patched_forward_non_extend_writes_nothing(fwd: Any, dump: Path, mode: str) -> None:
    model = fwd.Model(L, H)
    reqs = [("d", _ids(3, 4), 0, 3)] if mode != "DECODE" else [("d", _ids(6, 4), 5, 1)]
    out = _pass(fwd.patched, model, reqs, mode)
    assert torch.equal(out, _pass(fwd.pristine, model, reqs, mode))
    assert _pieces(dump) == {}


def test_patched_forward_rank_other_than_zero_writes_nothing(fwd: Any, dump: Path) -> None:
    model = fwd.Model(L, H)
    fwd.patched.tp_rank[0] = 1
    try:
        _pass(fwd.patched, model, [("e", _ids(4, 5), 0, 4)])
    finally:
        fwd.patched.tp_rank[0] = 0
    assert _pieces(dump) == {}


def test_patched_forward_env_unset_changes_nothing(
    fwd: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SGLANG_HS_DUMP_DIR", raising=False)
    # Lazy import: with the env unset, hsextract must not even be imported.
    monkeypatch.setitem(sys.modules, "hsextract.sglang.hooks", None)
    model = fwd.Model(L, H)
    model.layers_to_capture = [1, 4]
    reqs = [("f", _ids(5, 6), 0, 5), ("g", _ids(2, 7), 0, 2)]
    got = _pass(fwd.patched, model, reqs)
    want = _pass(fwd.pristine, model, reqs)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(x, y) for x, y in zip(got[1], want[1], strict=True))
    assert not any(tmp_path.rglob("*.safetensors"))


def test_patched_forward_keeps_sglang_aux_capture(fwd: Any, dump: Path) -> None:
    """SGLang's own layers_to_capture (EAGLE-3 serving) is unchanged while we dump."""
    model = fwd.Model(L, H)
    model.layers_to_capture = [2, 3]  # overlaps the dump's [2, 4, 5] in one layer
    reqs = [("h", _ids(6, 8), 0, 6)]
    hidden, aux = _pass(fwd.patched, model, reqs)
    want_hidden, want_aux = _pass(fwd.pristine, model, reqs)
    assert torch.equal(hidden, want_hidden)
    assert all(torch.equal(x, y) for x, y in zip(aux, want_aux, strict=True))
    _check_request(model, reqs[0][1], _pieces(dump)["h"], DEFAULT_LAYERS)


def test_port_writes_the_committed_patch(release: str, release_pkg: Path, tmp_path: Path) -> None:
    """patches/port.py (how a new release gets its patch) rebuilds every committed patch
    and manifest byte for byte from the release's own file."""
    port = load_file_module(patching.PATCHES_DIR / "port.py", "_hsextract_port")
    out = port.write(release, release_pkg, tmp_path)
    for name in ("deepseek_v2.py.patch", "manifest.json"):
        assert (out / name).read_bytes() == (patching.PATCHES_DIR / out.name / name).read_bytes()
