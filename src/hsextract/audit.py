"""The audit: a sample of the run's stored states against HF transformers' forward of the model.

Why: the capture is proven on the models the project builds; a user runs their own model,
SGLang release and flags, where a layer indexed differently, a norm taken in another place
or positions off by one give states that are finite, of the right shape and wrong -- and
nothing said so until a drafter trained on them did not accept.  So every run ends by
recomputing a seeded sample of its records with a plain HF forward of ``model.path`` and
comparing every captured tensor (each aux layer, the final state, the pre-norm state where
captured) with what the chunk files hold.

Figures per layer: relative RMS error (pooled over the sample, and the worst record's) and
cosine; for the final state the top-1 agreement of the LM head.  The bound comes from the
run's own dtype (:func:`judge`): fp32 against a fixed floor, bf16/fp16 against the noise of
that dtype measured on the same records (the same forward in the run's dtype and in fp32).

Outcome: ``state/audit.json`` (the rule's output) when it passes or warns; on a failure
``state/audit.failed.json`` -- the "unaudited" mark, not a rule output, so Snakemake's
removal of a failed job's outputs leaves it, as it leaves every chunk and the manifest --
and an :class:`AuditFailed` whose message is one sentence naming the layer, the records and
the figure.  A passing audit removes the mark.

Imports stay light at module level (``hsextract status`` reads the outcome): torch and
transformers are imported by the functions that compute.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsextract.commands import snakemake_command
from hsextract.errors import HsextractError

#: Where the outcome lives, relative to the run dir.
AUDIT_FILE = "state/audit.json"
#: The "unaudited" mark: a failed audit's figures and sentence; cleared by a passing one.
FAILED_FILE = "state/audit.failed.json"
#: Under a disk budget, the sampled records' states set aside when their chunk is written.
SAMPLES_DIR = "state/audit/samples"
#: fp32 runs: the relative RMS error a correct capture stays far below (measured: ~1e-7 on
#: the demo); 5x this (0.5 %) fails, 2x warns.
FP32_FLOOR = 1e-3
WARN_X, FAIL_X = 2.0, 5.0
#: Bytes a float32 copy of a parameter takes; the audit runs one forward in float32.
_F32 = 4
#: Headroom over the weights for activations, the hooks' copies and the allocator.
_MEM_HEADROOM = 1.3


class AuditFailed(HsextractError):
    """The stored states disagree with the model's forward beyond the run's bound."""


class AuditRefused(HsextractError):
    """The audit cannot run as configured (another model at model.path, no memory): it
    says why and what to set; it never passes silently."""


# -- the sample ------------------------------------------------------------------------


def sample(chunks: list[dict], k: int, seed: int) -> dict[str, list[int]]:
    """``k`` records spread over the run, seeded: chunk name -> record positions.

    Stratified over the records in chunk order (one pick in each of ``k`` equal strata),
    so every part of the run is sampled, each chunk in proportion to its records, and the
    same config picks the same records whoever asks (the chunk job that sets them aside
    and the audit that reads them).
    """
    sizes = [int(c["records"]) for c in chunks]
    total = sum(sizes)
    k = min(k, total)
    if k <= 0:
        return {}
    rng = random.Random(f"hsextract-audit:{seed}")
    picks = sorted({int((i + rng.random()) * total / k) for i in range(k)})
    out: dict[str, list[int]] = {}
    start, ci = 0, 0
    for g in picks:
        while g >= start + sizes[ci]:
            start += sizes[ci]
            ci += 1
        out.setdefault(Path(chunks[ci]["path"]).stem, []).append(g - start)
    return out


def _picks_for(cfg: Any, index: Path, chunk: str) -> list[int]:
    from hsextract.records import read_index

    return sample(read_index(index)["chunks"], cfg.audit.records, cfg.seed).get(chunk, [])


def sample_file(run_dir: Path, chunk: str) -> Path:
    return Path(run_dir) / SAMPLES_DIR / f"{chunk}.safetensors"


def set_aside(cfg: Any, run_dir: Path, chunk_path: Path, sha256: str, index: Path) -> Path | None:
    """Under a disk budget, copy the sampled records' states of a chunk just written to
    :func:`sample_file` (the stream deletes the chunk once the trainer acks it, possibly
    before the audit runs).  None when there is nothing to set aside.

    The chunk was hashed by this job a moment ago (its sidecar's sha256), so it is read
    unverified; the copy carries that sha256 and the record ids, and is written to a
    temporary name and renamed like every file of the run.
    """
    if cfg.audit.records <= 0 or cfg.stream.budget_gb is None:
        return None
    import torch
    from safetensors.torch import save_file

    from hsextract.chunks import ChunkReader

    chunk = Path(chunk_path).stem
    out = sample_file(run_dir, chunk)
    picks = _picks_for(cfg, index, chunk)
    if not picks:
        out.unlink(missing_ok=True)
        return None
    reader = ChunkReader(chunk_path, verify=False)
    tensors: dict[str, torch.Tensor] = {}
    ids = []
    for j in picks:
        item = reader[j]
        ids.append(item["id"])
        for name in ("input_ids", "hidden_states", "aux_hidden_states", "prenorm_hidden_states"):
            if name in item:
                tensors[f"{j}/{name}"] = item[name].contiguous().clone()  # type: ignore[union-attr]
    meta = {
        "chunk": chunk,
        "chunk_sha256": sha256,
        "positions": json.dumps(picks),
        "record_ids": json.dumps(ids),
        "aux_layers": json.dumps(reader.aux_layers),
        "prenorm": json.dumps(reader.prenorm),
        "hidden_size": str(reader.hidden_size),
        "dtype": str(reader.dtype).removeprefix("torch."),
        "codec": reader.codec,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out


# -- the records as stored -------------------------------------------------------------


@dataclass
class Stored:
    """One sampled record as the run stored it: its tokens and every captured tensor, keyed
    by aux index (the pre-norm state under L) and ``"final"``."""

    chunk: str
    position: int
    id: str
    input_ids: list[int]
    states: dict[int | str, Any] = field(default_factory=dict)


def _split(item: dict, aux_layers: list[int], hidden: int, prenorm: bool, num_layers: int):
    states: dict[int | str, Any] = {"final": item["hidden_states"]}
    aux = item["aux_hidden_states"]
    for i, layer in enumerate(aux_layers):
        states[layer] = aux[:, i * hidden : (i + 1) * hidden]
    if prenorm:
        states[num_layers] = item["prenorm_hidden_states"]
    return states


def stored_records(cfg: Any, run_dir: Path, manifest: dict, num_layers: int) -> list[Stored]:
    """The sample's records as stored: read through ChunkReader (each chunk's sha256 checked
    against its sidecar), or under a disk budget from what the chunk jobs set aside."""
    from hsextract.chunks import ChunkReader

    run_dir = Path(run_dir)
    out: list[Stored] = []
    if cfg.stream.budget_gb is not None:
        return _set_aside_records(cfg, run_dir, manifest, num_layers)
    picks = sample(manifest["chunks"], cfg.audit.records, cfg.seed)
    for c in manifest["chunks"]:
        chunk = Path(c["path"]).stem
        if chunk not in picks:
            continue
        reader = ChunkReader(run_dir / c["path"], expected_sha256=c.get("sha256"))
        for j in picks[chunk]:
            item = reader[j]
            states = _split(item, reader.aux_layers, reader.hidden_size, reader.prenorm, num_layers)
            ids = item["input_ids"].tolist()  # type: ignore[union-attr]
            out.append(Stored(chunk, j, str(item["id"]), ids, states))
    return out


def _set_aside_records(cfg: Any, run_dir: Path, manifest: dict, num_layers: int) -> list[Stored]:
    from safetensors import safe_open

    out: list[Stored] = []
    picks = sample(manifest["chunks"], cfg.audit.records, cfg.seed)
    for c in manifest["chunks"]:
        chunk = Path(c["path"]).stem
        if chunk not in picks:
            continue
        path = sample_file(run_dir, chunk)
        if not path.exists():
            sidecar = run_dir / c["path"].replace(".safetensors", ".json")
            raise AuditRefused(
                f"{path} is missing: the states of {chunk}'s sampled records were not set "
                "aside when it was written (a chunk extracted before the audit was on, or "
                f"with another audit.records); redo it with "
                f"`{snakemake_command('--forcerun', sidecar, run_dir=run_dir)}`"
            )
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            if meta.get("chunk_sha256") != c.get("sha256"):
                raise AuditRefused(
                    f"{path} was set aside from another version of {chunk} (sha256 "
                    f"{meta.get('chunk_sha256')}, the manifest's {c.get('sha256')}): redo "
                    "the chunk, which sets its sample aside again"
                )
            positions = json.loads(meta["positions"])
            if positions != picks[chunk]:
                raise AuditRefused(
                    f"{path} holds records {positions} of {chunk}, the audit samples "
                    f"{picks[chunk]} (audit.records or seed changed since it was written): "
                    "redo the chunk, or set them back"
                )
            ids = json.loads(meta["record_ids"])
            aux_layers = json.loads(meta["aux_layers"])
            prenorm = json.loads(meta["prenorm"])
            hidden = int(meta["hidden_size"])
            for j, rid in zip(positions, ids, strict=True):
                item = {
                    n: f.get_tensor(f"{j}/{n}")
                    for n in ("input_ids", "hidden_states", "aux_hidden_states")
                }
                if prenorm:
                    item["prenorm_hidden_states"] = f.get_tensor(f"{j}/prenorm_hidden_states")
                states = _split(item, aux_layers, hidden, prenorm, num_layers)
                out.append(Stored(chunk, j, rid, item["input_ids"].tolist(), states))
    return out


# -- where it runs, and for how long ---------------------------------------------------


def checkpoint_params(model_path: Path) -> int:
    """Parameters of the checkpoint, from its safetensors headers (no tensor is read); for
    other formats the weight files' bytes over 2 (bf16)."""
    import struct

    n = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, t in header.items():
            if name != "__metadata__":
                n += math.prod(t["shape"])
    if n == 0:
        n = sum(p.stat().st_size for p in Path(model_path).glob("*.bin")) // 2
    return n


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_flops() -> float:
    """This CPU's float32 matmul rate, measured now (a fraction of a second): the basis
    of the time estimate printed before a CPU audit starts."""
    import torch

    a = torch.randn(384, 384)
    torch.mm(a, a)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        torch.mm(a, a)
        n += 1
    return 2 * 384**3 * n / (time.perf_counter() - t0)


