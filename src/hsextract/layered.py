"""The audit's forward one module at a time, for a model larger than the memory.

Why: the audit (hsextract.audit) recomputes a sample of records with HF's forward of the
model; a 70B or 671B model does not fit a machine's memory in float32, so that audit was
refused.  The sample is small (16 records), so the forward can run the other way round:
every record through the embedding, then every record through decoder layer 0, then layer
1, ...  Only one module's weights are in memory at a time, each read from the
checkpoint's safetensors files once for all records.

What makes it the same forward, not a re-implementation: the skeleton is the model's own
class built on the meta device (``from_config``), its weights loaded per module by
transformers' own loader (the renamings and fusions ``from_pretrained`` applies, e.g. a
MoE layer's experts stacked into one tensor), and each layer is called with the very
arguments the model's own forward passes it (the rotary embedding, the attention mask, the
position ids), recorded by running that forward once per record with every decoder layer
stubbed out.  The ops are those of the in-memory forward, in the same order, so the states
are equal bit for bit (tests/test_audit_layered.py).

This module imports nothing of hsextract's: the audit imports it.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The checkpoint's index when its weights are sharded over several files.
INDEX_FILE = "model.safetensors.index.json"
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: transformers' switch for loading in the calling thread.
_SYNC = "HF_DEACTIVATE_ASYNC_LOAD"
_LIBC: Any = None


class LayeredError(RuntimeError):
    """The checkpoint does not load module by module into the model's class (a tensor the
    module needs is missing, or has another shape): said rather than computed wrong."""


# -- the checkpoint, read by its headers -----------------------------------------------


def tensor_files(model_path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: from the index when the checkpoint
    is sharded (``model.safetensors.index.json``), else from each file's header."""
    model_path = Path(model_path)
    index = model_path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: model_path / f for k, f in weight_map.items()}
    out: dict[str, Path] = {}
    for f in sorted(model_path.glob("*.safetensors")):
        for name in _header(f):
            out[name] = f
    return out


def _header(path: Path) -> dict[str, dict]:
    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    return header


def largest_module_params(model_path: Path) -> int:
    """Parameters of the largest unit the layered forward holds at once: one decoder layer
    (tensors named ``...layers.<i>...``) or one other module (the embedding, the LM head),
    from the safetensors headers; 0 when the checkpoint is not safetensors."""
    groups: dict[str, int] = {}
    files = sorted(set(tensor_files(Path(model_path)).values()))
    for f in files:
        for name, t in _header(f).items():
            m = _LAYER_KEY.search(name)
            unit = name[: m.end()] if m else name.rpartition(".")[0]
            n = 1
            for d in t["shape"]:
                n *= int(d)
            groups[unit] = groups.get(unit, 0) + n
    return max(groups.values(), default=0)


