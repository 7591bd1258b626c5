"""LoRA adapters on our engine against transformers + PEFT on the same adapter files, and a mixed batch against each
request served alone (`engines.lora`, `engines.layers.lora`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_adapters import EVERY, make_adapter
from test_models import run_in_pieces

from engines.checkpoints.loader import load_model
from engines.engine import Engine, RequestRejected
from engines.layers.lora import LayerAdapters, LoraBatch, LoraPart, LoraWeights, lora_batch
from engines.lora import AdapterError, Adapters, load_adapter
from engines.models.llama import LlamaForCausalLM
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from tiny import VOCAB, tiny_hf_model

peft = pytest.importorskip("peft")


def peft_logits(base: Path, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(hf, adapter).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"), tie_word_embeddings=False)


IDS = torch.randint(1, VOCAB, (30,), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(
    ("arch", "targets", "config"),
    [
        ("qwen2", EVERY, {}),  # fused q/k/v with biases, every projection
        ("qwen2", ["q_proj", "v_proj"], {"use_rslora": True}),  # k left out of the fused layer; √r scaling
        ("llama", ["k_proj", "gate_proj", "down_proj"], {"r": 8, "lora_alpha": 4}),
    ],
)
def test_an_adapter_matches_peft(arch: str, targets: list[str], config: dict, tmp_path: Path) -> None:
    base = tiny_hf_model(arch, tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", 0, targets, **config)
    ours = load_model(base, "fp32")
    Adapters(ours).load("a", adapter)
    expected = peft_logits(base, adapter, IDS)
    got = run_in_pieces(Under(ours, "a"), IDS, cuts=[11, 23])  # type: ignore[arg-type]
    assert (got - expected).abs().max().item() < 3e-4  # fp32 rounding of the larger activations (the base alone: 1e-4)
    plain = run_in_pieces(ours, IDS, cuts=[11, 23])  # outside a batch with the adapter: the base model
    assert (plain - expected).abs().max().item() > 1e-2


class Under:
    """The model with every row of each forward under one adapter (what the runner's grouping does for one chunk)."""

    def __init__(self, model: LlamaForCausalLM, name: str) -> None:
        self.model, self.name = model, name

    def __getattr__(self, attr: str) -> object:
        return getattr(self.model, attr)

    def __call__(self, ids: torch.Tensor, *args: object) -> torch.Tensor:
        with lora_batch(LoraBatch.every_row(self.name, len(ids))):
            return self.model(ids, *args)


def greedy(engine: Engine, asks: dict[str, tuple[list[int], str | None]], max_tokens: int = 12) -> dict[str, list]:
    """Every request added at once (one batch), run to the end; the tokens each generated."""
    out: dict[str, list[int]] = {rid: [] for rid in asks}
    for rid, (prompt, adapter) in asks.items():
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(EngineRequest(rid, prompt, params, adapter=adapter))
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_delta_has_the_same_bits_whatever_else_is_in_the_step(dtype: torch.dtype) -> None:
    """Each row's delta from 1 to 64 rows, two adapters interleaved, against that row alone: bit for bit (SmolLM2's
    shapes: 576 wide, a fused 3-part layer, rank 4 and 8). The plain fp32 matmul failed this from 16 rows on."""
    g = torch.Generator().manual_seed(0)
    layer = LayerAdapters()
    for name, rank in (("a", 4), ("b", 8)):
        a = torch.randn(3 * rank, 576, generator=g).to(dtype)
        parts = tuple(LoraPart(row, torch.randn(n, rank, generator=g).to(dtype)) for row, n in ((0, 576), (576, 192),
                                                                                            (768, 192)))  # fmt: skip
        layer.set(name, LoraWeights(a, parts))
    xs = torch.randn(64, 576, generator=g).to(dtype)

    def deltas(rows: int, names: list[str]) -> torch.Tensor:
        owned = {n: [i for i in range(rows) if names[i] == n] for n in set(names)}
        return layer.add(xs[:rows], torch.zeros(rows, 960, dtype=dtype), LoraBatch.of(owned))

    names = ["a", "b"] * 32
    first = deltas(1, names[:1])[0]
    for rows in range(1, 65):  # row 0 among 1 to 64 rows
        assert torch.equal(deltas(rows, names[:rows])[0], first), rows
    for i in range(64):  # each row alone, against its place among 64
        by_itself = layer.add(xs[i : i + 1], torch.zeros(1, 960, dtype=dtype), LoraBatch.every_row(names[i], 1))
        assert torch.equal(deltas(64, names)[i], by_itself[0]), i
    assert deltas(4, names[:4]).abs().sum() > 0


@pytest.mark.parametrize("weights", [None, "int8", "int4"])
def test_a_mixed_batch_gives_each_sequence_what_it_gets_alone(qwen: Path, tmp_path: Path, weights: str | None) -> None:
    """Two adapters and the bare base in one batch (prefills and decodes mixed): each sequence's greedy tokens
    are those it gets served alone, on float, int8 and int4 base weights; and the adapters do change them."""
    a, b = make_adapter(qwen, tmp_path / "a", 1), make_adapter(qwen, tmp_path / "b", 2)
    engine = Engine.from_dir(qwen, dtype="fp32" if weights is None else "bf16", weights=weights)
    engine.load_adapter("a", a)
    engine.load_adapter("b", b)
    prompts = {"p0": list(range(5, 25)), "p1": list(range(40, 47)), "p2": list(range(100, 133))}
    asks = {f"{p}-{n}": (ids, n) for p, ids in prompts.items() for n in ("a", "b", None)}
    together = greedy(engine, asks)
    for rid, ask in asks.items():
        assert greedy(engine, {rid: ask})[rid] == together[rid], rid
    for p in prompts:
        assert len({tuple(together[f"{p}-{n}"]) for n in ("a", "b", None)}) == 3, p


def test_the_prefix_cache_never_crosses_adapters(qwen: Path, tmp_path: Path) -> None:
    """A prompt computed under one adapter is reused under that adapter only: not under another, not bare, and not
    under the same name once it holds other files."""
    engine = Engine.from_dir(qwen, dtype="fp32")
    engine.load_adapter("a", make_adapter(qwen, tmp_path / "a", 1))
    engine.load_adapter("b", make_adapter(qwen, tmp_path / "b", 2))
    prompt = list(range(1, 41))  # ten 4-token blocks... the engine's blocks are larger; 40 tokens fill some

    def cached(adapter: str | None, rid: str) -> int:
        engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), adapter=adapter))
        first = None
        while engine.has_unfinished():
            for o in engine.step():
                first = o.cached_tokens if first is None else first
        assert first is not None
        return first

    assert cached("a", "r1") == 0
    assert cached("a", "r2") > 0  # the same adapter reuses it
    assert cached("b", "r3") == 0 and cached(None, "r4") == 0
    engine.load_adapter("a", make_adapter(qwen, tmp_path / "a2", 3))  # new files under the old name
    assert cached("a", "r5") == 0


