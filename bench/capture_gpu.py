"""Capture on a GPU: prefill throughput with the hidden-state dump on vs off.

A shape-faithful stand-in for one rank of a DeepSeek-V3 prefill: hidden 7168, 8,192-token
extend passes packed from requests of mixed length the way chunked prefill packs them
(requests split across passes, several per pass), a stack of dense bf16 transformer
layers (attention 56x128 heads + SwiGLU MLP 18432) sized so one forward takes ~200 ms,
capturing the residual stream entering layers [2, L//2, L-3] and the final norm's output,
handed to ``hsextract.capture.DumpWriter.write_batch`` exactly as the SGLang patch does.
Each pass ends with a sync on the forward stream (as sampling does in SGLang), never a
device-wide sync, which would wait for the capture's side stream too.

A consumer thread plays the client: it deletes finished pieces (checking that each
request's pieces tile its tokens), so /dev/shm holds only what is in flight.

Also measured in the same run: plain pinned D2H bandwidth (the ceiling for getting the
bytes off the GPU), one-thread write bandwidth from pinned memory to the dump dir, and the
capture path's own capacity (write_batch as fast as it accepts, no forward) per thread
count.  Blocks of passes alternate off/on; figures are medians over blocks.

    python bench/capture_gpu.py            # on an H200 (see bench/README.md)
    python bench/capture_gpu.py --smoke    # tiny shapes on CPU: a sanity check only

The last line is ``capture on/off throughput ratio: X.XXX dump_GBps: Y.Y
pinned_d2h_GBps: Z.Z`` (dump_GBps: the capture path's sustained capacity at the default
thread count, with pieces deleted as a client would).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from hsextract import capture  # noqa: E402
from hsextract.capture import DumpWriter  # noqa: E402


@dataclass
class Shape:
    hidden: int
    ffn: int
    heads: int
    tokens: int
    vocab: int


class DenseLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP: the FLOPs and memory traffic of a dense DSV3 layer."""

    def __init__(self, s: Shape, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = s.heads
        kw = {"device": device, "dtype": dtype, "bias": False}
        self.qkv = nn.Linear(s.hidden, 3 * s.hidden, **kw)
        self.o = nn.Linear(s.hidden, s.hidden, **kw)
        self.gate_up = nn.Linear(s.hidden, 2 * s.ffn, **kw)
        self.down = nn.Linear(s.ffn, s.hidden, **kw)
        for lin in (self.qkv, self.o, self.gate_up, self.down):
            nn.init.normal_(lin.weight, std=lin.in_features**-0.5 * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        q, k, v = self.qkv(F.rms_norm(x, (h,))).view(t, 3, self.heads, -1).unbind(1)
        # 4-D [1, heads, T, d], so SDPA can pick its flash kernel.
        q, k, v = (z.transpose(0, 1).unsqueeze(0) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a[0].transpose(0, 1).reshape(t, h))
        g, u = self.gate_up(F.rms_norm(x, (h,))).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class StandIn(nn.Module):
    def __init__(self, s: Shape, n_layers: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden, device=device, dtype=dtype)
        self.layers = nn.ModuleList(DenseLayer(s, device, dtype) for _ in range(n_layers))
        n = n_layers
        self.aux_layers = [2, n // 2, n - 3]

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.embed(ids)
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux.append(x)  # the residual stream entering layer i (HF hidden_states[i])
            x = layer(x)
        return F.rms_norm(x, (x.shape[-1],)), aux


class Packer:
    """Packs requests into fixed-size extend passes like SGLang's chunked prefill.

    Running requests go first (a long one continues where its last pass stopped), new
    ones fill the rest and the last one is split.  ``start_block(seed, tag)`` restarts
    the sequence, so off and on blocks see the very same pass compositions (new rids).
    """

    def __init__(self, tokens: int, lo: int, hi: int) -> None:
        self.tokens, self.lo, self.hi = tokens, lo, hi
        self.lengths: dict[str, int] = {}
        self.start_block(0, "warm")

    def start_block(self, seed: int, tag: str) -> None:
        self.rng = torch.Generator().manual_seed(seed)
        self.tag = tag
        self.count = 0
        self.running: list[list] = []  # [rid, done, length]

    def next_pass(self) -> tuple[list[str], list[int], list[int]]:
        rids, starts, lens, room, i = [], [], [], self.tokens, 0
        while room:
            if i == len(self.running):
                n = int(torch.randint(self.lo, self.hi + 1, (1,), generator=self.rng))
                rid = f"{self.tag}-{self.count:05d}"
                self.count += 1
                self.lengths[rid] = n
                self.running.append([rid, 0, n])
            entry = self.running[i]
            take = min(room, entry[2] - entry[1])
            rids.append(entry[0])
            starts.append(entry[1])
            lens.append(take)
            entry[1] += take
            room -= take
            i += 1
        self.running = [e for e in self.running if e[1] < e[2]]
        return rids, starts, lens


class StandInWorkload:
    """The dense-layer stack, fed packed passes, calling write_batch like the patch does."""

    name = "stand-in (dense bf16 layers, direct write_batch)"

    def __init__(self, s: Shape, n_layers: int, device: torch.device, dtype: torch.dtype):
        self.model = StandIn(s, n_layers, device, dtype).eval()
        self.aux_layers = self.model.aux_layers
        self.device = device
        self.writer: DumpWriter | None = None

    def reset(self) -> None:
        """Nothing carried between passes (the stand-in keeps no KV cache)."""

    def run_pass(self, rids: list[str], starts: list[int], lens: list[int]) -> None:
        ids = torch.randint(0, self.model.embed.num_embeddings, (sum(lens),), device=self.device)
        with torch.inference_mode():
            final, aux = self.model(ids)
            if self.writer is not None:
                self.writer.write_batch(rids, starts, lens, ids, final, aux)
            final[-1, 0].item()  # sampling's sync: the forward stream only


class EngineWorkload:
    """hsextract.engine.ModelRunner (the reference engine) on a random-weight DeepSeek-V3.

    All layers dense (``first_k_dense_replace = L``): DSV3's MLA attention (128 heads,
    q_lora 1536, kv_lora 512) and its 18432-wide dense MLP at hidden 7168.  The runner
    gets the model built in GPU memory instead of loading one from disk (15 GB of I/O
    that has nothing to do with capture).
    """

    name = "reference engine (hsextract.engine.ModelRunner, HF DeepseekV3, all dense)"

    def __init__(self, s: Shape, n_layers: int, device: torch.device, dtype: torch.dtype):
        import transformers
        from transformers import AutoModelForCausalLM, DeepseekV3Config

        from hsextract import engine

        small = s.hidden < 1024
        cfg = DeepseekV3Config(
            vocab_size=s.vocab,
            hidden_size=s.hidden,
            intermediate_size=s.ffn,
            moe_intermediate_size=s.ffn // 8,
            num_hidden_layers=n_layers,
            num_attention_heads=s.heads,
            num_key_value_heads=s.heads,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=n_layers,
            kv_lora_rank=16 if small else 512,
            q_lora_rank=32 if small else 1536,
            qk_rope_head_dim=8 if small else 64,
            qk_nope_head_dim=16 if small else 128,
            v_head_dim=16 if small else 128,
            max_position_embeddings=4 * s.tokens,
            rope_scaling=None,
            tie_word_embeddings=False,
        )
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        auto = transformers.AutoModelForCausalLM
        orig = auto.__dict__["from_pretrained"]
        auto.from_pretrained = classmethod(lambda cls, *a, **k: model)
        try:
            dtype_name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
            self.runner = engine.ModelRunner("<in-memory>", dtype_name, str(device))
        finally:
            auto.from_pretrained = orig
        self.Request = engine.Request
        self.aux_layers = self.runner.aux_layers
        self.device = device
        self.reqs: dict[str, object] = {}
        self.vocab = s.vocab

    @property
    def writer(self) -> DumpWriter | None:
        return self.runner.writer

    @writer.setter
    def writer(self, w: DumpWriter | None) -> None:
        self.runner.writer = w

    def reset(self) -> None:
        """Drop unfinished requests (and their KV caches) left by the previous block."""
        self.reqs.clear()

    def run_pass(self, rids: list[str], starts: list[int], lens: list[int]) -> None:
        batch = []
        for rid, start in zip(rids, starts, strict=True):
            if start == 0:
                ids = torch.randint(0, self.vocab, (self.packer_len(rid),)).tolist()
                self.reqs[rid] = self.Request(rid=rid, input_ids=ids, max_new_tokens=0)
            batch.append(self.reqs[rid])
        self.runner.extend(batch, lens)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # sampling's sync: this stream only
        for r in batch:
            if r.remaining == 0:
                del self.reqs[r.rid]

    packer_len: Callable[[str], int]


class Consumer(threading.Thread):
    """The client's half, minus assembly: delete each finished piece, check the tiling."""

    def __init__(self, dump: Path, lengths: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.dump = dump
        self.lengths = lengths  # rid -> full length, to remove a finished request's dir
        self.stop = threading.Event()
        self.covered: dict[str, int] = {}  # rid -> tokens seen, contiguous from 0
        self.pending: dict[str, dict[int, int]] = {}
        self.bytes = 0
        self.pieces = 0
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.sweep():
                time.sleep(0.002)
        self.sweep()

    def sweep(self) -> int:
        found = 0
        for rdir in os.scandir(self.dump):
            for ent in os.scandir(rdir.path):
                if ent.name.startswith("."):
                    continue
                found += 1
                try:
                    with open(ent.path, "rb") as f:
                        hlen = int.from_bytes(f.read(8), "little")
                        meta = json.loads(f.read(hlen))["__metadata__"]
                    size = os.stat(ent.path).st_size
                    os.unlink(ent.path)
                except OSError as exc:
                    self.errors.append(f"{ent.path}: {exc!r}")
                    continue
                self.bytes += size
                self.pieces += 1
                self.pending.setdefault(rdir.name, {})[int(meta["start"])] = int(meta["n"])
                self._advance(rdir.name)
        return found

    def _advance(self, rid: str) -> None:
        have = self.covered.get(rid, 0)
        parts = self.pending[rid]
        while have in parts:
            have += parts.pop(have)
        self.covered[rid] = have
        if have == self.lengths.get(rid, -1):
            os.rmdir(self.dump / rid)
        if any(s < have for s in parts):
            self.errors.append(f"{rid}: overlapping pieces {sorted(parts)} below {have}")

    def idle(self, timeout: float = 60.0) -> None:
        """Wait until the dump dir holds no finished piece (the writer must be flushed)."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if not any(
                not e.name.startswith(".")
                for d in os.scandir(self.dump)
                for e in os.scandir(d.path)
            ):
                return
            time.sleep(0.005)
        raise TimeoutError("consumer did not drain the dump dir")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_d2h_gbps(nbytes: int, device: torch.device, reps: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for i in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) / 1e3)
    assert torch.equal(dst[:4096], src[:4096].cpu())
    return nbytes / statistics.median(times) / 1e9


def one_thread_write_gbps(nbytes: int, dump: Path, pinned: bool, reps: int) -> float:
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, pin_memory=pinned)
    view = memoryview(buf.numpy())
    times = []
    for _ in range(reps):
        p = dump / ".raw_write_probe"
        t0 = time.perf_counter()
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        off = 0
        while off < nbytes:
            off += os.write(fd, view[off:])
        os.close(fd)
        times.append(time.perf_counter() - t0)
        os.unlink(p)
    return nbytes / statistics.median(times) / 1e9


def pass_bytes(s: Shape, elem: int) -> int:
    return s.tokens * (8 + 4 * s.hidden * elem)


def run_block(
    work: StandInWorkload | EngineWorkload,
    packer: Packer,
    writer: DumpWriter | None,
    passes: int,
    seed: int,
    tag: str,
    handed: dict[str, int],
) -> dict[str, float]:
    packer.start_block(seed, tag)
    work.reset()
    work.writer = writer
    per_pass = []
    t0 = time.perf_counter()
    for _ in range(passes):
        tp = time.perf_counter()
        rids, starts, lens = packer.next_pass()
        work.run_pass(rids, starts, lens)
        per_pass.append(time.perf_counter() - tp)
        if writer is not None:
            for r, n in zip(rids, lens, strict=True):
                handed[r] = handed.get(r, 0) + n
    t_fwd = time.perf_counter() - t0
    if writer is not None:
        writer.flush()
    t_all = time.perf_counter() - t0
    work.writer = None
    tokens = passes * packer.tokens
    return {
        "tok_s": tokens / t_fwd,
        "tok_s_with_drain": tokens / t_all,
        "pass_ms_median": statistics.median(per_pass) * 1e3,
        "seconds": t_all,
        "pass_ms": [round(x * 1e3, 2) for x in per_pass],
    }


def verify(
    writer: DumpWriter, s: Shape, device: torch.device, dtype: torch.dtype, dump: Path
) -> int:
    """Exact check of the pieces against tensors the caller trashes right after handover.

    Several requests per batch and a request split over two batches; after each
    ``write_batch`` the caller overwrites its tensors, frees them and allocates over the
    freed memory, as the next forward does.
    """
    from safetensors import safe_open

    t, h = s.tokens, s.hidden
    g = torch.Generator(device=device).manual_seed(123)
    cases = [
        (["v0", "v1", "v2"], [0, 0, 0], [t // 2, t // 4, t - t // 2 - t // 4]),
        (["v1", "v3"], [t // 4, 0], [t // 8, t - t // 8]),
    ]
    want = []
    for rids, starts, lens in cases:
        ids = torch.randint(0, s.vocab, (t,), device=device, generator=g)
        final = torch.randn(t, h, device=device, generator=g).to(dtype)
        aux = [torch.randn(t, h, device=device, generator=g).to(dtype) for _ in range(3)]
        keep = [x.to("cpu", copy=True) for x in (ids, final, torch.cat(aux, 1))]
        writer.write_batch(rids, starts, lens, ids, final, aux, [2, 4, 5])
        final.fill_(float("nan"))
        for x in aux:
            x.fill_(float("nan"))
        ids.fill_(-1)
        del final, aux, ids
        junk = torch.full((4 * t, h), float("nan"), device=device, dtype=dtype)
        del junk
        row = 0
        for r, st, n in zip(rids, starts, lens, strict=True):
            want.append((r, st, [x[row : row + n] for x in keep]))
            row += n
    writer.flush()
    for rid, st, (ids_c, fin_c, aux_c) in want:
        with safe_open(str(dump / rid / capture.piece_name(st)), "pt") as f:
            assert f.metadata()["aux_layers"] == "[2, 4, 5]"
            assert torch.equal(f.get_tensor("input_ids"), ids_c.to(torch.int64)), rid
            assert torch.equal(f.get_tensor("hidden_states"), fin_c), rid
            assert torch.equal(f.get_tensor("aux_hidden_states"), aux_c), rid
    for d in list(dump.iterdir()):
        shutil.rmtree(d)
    return len(want)


def capacity(
    s: Shape, device: torch.device, dtype: torch.dtype, dump: Path, threads: int, passes: int
) -> float:
    """write_batch as fast as it accepts (no forward): the capture path's sustained GB/s."""
    g = torch.Generator(device=device).manual_seed(threads)
    final = torch.randn(s.tokens, s.hidden, device=device, generator=g).to(dtype)
    aux = [torch.randn(s.tokens, s.hidden, device=device, generator=g).to(dtype) for _ in "abc"]
    ids = torch.randint(0, s.vocab, (s.tokens,), device=device, generator=g)
    cons = Consumer(dump, {"warm": s.tokens})
    cons.start()
    w = DumpWriter(dump, [2, 30, 58], threads=threads)
    w.write_batch(["warm"], [0], [s.tokens], ids, final, aux)  # allocate a staging buffer
    w.flush()
    cons.idle()
    t0 = time.perf_counter()
    for i in range(passes):
        w.write_batch([f"cap{threads}-{i}"], [0], [s.tokens], ids, final, aux)
    w.flush()
    dt = time.perf_counter() - t0
    w.close()
    cons.idle()
    cons.stop.set()
    cons.join()
    assert not cons.errors, cons.errors[:3]
    return passes * pass_bytes(s, final.element_size()) / dt / 1e9


def build(
    kind: str, s: Shape, n_layers: int, device: torch.device, dtype: torch.dtype
) -> StandInWorkload | EngineWorkload:
    if kind == "reference":
        return EngineWorkload(s, n_layers, device, dtype)
    heads = max(1, s.hidden // 128) if s.hidden >= 1024 else s.heads
    return StandInWorkload(
        Shape(s.hidden, s.ffn, heads, s.tokens, s.vocab), n_layers, device, dtype
    )


def calibrate(
    kind: str, s: Shape, device: torch.device, dtype: torch.dtype, target_ms: float
) -> int:
    """Layers for ``target_ms`` per forward: time a 2-layer build on one full pass."""
    probe = build(kind, s, 2, device, dtype)
    probe.packer_len = lambda rid: s.tokens
    times = []
    for i in range(5):
        sync(device)
        t0 = time.perf_counter()
        probe.run_pass([f"probe{i}"], [0], [s.tokens])
        sync(device)
        times.append(time.perf_counter() - t0)
    layer_ms = statistics.median(times[2:]) / 2 * 1e3
    n = max(8, min(64, round(target_ms / layer_ms)))
    print(f"{kind}: one layer ~{layer_ms:.1f} ms on an {s.tokens}-token pass -> {n} layers")
    del probe
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    ap.add_argument(
        "--engine",
        choices=["auto", "reference", "standin"],
        default="auto",
        help="auto: the reference engine, falling back to the stand-in",
    )
    ap.add_argument(
        "--uniform",
        action="store_true",
        help="every request exactly one pass long (no chunking/batching): the steadiest timing",
    )
    ap.add_argument(
        "--chunk-sweep",
        type=str,
        default="",
        help="also time these D2H settings, CHUNK_MiBxINFLIGHT, 2 off/on pairs each "
        "(0x0: one copy per tensor, all queued at once; e.g. 0x0,16x0,16x2)",
    )
    ap.add_argument("--passes", type=int, default=None, help="passes per timed block")
    ap.add_argument("--reps", type=int, default=None, help="off/on block pairs")
    ap.add_argument("--layers", type=int, default=0, help="0 = sized for --target-ms")
    ap.add_argument("--target-ms", type=float, default=200.0)
    ap.add_argument("--threads", type=str, default="1,2,4,8", help="capacity sweep")
    ap.add_argument("--dump-root", type=str, default="/dev/shm")
    ap.add_argument("--json", type=str, default=os.environ.get("OUT", ""), help="dir for JSON")
    a = ap.parse_args()

    if a.smoke:
        device, dtype = torch.device("cpu"), torch.bfloat16
        s = Shape(hidden=64, ffn=128, heads=4, tokens=96, vocab=1000)
        passes, reps, warm = a.passes or 6, a.reps or 2, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: use --smoke for the CPU sanity check")
        device, dtype = torch.device("cuda"), torch.bfloat16
        s = Shape(hidden=7168, ffn=18432, heads=128, tokens=8192, vocab=32000)
        passes, reps, warm = a.passes or 24, a.reps or 3, 3
    torch.manual_seed(0)
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = pass_bytes(s, elem)
    root = Path(a.dump_root if Path(a.dump_root).is_dir() else tempfile.gettempdir())
    dump = Path(tempfile.mkdtemp(prefix="hsextract-bench-", dir=root))
    os.chmod(dump, 0o700)
    free = shutil.disk_usage(dump).free
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"device: {gpu}; torch {torch.__version__}; {os.cpu_count()} CPUs; "
        f"dump dir {dump} ({free / 2**30:.1f} GiB free)"
    )
    print(f"pass: {s.tokens} tokens x H={s.hidden}, 3 aux + final, {nbytes / 1e6:.0f} MB captured")
    if free < 8 * nbytes:
        print(f"WARNING: only {free / 1e9:.1f} GB free in {dump}")

    d2h = pinned_d2h_gbps(nbytes, device, reps=10) if device.type == "cuda" else 0.0
    write1 = one_thread_write_gbps(nbytes, dump, pinned=device.type == "cuda", reps=3)
    print(f"pinned D2H: {d2h:.1f} GB/s   one-thread write to {root}: {write1:.2f} GB/s")

    writer = DumpWriter(dump, [2, 4, 5])
    checked = verify(writer, s, device, dtype, dump)
    print(f"verify: {checked} pieces equal the handed-over tensors ({device.type} path)")

    kinds = ["reference", "standin"] if a.engine == "auto" else [a.engine]
    work = None
    for kind in kinds:
        try:
            n_layers = a.layers or (
                8 if a.smoke else calibrate(kind, s, device, dtype, a.target_ms)
            )
            work = build(kind, s, n_layers, device, dtype)
            break
        except Exception as exc:
            if kind == kinds[-1]:
                raise
            print(f"{kind} unusable here ({exc!r}); falling back")
    assert work is not None
    writer.aux_layers = work.aux_layers
    print(f"workload: {work.name}; {n_layers} layers; aux layers {work.aux_layers}")

    lo, hi = (s.tokens, s.tokens) if a.uniform else (s.tokens // 4, s.tokens)
    packer = Packer(s.tokens, lo, hi)
    work.packer_len = packer.lengths.__getitem__
    cons = Consumer(dump, packer.lengths)
    cons.start()
    handed: dict[str, int] = {}
    run_block(work, packer, None, warm, 1000, "woff", handed)
    run_block(work, packer, writer, warm, 1000, "won", handed)
    cons.idle()
    off, on = [], []
    for r in range(reps):
        # Same seed for both modes: the same pass compositions; alternate which runs first.
        order = [("off", None), ("on", writer)] if r % 2 == 0 else [("on", writer), ("off", None)]
        for mode, w in order:
            res = run_block(work, packer, w, passes, r, f"{mode}{r}", handed)
            (on if w else off).append(res)
            cons.idle()
        print(
            f"rep {r}: off {off[-1]['tok_s']:,.0f} tok/s ({off[-1]['pass_ms_median']:.1f} ms/pass)"
            f"  on {on[-1]['tok_s']:,.0f} tok/s ({on[-1]['pass_ms_median']:.1f} ms/pass, "
            f"{on[-1]['tok_s_with_drain']:,.0f} incl. final drain)"
        )
    sweep = {}
    for spec in [x for x in a.chunk_sweep.split(",") if x]:
        mb, inflight = (int(v) for v in spec.split("x"))
        writer.d2h_chunk_bytes, writer.d2h_inflight = mb << 20, inflight
        pairs, toks = [], []
        for r in range(2):
            o = run_block(work, packer, None, passes, 100 + r, f"soff{spec}-{r}", handed)
            n = run_block(work, packer, writer, passes, 100 + r, f"son{spec}-{r}", handed)
            cons.idle()
            pairs += [f / g for f, g in zip(o["pass_ms"], n["pass_ms"], strict=True)]
            toks.append(n["tok_s"] / o["tok_s"])
        sweep[spec] = {"paired": statistics.median(pairs), "throughput": statistics.median(toks)}
        print(
            f"d2h {mb} MiB chunks, {inflight or 'all'} queued: pass-by-pass off/on time ratio, "
            f"median {sweep[spec]['paired']:.3f}; by throughput {sweep[spec]['throughput']:.3f}"
        )
    writer.d2h_chunk_bytes = capture.DEFAULT_D2H_CHUNK_MB << 20
    writer.d2h_inflight = getattr(capture, "DEFAULT_D2H_INFLIGHT", 0)
    work.reset()
    writer.close()
    cons.stop.set()
    cons.join()
    # Every handed-over token came back exactly once, in order.
    missing = {
        r: (n, cons.covered.get(r, 0)) for r, n in handed.items() if cons.covered.get(r) != n
    }
    assert not cons.errors, cons.errors[:5]
    assert not missing, list(missing.items())[:5]

    med = statistics.median
    off_tok = med(x["tok_s"] for x in off)
    on_tok = med(x["tok_s"] for x in on)
    ratio = on_tok / off_tok
    ratio_drain = med(x["tok_s_with_drain"] for x in on) / off_tok
    # Same pass compositions in both modes: pair pass i of off block r with on block r's.
    paired = med(
        f / n
        for x, y in zip(off, on, strict=True)
        for f, n in zip(x["pass_ms"], y["pass_ms"], strict=True)
    )
    fwd_ms = med(x["pass_ms_median"] for x in off)
    on_ms = med(x["pass_ms_median"] for x in on)
    achieved = on_tok / s.tokens * nbytes / 1e9
    work_name = work.name
    del work
    if device.type == "cuda":
        torch.cuda.empty_cache()

    caps = {}
    for t in [int(x) for x in a.threads.split(",") if x]:
        caps[t] = capacity(s, device, dtype, dump, t, passes=max(4, passes))
        print(f"capacity, {t} writer thread(s): {caps[t]:.2f} GB/s")
    default_t = capture.DEFAULT_THREADS
    dump_gbps = caps.get(default_t) or capacity(s, device, dtype, dump, default_t, passes)
    shutil.rmtree(dump, ignore_errors=True)

    results = {
        "device": gpu,
        "torch": torch.__version__,
        "shape": s.__dict__,
        "layers": n_layers,
        "workload": work_name,
        "pass_bytes": nbytes,
        "off": off,
        "on": on,
        "ratio": ratio,
        "ratio_with_drain": ratio_drain,
        "ratio_paired_pass_median": paired,
        "uniform": a.uniform,
        "d2h_chunk_sweep": sweep,
        "d2h_chunk_mb": capture.DEFAULT_D2H_CHUNK_MB,
        "d2h_inflight": getattr(capture, "DEFAULT_D2H_INFLIGHT", 0),
        "forward_ms": fwd_ms,
        "on_pass_ms": on_ms,
        "achieved_dump_GBps": achieved,
        "capacity_GBps": caps,
        "dump_GBps": dump_gbps,
        "pinned_d2h_GBps": d2h,
        "one_thread_write_GBps": write1,
        "pieces_consumed": cons.pieces,
        "bytes_consumed": cons.bytes,
        "verified_pieces": checked,
        "default_threads": default_t,
        "default_slots": capture.DEFAULT_SLOTS,
    }
    if a.json and not a.smoke:
        Path(a.json, f"capture_gpu_{work_name.split()[0]}.json").write_text(
            json.dumps(results, indent=1)
        )
    print()
    print(f"workload: {work_name}; passes: {'uniform' if a.uniform else 'chunked + batched'}")
    print(
        f"forward (capture off): {fwd_ms:.1f} ms/pass median; capture on: {on_ms:.1f} ms/pass; "
        f"pass-by-pass off/on time ratio, median: {paired:.3f}"
    )
    print(
        f"throughput off {off_tok:,.0f} tok/s, on {on_tok:,.0f} tok/s "
        f"(incl. final drain of each {passes}-pass block: ratio {ratio_drain:.3f})"
    )
    print(
        f"dump rate during the on blocks: {achieved:.2f} GB/s (demand); capacity at "
        f"{default_t} threads: {dump_gbps:.2f} GB/s = {dump_gbps / d2h if d2h else 0:.3f} "
        f"x pinned D2H"
    )
    print(f"consumer: {cons.pieces} pieces, {cons.bytes / 1e9:.1f} GB, every request tiled exactly")
    print(
        f"capture on/off throughput ratio: {ratio:.3f} dump_GBps: {dump_gbps:.1f} "
        f"pinned_d2h_GBps: {d2h:.1f}"
    )


if __name__ == "__main__":
    main()
