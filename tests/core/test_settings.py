"""One settings object: defaults, a TOML file, and the environment on top."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from core.settings import Settings


def test_defaults_serve_the_qwen_pair_on_sqlite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWITCHBOARD_HOME", raising=False)
    s = Settings()
    assert (s.host, s.port) == ("127.0.0.1", 8000)
    assert list(s.tiers) == ["tiny", "small", "large"] and s.tiers["large"].model == "qwen2.5-coder-1.5b-instruct"
    assert s.tiers["tiny"].model == "smollm2-135m-instruct"
    assert s.database == f"sqlite:///{Path('~/.cache/switchboard').expanduser() / 'switchboard.db'}"
    assert (
        s.model_dir(s.tiers["small"])
        == Path("~/.cache/switchboard/models/qwen2.5-coder-0.5b-instruct-int8").expanduser()
    )
    tiny = Settings(profile="tiny")
    assert list(tiny.tiers) == ["small"] and tiny.tiers["small"].model == "smollm2-135m-instruct"


def test_toml_file_then_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "switchboard.toml"
    config.write_text(
        'port = 9000\ndatabase_url = "postgresql://postgres@127.0.0.1/test"\n\n'
        '[tiers.small]\nmodel = "qwen2.5-coder-0.5b-instruct"\ndtype = "fp32"\n\n'
        '[tiers.mine]\nmodel = "~/checkpoints/my-llama"\nthreads = 1\n'
    )
    monkeypatch.setenv("SWITCHBOARD_CONFIG", str(config))
    monkeypatch.setenv("SWITCHBOARD_PORT", "9100")
    s = Settings()
    assert s.port == 9100 and s.database.startswith("postgresql://")
    assert s.tiers["small"].dtype == "fp32" and s.tiers["mine"].threads == 1
    assert s.model_dir(s.tiers["mine"]) == Path("~/checkpoints/my-llama").expanduser()


def test_invalid_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHBOARD_PORT", "not-a-port")
    with pytest.raises(ValidationError, match="port"):
        Settings()
    monkeypatch.delenv("SWITCHBOARD_PORT")
    with pytest.raises(ValidationError, match="dtype"):
        Settings(tiers={"small": {"dtype": "int3"}})
    with pytest.raises(ValidationError, match="Extra inputs"):
        Settings(tiers={"small": {"modle": "typo"}})
