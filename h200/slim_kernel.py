"""Repack an sglang-kernel wheel without the kernels the H200 runs never load (FA3's
flash_ops, FlashMLA, InfLLM-V2's ops, the SM100 build): 0.4.4 1.8 GB -> 17 MB, 0.4.5
1.2 GB -> 17 MB, inside the device's 64 MiB.  ``sgl_kernel`` imports only
``sm90/common_ops`` on Hopper; the dropped ones load on first use of their kernels
(``flash_attn``, ``flash_mla``, ``infllm_v2._loader``), which ``--attention-backend
triton`` on a DeepSeek/Qwen3 model never reaches.

usage: python h200/slim_kernel.py IN.whl OUT_DIR
"""

import fnmatch
import os
import sys
import zipfile

DROP = (
    "sgl_kernel/flash_ops.abi3.so",
    "sgl_kernel/flashmla_ops.abi3.so",
    "sgl_kernel/sm100/common_ops.abi3.so",
    "sgl_kernel/infllm_ops*.so",  # 0.4.5 on
)


def _dropped(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in DROP)


def main(src: str, outdir: str) -> None:
    os.makedirs(outdir, exist_ok=True)
    dst = os.path.join(outdir, os.path.basename(src))
    if os.path.exists(dst):
        return
    tmp = dst + ".tmp"
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            if _dropped(info.filename):
                continue
            data = zi.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                keep = [ln for ln in data.split(b"\n") if not _dropped(ln.split(b",")[0].decode())]
                data = b"\n".join(keep)
            zo.writestr(info, data)
    os.replace(tmp, dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