@dataclass
class Placement:
    device: str
    #: ``device_map`` for from_pretrained (several GPUs), else None.
    device_map: Any
    estimate_s: float | None
    text: str
    #: The model does not fit but one decoder layer does: the forward runs one module at
    #: a time, its weights read from the checkpoint once (hsextract.layered).
    layered: bool = False


@dataclass
class Sizes:
    """What :func:`place` weighs: the checkpoint's parameters, its largest unit the layered
    forward holds at once (a decoder layer, the embedding or the LM head), and the sampled
    records' states that forward keeps (their streams and the captured float64 copies)."""

    params: int
    tokens: int
    passes: int
    layer_params: int = 0
    states_bytes: int = 0
    #: Why the layered forward cannot load this checkpoint (quantized, ...); None if it can.
    layered_refused: str | None = None

    def need(self) -> int:
        """Bytes the in-memory forward needs: the float32 model, headroom, the states."""
        return int(self.params * _F32 * _MEM_HEADROOM) + self.states_bytes

    def layered_need(self) -> int:
        """Bytes the layered forward needs: its largest unit in float32, the states."""
        return int(self.layer_params * _F32 * _MEM_HEADROOM) + self.states_bytes


def place(cfg: Any, run_dir: Path, sizes: Sizes, say: Callable[[str], None]) -> Placement:
    """On the GPUs the server has just freed when CUDA is here (the server is stopped, the
    GPU gate's checks run), else on the CPU with its time estimated and said up front.
    A model that does not fit is run layer by layer where one layer fits; one whose single
    layer does not fit either is refused in one sentence naming what to set."""
    import torch

    params = sizes.params
    need = sizes.need()
    wants_gpu = cfg.engine == "sglang" or cfg.server.device == "cuda"
    if wants_gpu and torch.cuda.is_available():
        from hsextract import server
        from hsextract.gpu import gate

        if server.stop_live(Path(run_dir) / "state"):
            say("stopped the extraction server to free its GPUs for the audit")
        # At least a minute: a stopped server's ranks free their memory a moment after.
        wait = max(cfg.gpu.wait_s, 60.0)
        gate(cfg.gpu.max_used_mib, wait, require_nvml=cfg.engine == "sglang")
        n = torch.cuda.device_count()
        free = [torch.cuda.mem_get_info(i)[0] for i in range(n)]
        if need <= free[0]:
            return Placement("cuda:0", None, None, f"on cuda:0 ({params:,} parameters)")
        try:
            import accelerate  # noqa: F401 - device_map over several GPUs needs it
        except ImportError:
            accelerate = None
        if accelerate is not None and need <= sum(free):
            return Placement("cuda", "auto", None, f"over {n} GPUs (device_map auto)")
        if sizes.layered_refused is None and sizes.layered_need() <= free[0]:
            return Placement(
                "cuda:0", None, None, _layered_text(need, free[0], "cuda:0", sizes), True
            )
        if need <= sum(free):  # several GPUs would hold it, one layer at a time would not
            raise AuditRefused(
                f"the audit needs {need / 2**30:.1f} GiB, more than one GPU's "
                f"{free[0] / 2**30:.1f} GiB free, and spreading it over {n} GPUs needs the "
                "accelerate package: pip install accelerate in this env, or set "
                "audit.records: 0 to leave the run unaudited"
            )
        raise _too_large(need, sum(free), f"{n} GPU(s)", run_dir, sizes)
    avail = _mem_available()
    flops = 2.0 * params * sizes.tokens * sizes.passes
    if avail and need > avail:
        if sizes.layered_refused is not None or sizes.layered_need() > avail:
            raise _too_large(need, avail, "the CPU's memory", run_dir, sizes)
        est = flops / max(cpu_flops(), 1.0)
        return Placement("cpu", None, est, _layered_text(need, avail, "the CPU", sizes, est), True)
    est = flops / max(cpu_flops(), 1.0)
    return Placement(
        "cpu",
        None,
        est,
        f"on the CPU: {sizes.passes} forward(s) of {params:,} parameters over "
        f"{sizes.tokens:,} tokens, at least {est:.1f}s at the matmul rate measured now (a "
        "first record's forward gives a closer figure), plus loading the weights",
    )


