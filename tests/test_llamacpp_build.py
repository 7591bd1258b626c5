"""llama.cpp as the suite and the benchmarks install it (bench/llamacpp_build.py, bench/llamacpp_pick.py).

The venv's build is this CPU's (its key is the one this machine's compiler gives now), was compiled without AMX
(the flags on ggml's compile line, and no tile instruction in any of its libraries), and llama.cpp itself reports
no AMX. The flags are shown to strip AMX from a Sapphire Rapids target (where plain `-march` turns it on), keys to
differ between instruction sets, the tile check to find real tile code, and a benchmark to fall back from a build
that dies to the venv's, naming the signal.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import llamacpp_build as lb
from bench import llamacpp_pick as pick
from engines.checkpoints.fetch import assemble_gguf, registry_model

MODELS_HOME = Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")).expanduser()
AMX_MACROS = {"#define __AMX_TILE__ 1", "#define __AMX_INT8__ 1", "#define __AMX_BF16__ 1"}


def test_noamx_flags_strip_amx_from_an_amx_target_and_keep_the_rest() -> None:
    """`-march=sapphirerapids` stands in for `-march=native` on an AMX Xeon."""
    noamx = lb.variant_flags("native-noamx")
    assert {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"} <= set(noamx)
    plain = set(lb.target_macros((), "sapphirerapids"))
    stripped = set(lb.target_macros(noamx, "sapphirerapids"))
    assert plain >= AMX_MACROS  # the check could fail: -march alone turns AMX on
    assert not any("__AMX_" in m for m in stripped)
    assert {"#define __AVX512VNNI__ 1", "#define __AVX512BF16__ 1", "#define __AVX512F__ 1"} <= stripped
    assert plain - stripped == {m for m in plain if "__AMX_" in m}  # nothing but AMX is lost
    assert lb.variant_flags("native") == ()
    with pytest.raises(ValueError, match="native-noamx"):
        lb.variant_flags("portable")


def test_a_wheel_is_keyed_by_the_instructions_it_targets() -> None:
    flags = lb.variant_flags("native-noamx")
    builds = {march: lb.Build("native-noamx", flags, lb.target_macros(flags, march))
              for march in ("x86-64-v3", "znver3", "x86-64-v4", "sapphirerapids")}  # fmt: skip
    assert len({b.key for b in builds.values()}) == 4  # an AVX2 box never finds an AVX-512 box's wheel
    assert len({b.folder for b in builds.values()}) == 4
    again = lb.Build("native-noamx", flags, lb.target_macros(flags, "x86-64-v4"))
    assert again.key == builds["x86-64-v4"].key  # the same CPU kind reuses its own
    assert lb.Build("native", (), again.macros).key != again.key


def test_the_tile_check_finds_tile_code(tmp_path: Path) -> None:
    """A library with AMX intrinsics compiled in (not run) is caught; the same code without them is clean."""
    source = tmp_path / "tiles.c"
    source.write_text(
        "#include <immintrin.h>\n"
        "void dot(const void *a, const void *b, void *c) {\n"
        "#ifdef __AMX_INT8__\n"
        "  _tile_loadd(1, a, 64); _tile_loadd(2, b, 64); _tile_dpbusd(0, 1, 2); _tile_stored(0, c, 64);\n"
        "#endif\n"
        "}\n"
    )
    found = {}
    for name, flags in (("amx", ["-mamx-tile", "-mamx-int8"]), ("noamx", list(lb.variant_flags("native-noamx")))):
        lib = tmp_path / name / f"lib{name}.so"
        lib.parent.mkdir()
        subprocess.run([lb.compiler(), "-O2", "-shared", "-fPIC", *flags, str(source), "-o", str(lib)], check=True)
        found[name] = lb.tile_instructions(lib.parent)
    assert sum(found["amx"].values()) >= 4 and found["noamx"] == {}


def test_a_wheel_without_its_record_is_finished_from_its_log_or_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build stopped in its tile check leaves pip's wheel and no build.json (as a CI cache once did): the wheel
    is not taken as built; with pip's log beside it the check runs and the record is written, a wheel with tile
    code is deleted, and without the log it is built again."""
    monkeypatch.setattr(lb, "HOME", tmp_path)
    b = lb.plan("native-noamx")
    b.folder.mkdir(parents=True)
    source = tmp_path / "f.c"
    source.write_text("int f(int x) { return x + 1; }\n")
    lib = tmp_path / "libggml-cpu.so"
    subprocess.run([lb.compiler(), "-O2", "-shared", "-fPIC", str(source), "-o", str(lib)], check=True)
    wheel = b.folder / f"llama_cpp_python-{lb.VERSION}-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(lib, "llama_cpp/lib/libggml-cpu.so")
    assert b.wheel() is None and b.built_wheel() == wheel and not lb.resumable(b)  # no log: built again
    line = "cc -march=native -mno-amx-tile -O3 -c ggml-cpu.c -o ggml-cpu.c.o"
    (b.folder / "build.log").write_text(f"[3/40] {line}\n")
    assert lb.resumable(b)
    said: list[str] = []
    assert lb.finish(b, None, said.append) == wheel and b.wheel() == wheel
    info = b.info()
    assert (info["variant"], info["key"], info["compile_line"], info["tile_instructions"]) == (
        "native-noamx", b.key, line, {})  # fmt: skip
    assert said == [f"built {wheel.name} (checked and recorded)"] and not lb.resumable(b)
    (b.folder / "build.json").unlink()
    monkeypatch.setattr(lb, "tile_instructions", lambda path: {"libggml-cpu.so": 7})
    with pytest.raises(SystemExit, match="AMX tile instructions"):
        lb.finish(b, None, said.append)
    assert not wheel.exists() and b.wheel() is None and not (b.folder / "build.json").exists()