def unavailable() -> str | None:
    """Why this transformers cannot load a model module by module (its loader's internals
    moved), or None when it can."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: F401
        from transformers.core_model_loading import (  # noqa: F401
            convert_and_load_state_dict_in_model,
            rename_source_key,
        )
        from transformers.modeling_utils import LoadStateDictConfig  # noqa: F401
    except ImportError as exc:
        return f"this transformers has no per-module loader ({exc})"
    return None


# -- the skeleton and its loader -------------------------------------------------------


class _Skeleton:
    """The model's class on the meta device in ``dtype``, with the checkpoint's tensors
    grouped by the module they load into (the model's names, after transformers'
    renamings)."""

    def __init__(self, model_path: Path, dtype: Any, device: str, files: dict[str, Path]):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        self.device, self.dtype, self.files = device, dtype, files
        config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        self.dec = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        if self.dec is None:
            self.dec = self.model.model
        # Non-persistent buffers (the rotary embedding's frequencies) are not in the
        # checkpoint: computed as from_pretrained computes them, by the model's own init.
        self._init_buffers(self.model)
        # The in-memory audit loads float32 and casts the whole model, buffers included,
        # for its run-dtype forward (keep-in-fp32 modules too): so does this skeleton.
        self.plan = self.model._get_dtype_plan(torch.float32) if dtype == torch.float32 else {}
        self.model.to(dtype)
        self.mapping = get_model_conversion_mapping(self.model)
        names = {id(m): n for n, m in self.model.named_modules()}
        self.layer_paths = [names[id(layer)] for layer in self.dec.layers]
        self.embed_path = names[id(self.model.get_input_embeddings())]
        self.norm_path = names[id(self.dec.norm)]
        head = self.model.get_output_embeddings()
        self.head_path = names[id(head)]
        meta_sd = self.model.state_dict()
        renamings = [w for w in self.mapping if isinstance(w, WeightRenaming)]
        converters = [w for w in self.mapping if not isinstance(w, WeightRenaming)]
        units = [*self.layer_paths, self.embed_path, self.norm_path, self.head_path]
        self.keys: dict[str, list[str]] = {u: [] for u in units}
        prefix = self.model.base_model_prefix
        for key in files:
            target, _ = rename_source_key(key, renamings, converters, prefix, meta_sd)
            if target not in meta_sd and key in meta_sd:
                target = key
            for u in units:
                if target.startswith(u + "."):
                    self.keys[u].append(key)
                    break
        # Weights tied to the embedding (no LM head in the checkpoint): the head is the
        # embedding's tensor, as tie_weights makes it.
        tie = getattr(config.get_text_config(), "tie_word_embeddings", False)
        self.tied = bool(tie) and not self.keys[self.head_path]

    def _init_buffers(self, module: Any) -> None:
        for sub in module.modules():
            if not any(b.is_meta for n, b in sub.named_buffers(recurse=False)
                       if n in sub._non_persistent_buffers_set):  # fmt: skip
                continue
            if next(sub.parameters(recurse=False), None) is not None:
                # to_empty would allocate its weights too, and _init_weights draw them
                raise LayeredError(f"{type(sub).__name__} holds weights beside computed buffers")
            sub.to_empty(device="cpu", recurse=False)
            self.model._init_weights(sub)
            sub.to(self.device)

    def load(self, path: str, keys: list[str] | None = None) -> Any:
        """Materialize the module at ``path`` from its checkpoint tensors (only those are
        read), on the device, through transformers' loader; every tensor it needs must
        come, in its shape."""
        from safetensors import safe_open
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.utils import logging as hf_logging

        module = self.model.get_submodule(path)
        keys = self.keys[path] if keys is None else keys
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.files[k], []).append(k)
        handles = [safe_open(str(f), framework="pt", device="cpu") for f in by_file]
        try:
            sd = {
                k: h.get_slice(k)
                for h, ks in zip(handles, by_file.values(), strict=True)
                for k in ks
            }
            conf = LoadStateDictConfig(
                device_map={"": self.device},
                dtype=self.dtype,
                dtype_plan=self.plan,
                weight_mapping=self.mapping,
            )
            bar = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()  # one bar per module would flood the log
            # Loaded in this thread: tensors the loader's worker threads allocate stay in
            # their malloc arenas once freed (measured: +30 MB resident per 61 MB layer).
            sync = os.environ.get(_SYNC)
            os.environ[_SYNC] = "1"
            try:
                info, _ = convert_and_load_state_dict_in_model(self.model, sd, conf)
            finally:
                if bar:
                    hf_logging.enable_progress_bar()
                if sync is None:
                    del os.environ[_SYNC]
                else:
                    os.environ[_SYNC] = sync
        finally:
            for h in handles:
                h.__exit__(None, None, None)
        self._init_buffers(module)
        module.to(self.device)
        left = [n for n, t in module.state_dict().items() if t.is_meta]
        bad = sorted(str(m[0]) for m in info.mismatched_keys if str(m[0]).startswith(path))
        if left or bad:
            raise LayeredError(
                f"{path} did not load from the checkpoint: "
                + (f"missing {left[:4]}" if left else "")
                + (f" shapes differ for {bad[:4]}" if bad else "")
            )
        return module

    def free(self, path: str) -> None:
        """Back to meta: the module's memory is released before the next one loads."""
        self.model.get_submodule(path).to("meta")
        if path == self.head_path and self.tied:  # the head was the embedding's tensor
            self.model.get_submodule(self.embed_path).to("meta")
        _trim()

    def load_head(self) -> Any:
        head = self.model.get_submodule(self.head_path)
        if not self.tied:
            return self.load(self.head_path)
        emb = self.load(self.embed_path)
        head.weight = emb.weight
        return head


def _trim() -> None:
    """Give the freed module's pages back to the OS now: glibc keeps freed heap memory,
    so without this the resident size grows layer after layer (where there is no glibc,
    nothing to do)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - absent outside glibc
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


# -- the forward -----------------------------------------------------------------------


class _Stop(Exception):
    """Raised at the final norm: the recording forward has what it came for."""


@dataclass
class _Stream:
    """One forward's records in flight: each record's hidden state and the arguments the
    model's forward gives each layer (recorded, then replayed with the real layer)."""

    states: list[Any]
    calls: list[dict[int, tuple[tuple, dict]]]
    captured: list[dict[int | str, Any]] = field(default_factory=list)


def _record(sk: _Skeleton, ids_list: list[list[int]], num_layers: int) -> _Stream:
    """The model's own forward per record, its decoder layers stubbed: what enters layer 0
    (the embedding, scaled where the model scales it) and every layer's call arguments."""
    import torch

    dec = sk.dec
    calls: list[dict[int, tuple[tuple, dict]]] = []
    states = []
    for ids in ids_list:
        rec: dict[int, tuple[tuple, dict]] = {}
        for i in range(num_layers):
            dec.layers[i].forward = _stub(rec, i)
        dec.norm.forward = _stop
        try:
            with torch.inference_mode():
                dec(input_ids=torch.tensor([ids], device=sk.device), use_cache=False)
        except _Stop:
            pass
        finally:
            for i in range(num_layers):
                del dec.layers[i].forward
            del dec.norm.forward
        if sorted(rec) != list(range(num_layers)):
            raise LayeredError(f"the model's forward called layers {sorted(rec)}")
        first_args, first_kwargs = rec[0]
        states.append(first_args[0] if first_args else first_kwargs["hidden_states"])
        calls.append(rec)
    return _Stream(states, calls, [{} for _ in ids_list])


