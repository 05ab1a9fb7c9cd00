"""Repack the sglang-kernel wheel without the kernels the H200 runs never load (FA3's
flash_ops, FlashMLA, the SM100 build): 1.8 GB -> 17 MB, inside the device's 64 MiB.

usage: python h200/slim_kernel.py IN.whl OUT_DIR
"""

import os
import sys
import zipfile

DROP = (
    "sgl_kernel/flash_ops.abi3.so",
    "sgl_kernel/flashmla_ops.abi3.so",
    "sgl_kernel/sm100/common_ops.abi3.so",
)


def main(src: str, outdir: str) -> None:
    os.makedirs(outdir, exist_ok=True)
    dst = os.path.join(outdir, os.path.basename(src))
    if os.path.exists(dst):
        return
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            if info.filename in DROP:
                continue
            data = zi.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                keep = [ln for ln in data.split(b"\n") if ln.split(b",")[0].decode() not in DROP]
                data = b"\n".join(keep)
            zo.writestr(info, data)


if __name__ == "__main__":
    main(*sys.argv[1:3])
