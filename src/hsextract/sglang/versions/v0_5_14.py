"""SGLang 0.5.14: the release whose ``torch==2.11.0`` pin matches the H200 machine (it runs
live there: ../h200/) and the one SpecForge's own capture patch targets.

- Options: ``A[T, Arg(...)]`` fields of the ``ServerArgs`` dataclass in server_args.py.
- No ``--enable-return-aux-hidden-states`` (``--enable-return-hidden-states`` returns only
  the last chunk's states with chunked prefill), so hooks capture at each aux layer's
  ``input_layernorm``: its output ``(normed, residual)`` is the residual stream entering
  the layer (``residual`` alone, before the norm, for layer 0, whose input it is).
- DeepseekV2 layers return ``(hidden, residual, topk)`` and take SGLang's aux capture as a
  plain list (``captured_last_layer_outputs.append``): the patch's collector appends.
- With tp_size > 1 on SM90 it auto-enables FlashInfer's fused all-reduce + add + norm for
  DeepSeek-V3 (server_args.py), which bypasses ``input_layernorm``'s module call: hooks
  mode disables it (the patch captures through SGLang's own path, which handles it).
- ``--enable-deterministic-inference`` aligns chunked prefill to 4096 tokens for triton and
  flashinfer (scheduler.py ``init_deterministic_inference_config``); a smaller chunk
  makes ``PrefillAdder`` return ``OTHER`` for every longer record, which then waits in the
  queue forever with no error (seen live: 60-token records served, longer ones never).
- No float32 serving on CUDA: sgl-kernel's ``rmsnorm`` has no float32 path, so the
  scheduler dies at the first request (seen live on the H200, DeepSeek-V3 and Qwen3).

The base of the releases after it: each of ``v0_5_15_post1`` ... ``v0_5_23`` is this
declaration with what that release changed.
"""

from hsextract.sglang.versions import SglangVersion

#: Releases pinning sglang-kernel 0.4.4 (0.5.14, 0.5.15.post1) call its rmsnorm the same way.
FP32_ON_KERNEL_044 = (
    "its CUDA RMSNorm (sgl-kernel 0.4.4 rmsnorm) has no float32 kernel: the server "
    "starts, then dies at the first request ('rmsnorm ... failed to dispatch data type "
    "Float', seen on an H200 with SGLang 0.5.14)"
)

VERSION = SglangVersion(
    version="0.5.14",
    args_files=("srt/server_args.py",),
    args_classes="ServerArgs",
    hooks="layernorm",
    hooks_tp_args=("--enforce-disable-flashinfer-allreduce-fusion",),
    context_headroom=7,
    deterministic_align=(
        ("flashinfer", "SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE", 4096),
        ("triton", "SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE", 4096),
    ),
    unserved_dtypes=(("float32", FP32_ON_KERNEL_044), ("float", FP32_ON_KERNEL_044)),
    torch="2.11.0",
    sglang_kernel="0.4.4",
)