def _layered_text(need: int, have: int, where: str, sizes: Sizes, est: float | None = None) -> str:
    time_ = (
        f"at least {est:.1f}s of forwards at the matmul rate measured now, plus reading "
        f"the weights once (the first layer's time gives a closer figure)"
        if est is not None
        else "the first layer's time gives the estimate"
    )
    return (
        f"layer by layer on {where}, streaming the weights from disk (the whole model's "
        f"float32 forward needs about {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB are "
        f"free; one layer and the records' states need about "
        f"{sizes.layered_need() / 2**30:.1f} GiB): each decoder layer read once and run "
        f"over every record, {sizes.passes} forward(s) of {sizes.params:,} parameters over "
        f"{sizes.tokens:,} tokens; {time_}"
    )


def _too_large(need: int, have: int, where: str, run_dir: Path, sizes: Sizes) -> AuditRefused:
    redo = snakemake_command(Path(run_dir) / AUDIT_FILE, run_dir=run_dir)
    if sizes.layered_refused is not None:
        layered = f", and it cannot run layer by layer ({sizes.layered_refused})"
    else:
        layered = (
            f", and even layer by layer (one decoder layer in memory at a time, streamed "
            f"from disk) it needs about {sizes.layered_need() / 2**30:.1f} GiB"
        )
    return AuditRefused(
        f"the audit's float32 forward needs about {need / 2**30:.1f} GiB and {where} "
        f"{'have' if 'GPU' in where else 'has'} {have / 2**30:.1f} GiB free{layered}: run "
        f"it where the model fits (`{redo}` there), or set "
        "audit.records: 0 to leave the run unaudited (hsextract status then says so)"
    )


