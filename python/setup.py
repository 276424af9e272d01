"""Builds libmemres.so with cargo and bundles it in the `memres` package.

Why not maturin or setuptools-rust: libmemres is a plain C library that the package loads
with ctypes. maturin would wrap a cdylib without PyO3 in a cffi module (a run-time
dependency), and setuptools-rust names it as a CPython extension, tagging the wheel for
one Python version; neither is needed here. So the build is one cargo call, and the
wheel is tagged `py3-none-<platform>`: any Python 3 on that platform can load it.

Environment: CARGO (the cargo to run), CARGO_TARGET_DIR (cargo's own), MEMRES_CARGO_PROFILE
(default "release").
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from wheel.bdist_wheel import bdist_wheel
except ImportError:  # wheel is a build requirement; without it there is no wheel to tag
    bdist_wheel = None

HERE = pathlib.Path(__file__).resolve().parent
MANIFEST = HERE.parent / "capi" / "Cargo.toml"


def say(line):
    """Shows a line during the build: pip keeps a build's output to itself unless run with
    -v, so the line also goes to the terminal, when there is one."""
    print(line, file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        return
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line + "\n")
    except OSError:
        pass  # no terminal (CI, a pipe): pip -v shows the line above


def build_libmemres():
    """Runs cargo on the C ABI package; returns the path of the libmemres.so it built."""
    if not MANIFEST.is_file():
        raise SystemExit(
            f"memres: {MANIFEST} not found; install from a checkout of the memres repository "
            "(pip install ./python)"
        )
    cargo = os.environ.get("CARGO") or shutil.which("cargo")
    if not cargo:
        raise SystemExit("memres: building libmemres.so needs Rust's cargo (https://rustup.rs)")
    profile = os.environ.get("MEMRES_CARGO_PROFILE", "release")
    cmd = [cargo, "build", "--manifest-path", str(MANIFEST), "--lib", "--profile", profile]
    cmd += ["--message-format=json-render-diagnostics"]
    say(
        f"memres: building libmemres.so with cargo ({profile}; about a minute on 2 cores "
        "the first time; pip install -v shows cargo's progress)"
    )
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"memres: cargo failed ({done.returncode}); see its output above")
    for line in done.stdout.splitlines():
        message = json.loads(line)
        if message.get("reason") != "compiler-artifact":
            continue
        if message["target"]["name"] == "memres" and "cdylib" in message["target"]["kind"]:
            for path in message["filenames"]:
                if path.endswith(".so"):
                    return pathlib.Path(path)
    raise SystemExit("memres: cargo built no libmemres.so")


class BuildWithLibrary(build_py):
    """build_py that also puts a freshly built libmemres.so into the package."""

    def run(self):
        super().run()
        built = build_libmemres()
        target = pathlib.Path(self.build_lib) / "memres" / "libmemres.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, target)
        # The C header, for the PyTorch backend that memres/_torch.py compiles.
        shutil.copyfile(MANIFEST.parent / "include" / "memres.h", target.parent / "memres.h")


class BinaryDistribution(Distribution):
    """The package holds a native library: its wheel is platform-specific."""

    def has_ext_modules(self):
        return True


commands = {"build_py": BuildWithLibrary}

if bdist_wheel is not None:

    class PlatformWheel(bdist_wheel):
        """Tags the wheel py3-none-<platform>: the library does not use Python's ABI."""

        def get_tag(self):
            _, _, platform = super().get_tag()
            return "py3", "none", platform

    commands["bdist_wheel"] = PlatformWheel

setup(cmdclass=commands, distclass=BinaryDistribution)
