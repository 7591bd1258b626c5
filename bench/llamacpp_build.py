"""llama.cpp (llama-cpp-python) built for this CPU: never reused on another CPU kind, never with AMX tiles unless asked.

    .venv/bin/python -m bench.llamacpp_build install   # `make test` runs it first; a no-op when the venv is current
    .venv/bin/python -m bench.llamacpp_build show      # the installed build: variant, flags, key, llama.cpp's view

Why not `pip install llama-cpp-python`: pip builds it from source with `-march=native` and keeps the wheel in its
cache keyed by the version alone, so a machine that comes back with its cache on another CPU kind installs a wheel
holding instructions that CPU lacks (SIGILL); and on an Intel Xeon with AMX the native build's AMX matmul dies on
its first request (`tileloadd`, invalid opcode, in `ggml::cpu::amx`: ggml asks the kernel for the tile-data
permission once, on one thread; an open upstream pull request asks per thread), which took llama.cpp's server, a
test dependency, down mid-suite.

Variants:
- `native-noamx`: `-march=native` with every AMX option the compiler knows negated (`-mno-amx-tile -mno-amx-int8
  -mno-amx-bf16` on GCC 12): all of this CPU's vector instructions but the tiles. The test dependency, installed in
  the venv, and what the benchmarks measure unless the AMX build proves itself (bench/llamacpp_pick.py).
- `native`: `-march=native`, AMX included; the same instructions as `native-noamx` except on a CPU with AMX, where
  only the benchmarks build and try it.

A wheel lives in $SWITCHBOARD_HOME/llamacpp/<version>-<variant>-<key>/ beside build.json (flags, the compiler's
instruction-set macros, one compile line of ggml's CPU backend, the CPU it was built on). The key hashes the version,
the variant's flags and the macros the compiler predefines for `-march=native` plus those flags on this machine
(`cc -dM -E`): a wheel is reused only where the compiler targets exactly the same instructions. pip builds it with
`--no-cache-dir`, so its own wheel cache never holds one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engines.kernels.cpu_info import cpu_name

VERSION = "0.3.36"  # pinned: the suite's greedy answers and the bench baselines are this llama.cpp's
VARIANTS = ("native-noamx", "native")
HOME = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser() / "llamacpp"
# llama.cpp picks `-march=native` itself; no llava/mtmd library (multimodal only, ~40% of the build's steps).
CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
RECORD = Path(sys.prefix) / "llamacpp-build.json"  # which build this venv holds
# AMX's own instructions (tile config, loads, stores, dot products); none may appear in a `native-noamx` library.
TILE_OPS = re.compile(r"\b(ldtilecfg|sttilecfg|tileloadd\w*|tilestored|tilezero|tilerelease|tdp\w+)\b")
STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]")  # ninja's progress


def compiler() -> str:
    return os.environ.get("CC", "cc")


def amx_options(cc: str | None = None) -> list[str]:
    """Every `-mamx-*` option the compiler knows (GCC 12: tile, int8, bf16; later ones add fp16, complex...)."""
    out = subprocess.run([cc or compiler(), "-Q", "--help=target"], capture_output=True, text=True, check=True)
    return sorted(set(re.findall(r"-mamx-[a-z0-9-]+", out.stdout)))


def variant_flags(variant: str, cc: str | None = None) -> tuple[str, ...]:
    """The C/C++ flags a variant adds to llama.cpp's own (`-march=native` comes from GGML_NATIVE)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown llama.cpp build variant {variant!r}; known: {', '.join(VARIANTS)}")
    # An explicit -mno-X wins over -march's X whatever the order (GCC and clang), so these may precede -march=native.
    return () if variant == "native" else tuple(f"-mno-{o[2:]}" for o in amx_options(cc))


