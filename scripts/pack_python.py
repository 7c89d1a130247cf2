"""A trimmed, relocatable copy of the running Python and NumPy, for the GPU kit: the shared
libpython, the `python` executable (pyop's worker processes start it), the standard library
without its tests and GUI parts, and NumPy in its own site-packages.

    pythonX.Y scripts/pack_python.py DEST [PYTHON_WITH_PIP]

Run it with the interpreter to copy. NumPy is installed with that interpreter's pip, or with
PYTHON_WITH_PIP's (for this Python version and platform) when it has none.
"""

import os
import shutil
import subprocess
import sys
import sysconfig

dest = sys.argv[1]
pip_python = sys.argv[2] if len(sys.argv) > 2 else None
ver = "%d.%d" % sys.version_info[:2]
NUMPY = "numpy==2.2.6"

libdir = sysconfig.get_config_var("LIBDIR")
soname = sysconfig.get_config_var("INSTSONAME")
if not soname or not os.path.exists(os.path.join(libdir, soname)):
    sys.exit(
        "pack_python: %s has no shared libpython (build it with --enable-shared)" % sys.executable
    )

os.makedirs(os.path.join(dest, "lib"), exist_ok=True)
os.makedirs(os.path.join(dest, "bin"), exist_ok=True)
shutil.copy2(os.path.join(libdir, soname), os.path.join(dest, "lib", soname))
exe = os.path.join(dest, "bin", "python" + ver)
shutil.copy2(os.path.realpath(sys.executable), exe)
os.symlink("python" + ver, os.path.join(dest, "bin", "python3"))

stdlib = sysconfig.get_paths()["stdlib"]
SKIP = {
    "test",
    "tests",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "site-packages",
    "__pycache__",
    "pydoc_data",
    "venv",
}


def ignore(directory, names):
    skipped = {n for n in names if n in SKIP or n.startswith("config-")}
    skipped |= {
        n for n in names if n.startswith(("_test", "xxlimited", "_tkinter", "_ctypes_test"))
    }
    return skipped


std_dest = os.path.join(dest, "lib", "python" + ver)
shutil.copytree(stdlib, std_dest, ignore=ignore, symlinks=True)
site = os.path.join(std_dest, "site-packages")
os.makedirs(site)

have_pip = (
    subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
)
if have_pip:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--target",
        site,
        NUMPY,
    ]
else:
    if not pip_python:
        sys.exit("pack_python: no pip for %s and none given" % sys.executable)
    cmd = [
        pip_python,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--target",
        site,
        "--only-binary=:all:",
        "--python-version",
        ver,
        "--platform",
        "manylinux2014_x86_64",
        NUMPY,
    ]
subprocess.run(cmd, check=True)

# NumPy's own tests, and byte code (Python writes it again where it may).
for top, dirs, _files in os.walk(dest, topdown=True):
    for d in list(dirs):
        if d in ("tests", "__pycache__"):
            shutil.rmtree(os.path.join(top, d))
            dirs.remove(d)
# Symbols nobody reads on the GPU machine: libpython, the executable and the standard library's
# extensions (not site-packages: wheels' libraries are patched by auditwheel, which strip can
# break).
for top, dirs, files in os.walk(dest):
    dirs[:] = [d for d in dirs if d != "site-packages"]
    for f in files:
        path = os.path.join(top, f)
        if (".so" in f or f.startswith("python")) and not os.path.islink(path):
            subprocess.run(["strip", "--strip-unneeded", path], capture_output=True)
print("pack_python: Python %s with %s in %s" % (sys.version.split()[0], NUMPY, dest))