def _stub(rec: dict[int, tuple[tuple, dict]], i: int) -> Callable[..., Any]:
    """Layer ``i``'s forward while recording: keeps its arguments, passes the state on."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        rec[i] = (args, kwargs)
        return args[0] if args else kwargs["hidden_states"]

    return forward


def _stop(*args: Any, **kwargs: Any) -> Any:
    raise _Stop


def _through(layer: Any, s: _Stream, i: int, wanted: set[int]) -> None:
    import torch

    with torch.inference_mode():
        for r, h in enumerate(s.states):
            if i in wanted:
                s.captured[r][i] = h[0].detach().to("cpu", torch.float64)
            args, kwargs = s.calls[r][i]
            if args:
                out = layer(h, *args[1:], **kwargs)
            else:
                out = layer(**{**kwargs, "hidden_states": h})
            s.states[r] = out[0] if isinstance(out, tuple) else out


def _final(norm: Any, s: _Stream, num_layers: int, wanted: set[int]) -> None:
    import torch

    with torch.inference_mode():
        for r, h in enumerate(s.states):
            if num_layers in wanted:
                s.captured[r][num_layers] = h[0].detach().to("cpu", torch.float64)
            s.captured[r]["final"] = norm(h)[0].detach().to("cpu", torch.float64)
        s.states = []


@dataclass
class Reference:
    """What the audit needs of the model's forward: the captured states per record (as
    ``forward_states`` gives them), the LM head's top-1 of those and of ``stored``, and the
    same for the second forward in the run's dtype (None for a float32 run)."""

    refs: list[dict]
    ref_top1: list[Any]
    stored_top1: list[Any]
    noise_refs: list[dict] | None = None
    noise_top1: list[Any] | None = None


def reference(
    model_path: Path,
    ids_list: list[list[int]],
    wanted: set[int],
    noise_keys: set[int],
    num_layers: int,
    device: str,
    run_dtype: str,
    stored_finals: list[Any],
    say: Callable[[str], None] | None = None,
) -> Reference:
    """Every record through the model one module at a time, in float32 and (for a bf16 or
    fp16 run) again in the run's dtype: each decoder layer is read once, run in float32
    over every record, cast in place to the run's dtype (as the in-memory audit casts its
    model) and run over every record again, then freed."""
    import torch

    files = tensor_files(Path(model_path))
    sk = _Skeleton(Path(model_path), torch.float32, device, files)
    low = None
    if run_dtype != "float32":
        # The run-dtype forward's own embedding, rotary buffers, norm and head (its
        # layers are the float32 ones cast): the in-memory audit casts all of them.
        low = _Skeleton(Path(model_path), getattr(torch, run_dtype), device, files)
    sk.load(sk.embed_path)
    main = _record(sk, ids_list, num_layers)
    sk.free(sk.embed_path)
    noise = None
    if low is not None:
        low.load(low.embed_path)
        noise = _record(low, ids_list, num_layers)
        low.free(low.embed_path)
    t0 = time.monotonic()
    for i in range(num_layers):
        t = time.monotonic()
        layer = sk.load(sk.layer_paths[i])
        t_load = time.monotonic() - t
        _through(layer, main, i, wanted)
        if noise is not None:
            layer.to(getattr(torch, run_dtype))
            _through(layer, noise, i, noise_keys)
        sk.free(sk.layer_paths[i])
        if say is not None and i == 0:
            took = time.monotonic() - t0
            say(
                f"layer 0 of {num_layers}: {took:.2f}s ({t_load:.2f}s of it reading and "
                f"loading its weights); about {took * (num_layers - 1):.1f}s left for the rest"
            )
    _final(sk.load(sk.norm_path), main, num_layers, wanted)
    sk.free(sk.norm_path)
    head = sk.load_head()
    ref_top1 = [_top1(head, c["final"]) for c in main.captured]
    stored_top1 = [_top1(head, s) for s in stored_finals]
    sk.free(sk.head_path)
    out = Reference(main.captured, ref_top1, stored_top1)
    if low is not None and noise is not None:
        _final(low.load(low.norm_path), noise, num_layers, noise_keys)
        low.free(low.norm_path)
        head = low.load_head()
        out.noise_refs = noise.captured
        out.noise_top1 = [_top1(head, c["final"]) for c in noise.captured]
    return out


def _top1(head: Any, states: Any) -> Any:
    import torch

    w = head.weight
    with torch.inference_mode():
        return head(states.to(w.device, w.dtype)).argmax(-1).cpu()