def target_macros(flags: tuple[str, ...], march: str = "native", cc: str | None = None) -> tuple[str, ...]:
    """The macros `-march=<march>` plus `flags` predefine beyond the compiler's defaults: the instruction set it
    targets (`__AVX512VNNI__`, `__AMX_INT8__`...) and its tuning."""

    def macros(extra: list[str]) -> set[str]:
        out = subprocess.run([cc or compiler(), *extra, "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                             text=True, check=True)  # fmt: skip
        return set(out.stdout.splitlines())

    return tuple(sorted(macros([f"-march={march}", *flags]) - macros([])))


@dataclass(frozen=True)
class Build:
    """One variant as this machine's compiler would build it."""

    variant: str
    flags: tuple[str, ...]
    macros: tuple[str, ...]

    @property
    def key(self) -> str:
        blob = json.dumps([VERSION, CMAKE_ARGS, self.variant, self.flags, self.macros])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def folder(self) -> Path:
        return HOME / f"{VERSION}-{self.variant}-{self.key}"

    def wheel(self) -> Path | None:
        """The finished build's wheel: one with its build.json (written after the tile check passed)."""
        return self.built_wheel() if (self.folder / "build.json").exists() else None

    def built_wheel(self) -> Path | None:
        """Whatever wheel pip left in the folder, finished or not."""
        return next(iter(sorted(self.folder.glob("*.whl"))), None)

    def info(self) -> dict:
        path = self.folder / "build.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def has_amx(self) -> bool:
        return any("__AMX_" in m for m in self.macros)


def plan(variant: str, march: str = "native") -> Build:
    flags = variant_flags(variant)
    return Build(variant, flags, target_macros(flags, march))


def build(b: Build, say: Callable[[str], None] = print) -> Path:
    """pip builds the wheel from source, not from or into its cache; progress from ninja's steps, the whole output
    in build.log beside the wheel."""
    b.folder.mkdir(parents=True, exist_ok=True)
    for stale in [*b.folder.glob("*.whl"), b.folder / "build.json"]:  # an unfinished try's
        stale.unlink(missing_ok=True)
    log = b.folder / "build.log"
    flags = " ".join(b.flags)
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "CFLAGS": flags, "CXXFLAGS": flags,
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}  # fmt: skip
    say(f"building llama-cpp-python {VERSION} ({b.variant}, flags: {flags or 'none'}) from source for this CPU: "
        f"about 5-15 minutes on 2 vCPUs; log: {log}")  # fmt: skip
    command = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-cache-dir", "--no-binary",
               "llama-cpp-python", "-w", str(b.folder), f"llama-cpp-python=={VERSION}"]  # fmt: skip
    started, last = time.monotonic(), 0.0
    with log.open("w") as out, subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                text=True) as proc:  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if (step := STEP.match(line)) and time.monotonic() - last > 30:
                last = time.monotonic()
                say(f"  llama.cpp build: step {step.group(1)}/{step.group(2)}, {last - started:.0f} s")
    if proc.returncode != 0 or b.built_wheel() is None:
        raise SystemExit(f"building llama-cpp-python failed (exit {proc.returncode}); see {log}")
    return finish(b, round(time.monotonic() - started), say)


def finish(b: Build, build_s: int | None, say: Callable[[str], None] = print) -> Path:
    """The tile check on the wheel pip built, then its build.json: a wheel counts as built only from here on."""
    wheel, log = b.built_wheel(), b.folder / "build.log"
    assert wheel is not None
    tiles = tile_instructions(wheel)
    if not b.has_amx() and tiles:
        wheel.unlink()
        raise SystemExit(f"the {b.variant} build holds AMX tile instructions ({tiles}); see {log}")
    info = {"version": VERSION, "cmake_args": CMAKE_ARGS, "variant": b.variant, "key": b.key, "flags": list(b.flags),
            "macros": list(b.macros), "compile_line": compile_line(log), "cpu": cpu_name(), "tile_instructions": tiles,
            "wheel": wheel.name, "build_s": build_s}  # fmt: skip
    part = b.folder / "build.json.part"  # renamed whole: a stopped write leaves no half record
    part.write_text(json.dumps(info, indent=1))
    part.replace(b.folder / "build.json")
    say(f"built {wheel.name}" + (f" in {build_s} s" if build_s is not None else " (checked and recorded)"))
    return wheel


