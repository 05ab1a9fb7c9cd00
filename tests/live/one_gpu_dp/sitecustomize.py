"""Test-only shim: two SGLang DP workers on the one H200 (tests/live/test_dp_live.py).

SGLang 0.5.14 asserts ``gpu_id_step >= 1``, so DP worker d asks for GPU d; and CUDA treats a
device listed twice in ``CUDA_VISIBLE_DEVICES`` as no device at all (seen live: the launcher
fails with "No accelerator ... is available").  So the config lists GPU 0 once per worker
(``CUDA_VISIBLE_DEVICES=0,0``, which hsextract's own GPU accounting reads), and in the
server's processes this shim keeps that list aside, hands CUDA the de-duplicated one, and maps
SGLang's per-worker device choice (``maybe_reindex_device_id``, used with
``SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1``) through the kept list.  Active only where
``HSEXTRACT_LIVE_ONE_GPU_DP=1`` (the test's ``sglang.extra_env``); on a node with a GPU per
worker nothing of this is needed.
"""

import contextlib
import os

if os.environ.get("HSEXTRACT_LIVE_ONE_GPU_DP") == "1":
    _kept = os.environ.setdefault(
        "HSEXTRACT_LIVE_DP_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0")
    ).split(",")
    _unique = list(dict.fromkeys(_kept))
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(_unique)

    import sglang.srt.utils.common as _common

    _original = _common.maybe_reindex_device_id

    @contextlib.contextmanager
    def _reindex(gpu_id: int):
        with _original(_unique.index(_kept[gpu_id])) as local:
            yield local

    _common.maybe_reindex_device_id = _reindex
