"""The llama.cpp build a benchmark measures: the fastest that runs here correctly, and it says which.

On a CPU with AMX (`amx_int8` in /proc/cpuinfo) the candidates are `native` (AMX tiles included) then
`native-noamx`; elsewhere only `native-noamx`, the venv's own (bench/llamacpp_build.py; on such a CPU the two
would be the same instructions). A candidate other than the venv's is built on demand (once per CPU kind, minutes)
and unpacked into its own folder, and must first pass a probe: a child process loads the benchmark's GGUF, prefills
a ~150-token prompt with the benchmark's thread count (the quantized matmuls at many rows: where AMX runs),
greedy-decodes PROBE_STEPS tokens, and must exit normally with the venv build's tokens and last logits (cosine ≥
MIN_COSINE). A candidate that dies (its signal and the end of its output are printed) or answers otherwise is
skipped. `SWITCHBOARD_LLAMACPP_BUILD=native-noamx` (or `native`) names the build instead of trying candidates.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np

from bench.llamacpp_build import VARIANTS, ensure_installed, plan, system_info
from engines.kernels.cpu_info import cpu_flags

PROBE_STEPS = 4
MIN_COSINE = 0.999  # the same weights through another matmul path: equal up to float rounding
PROMPT = " ".join(["The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill."] * 8)
_PROBE = f"""
import json, sys
import numpy as np
import llama_cpp
gguf, threads, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=512,
                      verbose=False)
tokens = llm.tokenize(prompt.encode())

def last_logits():
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()

llm.eval(tokens)
picked = []
for _ in range({PROBE_STEPS}):
    picked.append(int(np.argmax(last_logits())))
    llm.eval([picked[-1]])
print(json.dumps({{"tokens": picked, "logits": last_logits().tolist()}}))
"""


@dataclass
class Choice:
    variant: str
    key: str
    site: str | None  # a folder to put first on sys.path; None: the venv's own build
    skipped: list[str] = field(default_factory=list)  # candidates tried first, and why each was passed over

    def describe(self) -> str:
        where = "the venv's" if self.site is None else self.site
        tried = f"; skipped: {'; '.join(self.skipped)}" if self.skipped else ""
        return f"{self.variant} (key {self.key}, {where}){tried}"


def cpu_has_amx(text: str | None = None) -> bool:
    """Whether the CPU (or another machine's /proc/cpuinfo `text`) has AMX int8 tiles."""
    return "amx_int8" in cpu_flags(text)


def candidates(forced: str | None = None, amx: bool | None = None) -> list[str]:
    """The builds to try, fastest first."""
    if forced:
        if forced not in VARIANTS:
            raise SystemExit(f"SWITCHBOARD_LLAMACPP_BUILD={forced!r}: known builds are {', '.join(VARIANTS)}")
        return [forced]
    return ["native", "native-noamx"] if (cpu_has_amx() if amx is None else amx) else ["native-noamx"]


def probe(site: str | None, gguf: Path, threads: int) -> dict | str:
    """The probe's tokens and last logits from the build at `site` (None: the venv's), or why it failed."""
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(gguf), str(threads), PROMPT], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        return f"died with {name} (signal {-proc.returncode}); its last output: {proc.stderr[-400:].strip()!r}"
    if proc.returncode != 0:
        return f"exited {proc.returncode}: {proc.stderr[-400:].strip()!r}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def agrees(got: dict, reference: dict) -> str | None:
    """None where the probe's answers are the reference's, else how they differ."""
    if got["tokens"] != reference["tokens"]:
        return f"other greedy tokens ({got['tokens']} against {reference['tokens']})"
    a, b = np.asarray(got["logits"]), np.asarray(reference["logits"])
    cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    return None if cosine >= MIN_COSINE else f"last logits' cosine {cosine:.5f} < {MIN_COSINE}"


def unpacked(variant: str, say: Callable[[str], None]) -> str:
    """A folder holding the variant's `llama_cpp` package, built first when missing."""
    from bench.llamacpp_build import build

    b = plan(variant)
    site = b.folder / "site"
    if not (site / "llama_cpp").is_dir():
        wheel = b.wheel() or build(b, say)
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
        subprocess.run([*pip, "--target", str(site), str(wheel)], check=True)
    return str(site)


def choose(gguf: Path, threads: int, say: Callable[[str], None]) -> Choice:
    record = ensure_installed(say=say)
    skipped: list[str] = []
    reference: dict | str | None = None
    for variant in candidates(os.environ.get("SWITCHBOARD_LLAMACPP_BUILD") or None):
        if variant == record["variant"]:
            return Choice(variant, record["key"], None, skipped)
        site = unpacked(variant, say)
        if reference is None:
            reference = probe(None, gguf, threads)
            if isinstance(reference, str):
                raise SystemExit(f"the venv's llama.cpp build ({record['variant']}) fails its probe: {reference}")
        got = probe(site, gguf, threads)
        why = got if isinstance(got, str) else agrees(got, reference)
        if why is None:
            return Choice(variant, plan(variant).key, site, skipped)
        skipped.append(f"{variant}: {why}")
        say(f"llama.cpp's {variant} build does not run correctly here, so it is not measured: {why}")
    return Choice(record["variant"], record["key"], None, skipped)


CHOSEN: Choice | None = None


def load(gguf: Path, threads: int, say: Callable[[str], None]) -> ModuleType:
    """`llama_cpp` from the chosen build, imported once per process; says which build it is."""
    global CHOSEN
    if CHOSEN is None:
        CHOSEN = choose(gguf, threads, say)
        if CHOSEN.site is not None:
            sys.path.insert(0, CHOSEN.site)
        say(f"llama.cpp build measured: {CHOSEN.describe()}")
        say(f"llama.cpp system info: {system_info(CHOSEN.site)}")
    import llama_cpp

    return llama_cpp


def measured() -> str | None:
    """The build the benchmark measured, for its JSON line (None: llama.cpp did not run)."""
    return None if CHOSEN is None else CHOSEN.describe()