def compile_line(log: Path) -> str:
    """One compile command of ggml's CPU backend from pip's verbose log: the flags the compiler really got."""
    with log.open(errors="replace") as lines:
        for line in lines:
            if "ggml-cpu.c.o" in line and " -c " in line:
                return line.split("] ", 1)[-1].strip()
    return ""


def resumable(b: Build) -> bool:
    """pip finished this wheel from its source here (its log says so) but the check after it did not: the build
    was stopped in the tile check, which reads every library's disassembly."""
    log = b.folder / "build.log"
    return b.wheel() is None and b.built_wheel() is not None and log.exists() and bool(compile_line(log))


def tile_instructions(path: Path) -> dict[str, int]:
    """AMX tile instructions by shared library (objdump's disassembly) in a wheel, a folder or one library."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z, tempfile.TemporaryDirectory() as tmp:
            z.extractall(tmp, [n for n in z.namelist() if ".so" in Path(n).name])
            return tile_instructions(Path(tmp))
    libs = [path] if path.is_file() else sorted(p for p in path.rglob("*.so*") if p.is_file() and not p.is_symlink())
    found: dict[str, int] = {}
    for lib in libs:
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True)
        if n := len(TILE_OPS.findall(asm.stdout)):
            found[lib.name] = n
    return found


def installed() -> dict | None:
    """The build record of the llama-cpp-python in this venv, if this module installed it."""
    try:
        return json.loads(RECORD.read_text())
    except (OSError, ValueError):
        return None


def install(b: Build, say: Callable[[str], None] = print) -> dict:
    """Into this venv: the wheel (built first when missing) with the `server` extra's requirements."""
    # A wheel without its record is one whose check never ended: finished from its log, else built again (pip's
    # wheel alone proves neither the flags nor the absence of tile instructions).
    wheel = b.wheel() or (finish(b, None, say) if resumable(b) else build(b, say))
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "--force-reinstall", "--no-deps", str(wheel)], check=True)
    subprocess.run([*pip, f"{wheel}[server]"], check=True)
    record = {**b.info(), "folder": str(b.folder)}
    RECORD.write_text(json.dumps(record, indent=1))
    say(f"installed llama-cpp-python {VERSION} ({b.variant}, key {b.key})")
    return record


def ensure_installed(variant: str = "native-noamx", say: Callable[[str], None] = print) -> dict:
    """This venv's llama-cpp-python is the build for this CPU, or becomes it (a different key: another CPU kind
    or compiler built what is there, or pip did)."""
    b = plan(variant)
    record = installed()
    if record and record.get("key") == b.key and (b.folder / "build.json").exists():
        return record
    return install(b, say)


def system_info(lib_dir: str | None = None) -> str:
    """llama.cpp's own account of the instructions it was compiled for, from a child process (loading a library
    built for another CPU must not take this process down)."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    env = {**os.environ, **({"PYTHONPATH": lib_dir} if lib_dir else {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    return out.stdout.strip() if out.returncode == 0 else f"(failed: exit {out.returncode}) {out.stderr[-300:]}"


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.llamacpp_build", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["install", "show"])
    ap.add_argument("--variant", choices=VARIANTS, default="native-noamx")
    args = ap.parse_args()
    if args.action == "install":
        record = ensure_installed(args.variant)
        print(f"llama-cpp-python {VERSION}: {record['variant']} build, key {record['key']}, built on {record['cpu']}")
        return 0
    record = installed()
    if record is None:
        print("no llama-cpp-python installed by bench.llamacpp_build in this venv (run its `install`)")
        return 1
    current = plan(record["variant"]).key
    print(json.dumps({**record, "macros": len(record["macros"]), "current_cpu_key": current}, indent=1))
    print(f"matches this CPU: {current == record['key']}")
    print(f"llama.cpp system info: {system_info()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
