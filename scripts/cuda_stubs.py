"""Link stubs for the CUDA libraries candle links (cudarc's dynamic linking): one shared library
per CUDA library, with its SONAME, defining every function cudarc's bindings declare for it.
The GPU kit links against these here, where no GPU driver or cuBLAS is installed; at run time
the loader finds the real libraries by SONAME on the GPU machine. On a machine without a GPU the
kit runs with these instead: every function returns an error (CUDA_ERROR_NO_DEVICE for the
driver), so candle finds no CUDA device and the CPU cases run.

    python3 scripts/cuda_stubs.py CUDARC_SOURCE_DIR OUT_DIR
"""

import os
import re
import subprocess
import sys

cudarc, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)

# library (as `-l` names it): (cudarc's bindings, the SONAME CUDA 13 installs)
LIBS = {
    "cuda": ("src/driver/sys/mod.rs", "libcuda.so.1"),
    "cublas": ("src/cublas/sys/mod.rs", "libcublas.so.13"),
    "cublasLt": ("src/cublaslt/sys/mod.rs", "libcublasLt.so.13"),
    "curand": ("src/curand/sys/mod.rs", "libcurand.so.10"),
    "nvrtc": ("src/nvrtc/sys/mod.rs", "libnvrtc.so.13"),
}

for lib, (bindings, soname) in LIBS.items():
    text = open(os.path.join(cudarc, bindings)).read()
    names = sorted(set(re.findall(r"^pub unsafe fn (\w+)\(", text, re.M)))
    if not names:
        sys.exit("cuda_stubs: no functions found in %s" % bindings)
    source = os.path.join(out, "lib%s.c" % lib)
    with open(source, "w") as f:
        f.write(
            "/* Link stub for %s: %d functions from cudarc's bindings; never run. */\n"
            % (soname, len(names))
        )
        for n in names:
            # 100 is CUDA_ERROR_NO_DEVICE; for the libraries' own status codes, any non-zero
            # value is a failure.
            f.write("int %s(void) { return 100; }\n" % n)
    target = os.path.join(out, "lib%s.so" % lib)
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", target, "-Wl,-soname," + soname, source], check=True
    )
    # The name the loader asks for at run time.
    by_soname = os.path.join(out, soname)
    if os.path.lexists(by_soname):
        os.remove(by_soname)
    os.symlink("lib%s.so" % lib, by_soname)
    print("cuda_stubs: %s (%s, %d functions)" % (target, soname, len(names)))