def test_the_venvs_build_is_this_cpus_and_holds_no_tile_instruction() -> None:
    record = lb.installed()
    assert record is not None, "llama-cpp-python was not installed by `python -m bench.llamacpp_build install`"
    here = lb.plan("native-noamx")
    assert (record["variant"], record["key"], record["version"]) == ("native-noamx", here.key, lb.VERSION)
    assert not any("__AMX_" in m for m in record["macros"])
    line = record["compile_line"].split()
    assert "-march=native" in line and {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"} <= set(line)
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    assert sorted(p.name for p in lib.glob("libggml-cpu*.so*")), "llama.cpp's CPU backend library is missing"
    assert lb.tile_instructions(lib) == {}
    info = lb.system_info()
    assert "AMX_INT8 = 1" not in info and "CPU :" in info, info


@pytest.fixture(scope="module")
def gguf() -> Path:
    return assemble_gguf(registry_model("smollm2-135m-instruct"), MODELS_HOME / "gguf", progress=False)


def test_a_build_that_dies_is_skipped_for_the_venvs(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on an AMX Xeon where the AMX build traps: the probe names the signal and the venv's build is measured."""
    assert pick.candidates(amx=True) == ["native", "native-noamx"] and pick.candidates(amx=False) == ["native-noamx"]
    trap = tmp_path / "site" / "llama_cpp"
    trap.mkdir(parents=True)
    (trap / "__init__.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    monkeypatch.setattr(pick, "candidates", lambda forced=None, amx=None: ["native", "native-noamx"])
    monkeypatch.setattr(pick, "unpacked", lambda variant, say: str(trap.parent))
    said: list[str] = []
    choice = pick.choose(gguf, 1, said.append)
    assert (choice.variant, choice.site, choice.key) == ("native-noamx", None, lb.installed()["key"])
    assert len(choice.skipped) == 1 and "native: died with SIGILL (signal 4)" in choice.skipped[0]
    assert any("does not run correctly here" in s for s in said)
    assert "skipped: native: died with SIGILL" in choice.describe()


def test_the_probe_compares_tokens_and_logits(gguf: Path) -> None:
    reference = pick.probe(None, gguf, 1)
    assert isinstance(reference, dict) and len(reference["tokens"]) == pick.PROBE_STEPS
    assert pick.agrees(reference, reference) is None
    other = {**reference, "tokens": [*reference["tokens"][:-1], reference["tokens"][-1] + 1]}
    assert "other greedy tokens" in pick.agrees(other, reference)
    noisy = {**reference, "logits": [-x for x in reference["logits"]]}
    assert "cosine" in pick.agrees(noisy, reference)


def test_a_benchmark_names_the_build_it_measured(gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.llamacpp_batched through the chosen build: batched greedy equals one sequence's; the build is named."""
    monkeypatch.setattr(pick, "CHOSEN", None)
    from bench.llamacpp_batched import llamacpp_batched_decode

    prompt = [1, 504, 3458, 282, 4649, 314]
    one = llamacpp_batched_decode(gguf, [prompt], 6, 1)
    two = llamacpp_batched_decode(gguf, [prompt, prompt], 6, 1)
    assert one["tokens"][0] == two["tokens"][0] == two["tokens"][1]
    assert pick.measured() is not None and pick.measured().startswith("native-noamx (key ")
    assert sys.modules["llama_cpp"].__file__.startswith(sys.prefix)  # the venv's build, not another folder's