# -- the forward -----------------------------------------------------------------------


def _decoder(model: Any) -> Any:
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def forward_states(model: Any, ids: list[int], wanted: set[int], num_layers: int) -> dict:
    """The states a capture takes, by hooks on one HF forward: the stream entering each
    wanted decoder layer (index L: entering the final norm, i.e. before it) and the final
    state after the norm.  Float64 on the CPU: the comparison's own error stays out."""
    import torch

    dec = _decoder(model)
    out: dict[int | str, torch.Tensor] = {}
    handles = []

    def entering(i: int):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            out[i] = h[0].detach().to("cpu", torch.float64)

        return hook

    for i in wanted:
        if i < num_layers:
            handles.append(dec.layers[i].register_forward_pre_hook(entering(i), with_kwargs=True))
    if num_layers in wanted:
        handles.append(dec.norm.register_forward_pre_hook(entering(num_layers), with_kwargs=True))

    def final(module, args, result):
        out["final"] = result[0].detach().to("cpu", torch.float64)

    handles.append(dec.norm.register_forward_hook(final))
    try:
        with torch.inference_mode():
            dev = next(model.parameters()).device
            dec(input_ids=torch.tensor([ids], device=dev), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return out


def top1(model: Any, states: Any) -> Any:
    """The LM head's top-1 token per row of final states."""
    import torch

    head = model.get_output_embeddings()
    w = head.weight
    with torch.inference_mode():
        return head(states.to(w.device, w.dtype)).argmax(-1).cpu()


# -- the figures and the verdict -------------------------------------------------------


def _rel(err_sq: float, ref_sq: float) -> float:
    return math.sqrt(err_sq / ref_sq) if ref_sq > 0 else (0.0 if err_sq == 0 else math.inf)


def compare(stored, ref) -> dict[str, float]:
    """Relative RMS error and mean per-token cosine of stored vs reference [T, H]."""
    import torch

    s = stored.to(torch.float64)
    err_sq = float((s - ref).square().sum())
    ref_sq = float(ref.square().sum())
    cos = torch.nn.functional.cosine_similarity(s, ref, dim=-1, eps=1e-30)
    return {"err_sq": err_sq, "ref_sq": ref_sq, "cos_sum": float(cos.sum()), "n": int(s.shape[0])}


def layer_name(key: int | str, num_layers: int) -> str:
    if key == "final":
        return "final state (after the norm)"
    if key == num_layers:
        return f"pre-norm final state (aux {key})"
    return f"aux layer {key}"


def judge(error: float, noise: float) -> str:
    """``pass`` up to 2x the noise bound, ``warn`` to 5x, ``fail`` above."""
    if error > FAIL_X * noise:
        return "fail"
    return "warn" if error > WARN_X * noise else "pass"


def _fp8_noise(ref) -> tuple[float, float]:
    """What the fp8 codec alone does to a reference state: (err_sq, ref_sq)."""
    import torch

    from hsextract.storage import fp8_dequantize, fp8_quantize

    x = ref.to(torch.float32).unsqueeze(1)
    q, scale = fp8_quantize(x)
    back = fp8_dequantize(q, scale, torch.float32).squeeze(1).to(torch.float64)
    return float((back - ref).square().sum()), float(ref.square().sum())


def _as_other(key: int | str, num_layers: int) -> str:
    if key == "final":
        return "the final state after the norm"
    if key == num_layers:
        return "the state before the final norm"
    return f"the stream entering layer {key}"


def _diagnose(stored, refs: dict, key: int | str, num_layers: int) -> str | None:
    """What a failing stored tensor matches instead, if another state of the same record's
    forward (a neighbouring layer, the other side of the final norm) fits it within 1 %:
    the usual wrong captures name themselves."""
    import torch

    s = stored.to(torch.float64)
    for other, t in refs.items():
        if other == key or t.shape != s.shape:
            continue
        if _rel(float((s - t).square().sum()), float(t.square().sum())) < 0.01:
            return f"it matches {_as_other(other, num_layers)} instead"
    return None


def _in_memory(
    model_path: str | os.PathLike[str],
    records: list[Stored],
    wanted: set[int],
    noise_keys: set[int],
    num_layers: int,
    run_dtype: str,
    where: Placement,
    say: Callable[[str], None] | None,
) -> Any:
    """The whole model loaded at once (it fits): the reference states, the LM head's top-1,
    and for a bf16/fp16 run the same in that dtype, the weights cast in place."""
    import torch
    from transformers import AutoModelForCausalLM

    from hsextract.layered import Reference

    tokens = sum(len(r.input_ids) for r in records)
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if where.device_map is not None:
        kwargs["device_map"] = where.device_map
    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).eval()
    if where.device_map is None:
        model.to(where.device)
    t0 = time.monotonic()
    refs = [forward_states(model, records[0].input_ids, wanted, num_layers)]
    first = time.monotonic() - t0
    if say is not None:  # the estimate from a forward measured here (the FLOP count's
        # basis, the matmul rate, misses what a small model spends outside its matmuls)
        n0 = len(records[0].input_ids)
        passes = 1 if run_dtype == "float32" else 2
        rest = first * (passes * tokens / max(n0, 1) - 1)
        say(f"the first record's forward: {first:.2f}s for {n0:,} tokens; about {rest:.1f}s left")
    refs += [forward_states(model, r.input_ids, wanted, num_layers) for r in records[1:]]
    out = Reference(
        refs,
        [top1(model, ref["final"]) for ref in refs],
        [top1(model, r.states["final"]) for r in records],
    )
    if run_dtype != "float32":
        model.to(getattr(torch, run_dtype))
        out.noise_refs = [
            forward_states(model, r.input_ids, noise_keys, num_layers) for r in records
        ]
        out.noise_top1 = [top1(model, n["final"]) for n in out.noise_refs]
    del model
    return out


