"""The native decoder (`engines.models.native_decoder`: every layer of a step in one library call) computes
the Python layers' numbers to the bit, on prefill chunks, decode rows and mixed steps, and steps aside
where it does not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_adapters import make_adapter

from engines.engine import Engine, EngineConfig
from engines.kernels import cpu_kernels
from engines.models.llama import LlamaForCausalLM
from engines.models.native_decoder import NativeDecoder
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from tiny import tiny_hf_model

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the native kernels are off on this machine")

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9] * 9, [3], list(range(10, 50))]


def run(
    model_dir: Path,
    weights: str,
    monkeypatch: pytest.MonkeyPatch,
    native: bool,
    adapters: dict[str, Path] | None = None,
    **config: object,
) -> tuple:
    """(every step's logits, the tokens each request generated, whether the native decoder ran). `adapters`: loaded
    and given round-robin to the requests with the base (a, b, …, None, a, …); the third value then says whether
    the native decoder ran steps with them."""
    monkeypatch.setenv("SWITCHBOARD_NATIVE_DECODER", "1" if native else "0")
    engine = Engine.from_dir(model_dir, weights=weights, config=EngineConfig(kv_cache_bytes=1 << 22, **config))
    names: list[str | None] = [None]
    for name, path in (adapters or {}).items():
        engine.load_adapter(name, path)
        names.insert(-1, name)
    logits: list[torch.Tensor] = []
    compute = LlamaForCausalLM.compute_logits
    lora_steps = 0
    forward = NativeDecoder.forward

    def record(self: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        out = compute(self, hidden)
        logits.append(out.clone())
        return out

    def counted(self: NativeDecoder, *args: object) -> tuple:
        nonlocal lora_steps
        lora_steps += len(args) > 3 and args[3] is not None
        return forward(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", record)
    monkeypatch.setattr(NativeDecoder, "forward", counted)
    # Staggered arrivals: steps that mix decode rows with prefill chunks, and plain decode steps.
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=10, temperature=0.0)
        engine.add_request(EngineRequest(f"r{i}", prompt, params, adapter=names[i % len(names)]))
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    monkeypatch.undo()
    return logits, tokens, (lora_steps > 0 if adapters else engine.model._native is not None)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q, k and v
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_native_decoder_computes_the_python_layers_bits(
    arch: str, weights: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_hf_model(arch, tmp_path)
    native_logits, native_tokens, ran = run(model_dir, weights, monkeypatch, native=True)
    python_logits, python_tokens, off = run(model_dir, weights, monkeypatch, native=False)
    assert ran and not off
    assert len(native_logits) == len(python_logits) > 10
    assert all(torch.equal(a, b) for a, b in zip(native_logits, python_logits, strict=True))
    assert native_tokens == python_tokens and all(len(t) == 10 for t in native_tokens.values())


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_with_lora_adapters_the_native_decoder_computes_the_python_layers_bits(
    weights: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two adapters and the base in one batch (every projection; one adapter leaves k and down out): each row's
    deltas run inside the library's call, to the bits of the layer-by-layer path."""
    pytest.importorskip("peft")
    model_dir = tiny_hf_model("qwen2", tmp_path / "base")
    some = ["q_proj", "v_proj", "o_proj", "up_proj"]
    adapters = {
        "a": make_adapter(model_dir, tmp_path / "a", 1),
        "b": make_adapter(model_dir, tmp_path / "b", 2, some, r=8),
    }
    native_logits, native_tokens, ran = run(model_dir, weights, monkeypatch, native=True, adapters=adapters)
    python_logits, python_tokens, off = run(model_dir, weights, monkeypatch, native=False, adapters=adapters)
    assert ran and not off
    assert all(torch.equal(a, b) for a, b in zip(native_logits, python_logits, strict=True))
    assert native_tokens == python_tokens
    base_logits, _, _ = run(model_dir, weights, monkeypatch, native=True)
    assert not torch.equal(native_logits[0], base_logits[0])  # the adapters moved the first step's logits


def test_a_wrong_native_decoder_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can fail: a native decoder with its norms' epsilon off by 10x differs."""
    from engines.models.native_decoder import NativeDecoder

    model_dir = tiny_hf_model("llama", tmp_path)
    python_logits, _, _ = run(model_dir, "int8", monkeypatch, native=False)
    build = NativeDecoder.build.__func__

    def wrong(cls: type[NativeDecoder], *args: object) -> NativeDecoder | None:
        decoder = build(cls, *args)
        if decoder is not None:
            decoder.model.eps *= 10
        return decoder

    monkeypatch.setattr(NativeDecoder, "build", classmethod(wrong))
    native_logits, _, ran = run(model_dir, "int8", monkeypatch, native=True)
    assert ran
    assert not all(torch.equal(a, b) for a, b in zip(native_logits, python_logits, strict=True))


@pytest.mark.parametrize(
    ("weights", "config", "why"),
    [
        ("bf16", {}, "bf16 weights run oneDNN, not our kernels"),
        ("int8", {"kv_cache_dtype": "int8"}, "an int8 KV cache"),
    ],
)
def test_it_steps_aside_where_it_does_not_apply(
    weights: str, config: dict, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_hf_model("llama", tmp_path)
    _, tokens, ran = run(model_dir, weights, monkeypatch, native=True, **config)
    assert not ran, why
    assert all(len(t) == 10 for t in tokens.values())