def test_bad_adapters_are_refused_and_load_nothing(qwen: Path, tmp_path: Path) -> None:
    engine = Engine.from_dir(qwen, dtype="fp32")
    good = make_adapter(qwen, tmp_path / "good", 1)
    engine.load_adapter("good", good)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    config = json.loads((good / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    other = make_adapter(tiny_hf_model("qwen2", tmp_path / "wide", hidden_size=96), tmp_path / "wide-adapter", 1)
    for path, why in [(corrupt, "cannot be read"), (dora, "use_dora"), (tmp_path / "none", "no adapter_config.json"),
                      (other, "do not fit")]:  # fmt: skip
        with pytest.raises(AdapterError, match=why):
            engine.load_adapter("bad", path)
        assert engine.adapters.names == ["good"]
    assert all("bad" not in m.loras for m in engine.model.modules() if hasattr(m, "loras"))
    with pytest.raises(RequestRejected, match="not loaded"):
        engine.add_request(EngineRequest("x", [1, 2, 3], SamplingParams(max_tokens=1), adapter="missing"))


def test_adapters_load_and_unload_at_run_time_within_their_bound(qwen: Path, tmp_path: Path) -> None:
    """The least recently used idle adapter makes room; one in use by a running request is neither evicted nor
    unloaded; an unloaded adapter leaves no weights behind."""
    engine = Engine.from_dir(qwen, dtype="fp32")
    engine.adapters.capacity = 2
    paths = [make_adapter(qwen, tmp_path / f"x{i}", i) for i in range(3)]
    engine.load_adapter("x0", paths[0])
    engine.load_adapter("x1", paths[1])
    engine.add_request(EngineRequest("busy", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), adapter="x0"))
    engine.load_adapter("x2", paths[2])  # x1 is idle: it goes
    assert engine.adapters.names == ["x0", "x2"]
    with pytest.raises(RequestRejected, match="in use"):
        engine.unload_adapter("x0")
    while engine.has_unfinished():
        engine.step()
    assert engine.unload_adapter("x0") and not engine.unload_adapter("x0")
    assert all("x0" not in m.loras for m in engine.model.modules() if hasattr(m, "loras"))
    assert load_adapter(paths[2], engine.model).digest == engine.adapters.use("x2").digest  # type: ignore[union-attr]


def dequantized_hf(ours: LlamaForCausalLM, base: Path) -> torch.nn.Module:
    """transformers' model of `base` holding our quantized model's weights, dequantized (each linear applied to the
    identity): the oracle for what our kernels compute, unfused again into HF's q/k/v and gate/up."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    cfg = ours.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def weight(linear: torch.nn.Module) -> torch.Tensor:
        eye = torch.eye(linear.in_features)
        out = linear._base(eye)  # type: ignore[operator]
        return (out - (0 if linear.bias is None else linear.bias.detach())).T  # type: ignore[union-attr]

    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(ours.embed_tokens(torch.arange(cfg.vocab_size)))
        hf.lm_head.weight.copy_(weight(ours.lm_head))
        for theirs, mine in zip(hf.model.layers, ours.layers, strict=True):
            qkv = weight(mine.self_attn.qkv_proj)
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), qkv.split([q, kv, kv]), strict=True):
                getattr(theirs.self_attn, part).weight.copy_(rows)
            theirs.self_attn.o_proj.weight.copy_(weight(mine.self_attn.o_proj))
            gate, up = weight(mine.mlp.gate_up_proj).chunk(2)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(weight(mine.mlp.down_proj))
    return hf


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_an_adapter_on_quantized_base_weights_matches_peft_on_those_weights(
    qwen: Path, tmp_path: Path, weights: str
) -> None:
    """The delta adds to the quantized base's product: ours with the adapter is as close to PEFT on transformers
    holding our dequantized weights as our base is to that transformers model alone (the kernels' own rounding:
    int8 rounds each row of activations too), while the adapter moves the logits many times further."""
    adapter = make_adapter(qwen, tmp_path / "a", 0)
    ours = load_model(qwen, "fp32", weights)
    hf = dequantized_hf(ours, qwen)
    with torch.no_grad():
        base = hf(IDS[None]).logits[0]
        expected = peft.PeftModel.from_pretrained(hf, adapter).eval()(IDS[None]).logits[0]
    Adapters(ours).load("a", adapter)
    got = run_in_pieces(Under(ours, "a"), IDS, cuts=[11, 23])  # type: ignore[arg-type]
    plain = run_in_pieces(ours, IDS, cuts=[11, 23])
    off, rounding = (got - expected).abs().max().item(), (plain - base).abs().max().item()
    assert off <= 1.5 * rounding + 1e-4, (off, rounding)  # measured: 9.5e-3 vs 1.2e-2 (int8), 8.5e-3 vs 9.6e-3
    assert (got - plain).abs().max().item() > 20 * off


def test_an_async_engine_loads_adapters_between_steps_while_serving(qwen: Path, tmp_path: Path) -> None:
    """Loaded while a base request streams: attached on the engine's thread between steps, then served; a bad one is
    refused with nothing loaded; unloaded once idle."""
    import asyncio

    from engines.async_engine import AsyncEngine

    engine = AsyncEngine(Engine.from_dir(qwen, dtype="fp32"), name="small")
    engine.start()
    good = make_adapter(qwen, tmp_path / "a", 1)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def scenario() -> tuple[list[int], list[int]]:
        async def run(rid: str, adapter: str | None) -> list[int]:
            return [t async for o in engine.generate(EngineRequest(rid, list(range(5, 25)), params, adapter=adapter))
                    for t in o.new_token_ids]  # fmt: skip

        base = asyncio.ensure_future(run("base", None))
        await engine.load_adapter("a", good)  # while "base" decodes
        with pytest.raises(AdapterError):
            await engine.load_adapter("b", tmp_path / "missing")
        tuned = await run("tuned", "a")
        assert await engine.unload_adapter("a")
        return await base, tuned

    try:
        base, tuned = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert len(base) == len(tuned) == 24 and base != tuned
    assert engine.engine.adapters.names == []