def measure(
    model_path: str | os.PathLike[str],
    records: list[Stored],
    num_layers: int,
    run_dtype: str,
    codec: str | None,
    where: Placement,
    say: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """The figures and verdict of every stored tensor of ``records`` against HF's forward
    of the model at ``model_path``: in float32 (the reference), and for a bf16/fp16 run
    again in that dtype (its noise, the bound's basis), the same weights cast in place.
    Where the model does not fit (``where.layered``) the same forward runs one module at a
    time (hsextract.layered), giving the same states."""
    keys = [k for k in records[0].states if k != "final"]
    # Neighbours and the norm's input too: a failure says what the stored tensor matches.
    wanted = set(keys) | {k + d for k in keys for d in (-1, 1) if 0 <= k + d <= num_layers}
    wanted.add(num_layers)
    tokens = sum(len(r.input_ids) for r in records)
    if where.layered:
        from hsextract import layered

        got = layered.reference(
            Path(model_path),
            [r.input_ids for r in records],
            wanted,
            set(keys),
            num_layers,
            where.device,
            run_dtype,
            [r.states["final"] for r in records],
            say,
        )
    else:
        got = _in_memory(model_path, records, wanted, set(keys), num_layers, run_dtype, where, say)
    refs, ref_top1, stored_top1 = got.refs, got.ref_top1, got.stored_top1
    noise_refs, noise_top1 = got.noise_refs, got.noise_top1 or []

    layers: dict[str, dict[str, Any]] = {}
    for key in [*keys, "final"]:
        per = [compare(r.states[key], ref[key]) for r, ref in zip(records, refs, strict=True)]
        err = _rel(sum(p["err_sq"] for p in per), sum(p["ref_sq"] for p in per))
        per_rec = [_rel(p["err_sq"], p["ref_sq"]) for p in per]
        noise = FP32_FLOOR
        dtype_noise = None
        if noise_refs is not None:
            nper = [compare(n[key], ref[key]) for n, ref in zip(noise_refs, refs, strict=True)]
            dtype_noise = max(_rel(p["err_sq"], p["ref_sq"]) for p in nper)
            noise = max(noise, dtype_noise)
        codec_noise = None
        if codec == "fp8":
            cn = [_fp8_noise(ref[key]) for ref in refs]
            codec_noise = max(_rel(e, r) for e, r in cn)
            noise = math.sqrt(noise**2 + codec_noise**2)
        worst = max(per_rec)
        i_worst = per_rec.index(worst)
        entry: dict[str, Any] = {
            "layer": key,
            "name": layer_name(key, num_layers),
            "rel_rms": err,
            "rel_rms_worst_record": worst,
            "cosine": sum(p["cos_sum"] for p in per) / sum(p["n"] for p in per),
            "cosine_worst_record": per[i_worst]["cos_sum"] / max(per[i_worst]["n"], 1),
            "noise": noise,
            "dtype_noise": dtype_noise,
            "codec_noise": codec_noise,
            "verdict": judge(worst, noise),
            "records_over": [
                f"{r.chunk}/{r.id}"
                for r, e in zip(records, per_rec, strict=True)
                if judge(e, noise) == "fail"
            ],
        }
        if key == "final":
            agree = sum(int((s == t).sum()) for s, t in zip(stored_top1, ref_top1, strict=True))
            entry["top1_agreement"] = agree / tokens
            if noise_refs is not None:
                nagree = sum(int((s == t).sum()) for s, t in zip(noise_top1, ref_top1, strict=True))
                entry["top1_agreement_dtype_noise"] = nagree / tokens
        if entry["verdict"] == "fail":
            i = i_worst
            entry["diagnosis"] = _diagnose(records[i].states[key], refs[i], key, num_layers)
        layers[str(key)] = entry

    return layers


def run(cfg: Any, run_dir: Path, out: Path, *, say: Callable[[str], None] = print) -> dict:
    """Audit the run at ``run_dir``: write ``out`` (state/audit.json) and return it, or
    write the unaudited mark and raise :class:`AuditFailed`."""
    from transformers import AutoConfig

    from hsextract.config import fingerprint, read_model_config

    run_dir = Path(run_dir)
    t_start = time.monotonic()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    fp_now = fingerprint(cfg)
    if manifest.get("fingerprint") not in (None, fp_now):
        raise AuditRefused(
            f"the model at {cfg.model.path} is not the one this run was extracted with: its "
            f"identity (contents digest, revision, dtype) gives fingerprint {fp_now}, the "
            f"run's is {manifest.get('fingerprint')}; put that model back, or rerun "
            "extract_all for the new one (a new run dir)"
        )
    mconf = read_model_config(cfg)
    num_layers = int(mconf["num_hidden_layers"])
    quantized = bool(mconf.get("quantization_config"))
    records = stored_records(cfg, run_dir, manifest, num_layers)
    if not records:
        raise AuditRefused(f"{run_dir}: the manifest lists no records to audit")
    run_dtype = cfg.model.dtype
    passes = 1 if run_dtype == "float32" else 2
    tokens = sum(len(r.input_ids) for r in records)
    where = place(cfg, run_dir, _sizes(cfg, mconf, records, tokens, passes), say)
    n_chunks = len(manifest["chunks"])
    say(f"auditing {len(records)} records ({tokens:,} tokens) of {n_chunks} chunks {where.text}")

    AutoConfig.from_pretrained(cfg.model.path)  # a missing config says so here, in one line
    t_fwd = time.monotonic()
    layers = measure(
        cfg.model.path, records, num_layers, run_dtype, manifest.get("codec"), where, say
    )
    forward_s = time.monotonic() - t_fwd

    verdicts = [e["verdict"] for e in layers.values()]
    verdict = "fail" if "fail" in verdicts else "warn" if "warn" in verdicts else "pass"
    result: dict[str, Any] = {
        "verdict": verdict,
        "fingerprint": fp_now,
        "model": str(cfg.model.path),
        "dtype": run_dtype,
        "codec": manifest.get("codec"),
        "quantized": quantized,
        "bound": (
            f"fp32: fail above {FAIL_X * FP32_FLOOR:.3g} relative RMS error, warn above "
            f"{WARN_X * FP32_FLOOR:.3g}"
            if passes == 1
            else f"{run_dtype}: its own noise per layer (the same forward in {run_dtype} and "
            f"fp32, at least {FP32_FLOOR:g}); warn above {WARN_X:g}x, fail above {FAIL_X:g}x"
        )
        + ("; plus the fp8 codec's own error" if manifest.get("codec") == "fp8" else ""),
        "records": [
            {"chunk": r.chunk, "position": r.position, "id": r.id, "tokens": len(r.input_ids)}
            for r in records
        ],
        "tokens": tokens,
        "streamed": cfg.stream.budget_gb is not None,
        "device": where.device,
        "layered": where.layered,
        "estimate_s": where.estimate_s,
        "forward_s": round(forward_s, 3),
        "seconds": round(time.monotonic() - t_start, 3),
        "layers": layers,
        "layers_checked": [e["name"] for e in layers.values()],
    }
    if quantized:
        result["note"] = (
            "quantized checkpoint: judged against HF's dequantized forward with the "
            f"{run_dtype} noise bound, which was not calibrated for quantized kernels "
            "(docs/audit.md)"
        )
    failed = run_dir / FAILED_FILE
    if verdict == "fail":
        result["sentence"] = failure_sentence(layers)
        _write(failed, result)
        raise AuditFailed(result["sentence"])
    if verdict == "warn":
        result["warning"] = warning_sentence(layers)
    _write(Path(out), result)
    failed.unlink(missing_ok=True)
    return result


def _sizes(cfg: Any, mconf: dict, records: list[Stored], tokens: int, passes: int) -> Sizes:
    """The sizes :func:`place` weighs, from the checkpoint's headers and the sample."""
    from hsextract import layered

    path = Path(cfg.model.path)
    hidden = int(mconf.get("hidden_size") or 0)
    keys = len(records[0].states)
    # Per token: the float32 stream (and the run dtype's), and the float64 copies kept of
    # every captured state with its neighbours (up to 3 per stored tensor, both passes).
    per_token = hidden * (_F32 + 2 * (passes - 1) + 8 * 3 * keys * passes)
    refused = layered.unavailable()
    if mconf.get("quantization_config"):
        refused = "a quantized checkpoint: its weights load dequantized only in one piece"
    elif not list(path.glob("*.safetensors")):
        refused = "its weights are not safetensors files"
    return Sizes(
        params=checkpoint_params(path),
        tokens=tokens,
        passes=passes,
        layer_params=layered.largest_module_params(path) if refused is None else 0,
        states_bytes=tokens * per_token,
        layered_refused=refused,
    )


def failure_sentence(layers: dict[str, dict]) -> str:
    """One sentence: the worst failing layer, its records and its figure."""
    bad = [e for e in layers.values() if e["verdict"] == "fail"]
    e = max(bad, key=lambda e: e["rel_rms_worst_record"] / e["noise"])
    recs = e["records_over"]
    shown = ", ".join(recs[:4]) + (f" and {len(recs) - 4} more" if len(recs) > 4 else "")
    others = [x["name"] for x in bad if x is not e]
    why = f" ({e['diagnosis']})" if e.get("diagnosis") else ""
    also = f"; also failing: {', '.join(others)}" if others else ""
    return (
        f"audit failed: the stored {e['name']} differs from the model's forward by a "
        f"relative RMS error of {e['rel_rms_worst_record']:.3g} (cosine "
        f"{e['cosine_worst_record']:.4f}), "
        f"over {FAIL_X:g}x the bound {e['noise']:.3g}, on {len(recs)} record(s) {shown}{why}"
        f"{also}; nothing was deleted, the run is marked unaudited ({FAILED_FILE})"
    )


def warning_sentence(layers: dict[str, dict]) -> str:
    warn = [e for e in layers.values() if e["verdict"] == "warn"]
    return "audit warning: " + "; ".join(
        f"{e['name']} relative RMS error {e['rel_rms_worst_record']:.3g}, "
        f"{e['rel_rms_worst_record'] / e['noise']:.1f}x its bound {e['noise']:.3g}"
        for e in warn
    )


def mark_refused(run_dir: Path, sentence: str) -> None:
    """A refused audit leaves the run unaudited, as a failed one does: the mark says why."""
    _write(Path(run_dir) / FAILED_FILE, {"verdict": "refused", "sentence": sentence, "layers": {}})


def _write(path: Path, data: dict) -> None:
    from hsextract.server import write_json

    write_json(Path(path), data)


# -- what the others read --------------------------------------------------------------


def status_line(cfg: Any, run_dir: Path) -> str:
    """``hsextract status``'s line: passed / warned / FAILED (the unaudited mark) / off /
    not run yet.  Reads two small files, never a tensor."""
    run_dir = Path(run_dir)
    failed = _read(run_dir / FAILED_FILE)
    if failed is not None:
        return f"FAILED, the run is unaudited: {failed.get('sentence', '?')}"
    if cfg.audit.records <= 0:
        return "off (audit.records: 0): the states were not checked against the model"
    done = _read(run_dir / AUDIT_FILE)
    if done is None:
        return "not run yet (it runs once every chunk is extracted)"
    worst = max(done["layers"].values(), key=lambda e: e["rel_rms_worst_record"] / e["noise"])
    what = "warned" if done["verdict"] == "warn" else "passed"
    return (
        f"{what}: {len(done['records'])} records, {len(done['layers'])} tensors; worst "
        f"{worst['name']} relative RMS error {worst['rel_rms_worst_record']:.2g} (fails "
        f"above {FAIL_X * worst['noise']:.2g}) in {done['seconds']:.1f}s ({AUDIT_FILE})"
    )


def _read(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def report_section(run_dir: Path) -> str | None:
    """The report page's audit table (None when the run has no audit outcome)."""
    import html

    run_dir = Path(run_dir)
    data = _read(run_dir / FAILED_FILE) or _read(run_dir / AUDIT_FILE)
    if data is None:
        return None
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(v))}</td>"
            for v in (
                e["name"],
                f"{e['rel_rms']:.3g}",
                f"{e['rel_rms_worst_record']:.3g}",
                f"{e['cosine']:.6f}",
                f"{e['noise']:.3g}",
                f"{e['top1_agreement']:.4f}" if "top1_agreement" in e else "",
                e["verdict"],
            )
        )
        + "</tr>"
        for e in data["layers"].values()
    )
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "tensor",
            "rel. RMS error",
            "worst record",
            "cosine",
            "bound (noise)",
            "LM head top-1 agreement",
            "verdict",
        )
    )
    text = (
        data.get("sentence")
        or data.get("warning")
        or (
            f"passed: {len(data['records'])} records ({data['tokens']:,} tokens) against "
            f"HF's forward of {data['model']} on {data['device']}, {data['seconds']:.1f}s; "
            f"bound {data['bound']}"
        )
    )
    return (
        f"<h3>Audit: stored states vs the model's forward</h3><p>{html.escape(text)}</p>"
        f"<table><tr>{head}</tr>{rows}</table>"
    )
