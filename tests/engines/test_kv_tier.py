"""The KV prefix tier against a real Redis: payloads, restoring in a fresh process, isolation, faults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch

import services
from engines.checkpoints.loader import load_model
from engines.engine import Engine, EngineConfig
from engines.kv.tier import KVTier, checkpoint_fingerprint
from engines.kv.tier_blocks import block_payload_bytes, chain_digests, pack_block, unpack_block, valid_payload
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from engines.tokenizer import Tokenizer
from tiny import tiny_hf_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
SYSTEM = (
    "You are the support assistant of a hardware store. Answer politely, precisely and briefly. "
    "Our opening hours are Monday to Saturday, 8am to 7pm; Sunday 10am to 4pm. We sell tools, paint, "
    "lumber, plumbing and electrical supplies, garden equipment and fasteners of every size. "
    "Returns are accepted within 30 days with a receipt. Never invent products or prices; when unsure, "
    "say that a colleague will call back. " * 2
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_model("llama", tmp_path_factory.mktemp("tiny-kv-tier"))


def run(engine: Engine, prompt: list[int], request_id: str = "r", cache_salt: str = "") -> list[int]:
    engine.add_request(EngineRequest(request_id, prompt, GREEDY, cache_salt=cache_salt))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def tier(url: str, namespace: str, checkpoint: str) -> KVTier:
    return KVTier(url, namespace, checkpoint=checkpoint)


def keys(url: str, namespace: str) -> list[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return list(client.scan_iter(f"{namespace}:kv:*", count=1000))
    finally:
        client.close()


# --- payloads --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_block_round_trips_through_redis_bit_for_bit(
    tiny_dir: Path, redis_server: str, redis_namespace: str, kv_dtype: str
) -> None:
    config = EngineConfig(kv_cache_bytes=4 << 20, kv_cache_dtype=kv_dtype)
    model, tokenizer = load_model(tiny_dir, "bf16"), Tokenizer(tiny_dir)
    source = Engine(model, tokenizer, config)
    prompt = [(i * 7) % 300 + 1 for i in range(100)]
    run(source, prompt)
    block = source.block_manager.blocks[source.block_manager._cached[next(iter(source.block_manager._cached))]]
    kv_tier = tier(redis_server, redis_namespace, checkpoint_fingerprint(tiny_dir))
    kv_tier.attach("test")
    digest = chain_digests(prompt, "salt", 16, 1)[0]
    payload = pack_block(source.cache, block.block_id, digest)
    assert len(payload) == block_payload_bytes(source.cache)
    assert kv_tier.store(digest, payload)
    (fetched,) = kv_tier.fetch([digest])
    assert fetched == payload and valid_payload(source.cache, fetched, digest)

    target = Engine(model, tokenizer, config)  # a fresh pool: the block lands in another slot
    dest = target.block_manager.num_blocks - 1
    target.cache.zero_blocks([dest])
    unpack_block(target.cache, dest, fetched)
    assert torch.equal(target.cache.buffer[:, :, :, dest], source.cache.buffer[:, :, :, block.block_id])
    if kv_dtype == "int8":
        assert target.cache.buffer.dtype == torch.int8
        assert torch.equal(target.cache.scales[:, :, :, dest], source.cache.scales[:, :, :, block.block_id])
    # Someone else's block, a truncated value or a flipped bit is a miss, never KV.
    other = chain_digests(prompt, "other salt", 16, 1)[0]
    corrupt = bytearray(payload)
    corrupt[-1] ^= 1
    assert not valid_payload(source.cache, payload, other)
    assert not valid_payload(source.cache, payload[:-1], digest)
    assert not valid_payload(source.cache, bytes(corrupt), digest)
    kv_tier.close()


def test_digests_are_stable_across_processes() -> None:
    """The block manager's `hash()` is salted per process; the tier's keys must not be."""
    code = (
        "from engines.kv.tier_blocks import chain_digests; print(chain_digests(list(range(40)), 's', 16, 2)[1].hex())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == chain_digests(list(range(40)), "s", 16, 2)[1].hex()
    assert chain_digests(list(range(40)), "t", 16, 2)[1].hex() != other


# --- the acceptance test ---------------------------------------------------------------------------


def worker(spec: dict) -> list[dict]:
    script = Path(__file__).with_name("kv_tier_worker.py")
    env = {"OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(spec)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_kv_tier_restores_a_prefix_in_a_fresh_process_with_identical_output(
    smollm2_dir: Path, redis_server: str, redis_namespace: str
) -> None:
    tokenizer = Tokenizer(smollm2_dir)
    first, second = (
        tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in ("Do you sell hammers?", "When are you open on Sunday?")
    )
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 8 * 16 + 16, "the shared system prompt must span at least 8 full blocks"
    spec = {"model_dir": str(smollm2_dir), "redis_url": redis_server, "namespace": redis_namespace}

    # Process A: computes the prompt and writes its full blocks.
    (a,) = worker({**spec, "runs": [{"prompt": first, "tier": True}]})
    assert a["stats"]["kv_tier_hit_blocks"] == 0
    assert a["stats"]["kv_tier_blocks_written"] == len(first) // 16 >= 8
    assert len(keys(redis_server, redis_namespace)) == len(first) // 16

    # Process B: fresh engines, empty local caches. The same prompt, then another question behind the
    # same system prompt, each with the tier and without it.
    b_same, b_other, off_same, off_other = worker(
        {
            **spec,
            "runs": [
                {"prompt": first, "tier": True},
                {"prompt": second, "tier": True},
                {"prompt": first, "tier": False},
                {"prompt": second, "tier": False},
            ],
        }
    )
    assert b_same["stats"]["kv_tier_hit_blocks"] == (len(first) - 1) // 16 >= 8
    assert b_same["prompt_computed"] == len(first) - 16 * b_same["stats"]["kv_tier_hit_blocks"]
    assert b_same["prompt_computed"] < off_same["prompt_computed"] == len(first)
    assert b_same["tokens"] == off_same["tokens"] == a["tokens"]
    # Process B's first run stored nothing new: every block was already there.
    assert b_same["stats"]["kv_tier_bytes_written"] == 0

    assert b_other["stats"]["kv_tier_hit_blocks"] == shared // 16 >= 8
    assert b_other["prompt_computed"] < off_other["prompt_computed"]
    assert b_other["tokens"] == off_other["tokens"]


# --- isolation -------------------------------------------------------------------------------------


def test_other_models_dtypes_and_tenants_never_read_the_blocks(
    smollm2_dir: Path, redis_server: str, redis_namespace: str
) -> None:
    checkpoint = checkpoint_fingerprint(smollm2_dir)
    tokenizer = Tokenizer(smollm2_dir)
    prompt = tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
    bf16 = load_model(smollm2_dir, "bf16")
    config = EngineConfig(kv_cache_bytes=64 << 20)

    writer = tier(redis_server, redis_namespace, checkpoint)
    run(Engine(bf16, tokenizer, config, kv_tier=writer), prompt)
    writer.flush()
    assert writer.stats.blocks_written >= 8

    readers = {
        "fp32 activations": (load_model(smollm2_dir, "fp32"), config, checkpoint, ""),
        "int8 KV": (bf16, EngineConfig(kv_cache_bytes=64 << 20, kv_cache_dtype="int8"), checkpoint, ""),
        "block size 32": (bf16, EngineConfig(kv_cache_bytes=64 << 20, block_size=32), checkpoint, ""),
        "another checkpoint": (bf16, config, "another checkpoint", ""),
        "another tenant": (bf16, config, checkpoint, "tenant-b"),
    }
    for what, (model, cfg, ckpt, salt) in readers.items():
        reader = tier(redis_server, redis_namespace, ckpt)
        engine = Engine(model, tokenizer, cfg, kv_tier=reader)
        run(engine, prompt, cache_salt=salt)
        assert reader.stats.lookups == 1, what
        assert reader.stats.hit_blocks == 0 and reader.stats.errors == 0, what
        reader.close()
    # The control: the same model, dtype and tenant reads them.
    reader = tier(redis_server, redis_namespace, checkpoint)
    run(Engine(bf16, tokenizer, config, kv_tier=reader), prompt)
    assert reader.stats.hit_blocks == (len(prompt) - 1) // 16


def test_the_checkpoint_fingerprint_sees_changed_weights(tiny_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    copy.mkdir()
    for f in tiny_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(tiny_dir)
    assert checkpoint_fingerprint(copy, "int8") != checkpoint_fingerprint(tiny_dir)
    tensors = load_file(copy / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3  # a fine-tune: same shapes, same config, other bytes
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(tiny_dir)


# --- when it does not pay, and when Redis is down ----------------------------------------------------


def test_short_prompts_stay_out_and_a_slow_tier_is_skipped(
    tiny_dir: Path, redis_server: str, redis_namespace: str
) -> None:
    model, tokenizer = load_model(tiny_dir, "bf16"), Tokenizer(tiny_dir)
    config = EngineConfig(kv_cache_bytes=4 << 20)
    checkpoint = checkpoint_fingerprint(tiny_dir)
    writer = tier(redis_server, redis_namespace, checkpoint)
    engine = Engine(model, tokenizer, config, kv_tier=writer)
    run(engine, list(range(1, 60)), "short")  # 3 full blocks < min_blocks 4
    writer.flush()
    assert writer.stats.lookups == 0 and writer.stats.blocks_written == 0
    long = list(range(100, 200))
    run(engine, long, "long")
    writer.flush()
    assert writer.stats.blocks_written == 100 // 16

    reader = tier(redis_server, redis_namespace, checkpoint)
    engine = Engine(model, tokenizer, config, kv_tier=reader)
    link = engine.kv_tier
    assert link is not None
    # Measured: fetching a block takes longer than computing its 16 tokens.
    link._fetch_s_per_byte, link._prefill_s_per_token = 1e-6, 1e-6
    assert run(engine, long, "slow") == run(Engine(model, tokenizer, config), long, "cold")
    assert reader.stats.skipped == 1 and reader.stats.lookups == 0 and reader.stats.hit_blocks == 0


def test_redis_down_serves_normally_and_counts_errors(tiny_dir: Path) -> None:
    model, tokenizer = load_model(tiny_dir, "bf16"), Tokenizer(tiny_dir)
    config = EngineConfig(kv_cache_bytes=4 << 20)
    dead = tier(f"redis://127.0.0.1:{services.free_port()}/0", "sbtest-down", checkpoint_fingerprint(tiny_dir))
    engine = Engine(model, tokenizer, config, kv_tier=dead)
    prompt = list(range(1, 120))
    expected = run(Engine(model, tokenizer, config), prompt, "cold")
    assert run(engine, prompt, "a") == expected
    dead.flush()
    assert dead.stats.errors == 1  # the read failed; the write was not even tried while backing off
    assert engine.stats().as_dict()["kv_tier_errors"] == 1
    assert run(engine, [7, *prompt], "b") == run(Engine(model, tokenizer, config), [7, *prompt], "cold")
    assert dead.stats.hit_blocks == 0
    dead.close()


# --- settings --------------------------------------------------------------------------------------


def test_a_tier_setting_gives_its_engine_a_kv_tier_when_redis_is_configured(
    tiny_dir: Path, tmp_path: Path, redis_server: str, redis_namespace: str
) -> None:
    from core.settings import Settings
    from gateway.runtime.tiers import load_engines

    tiers = {
        "on": {"model": str(tiny_dir), "kv_tier": True, "kv_tier_min_blocks": 2, "kv_cache_bytes": "1MiB"},
        "off": {"model": str(tiny_dir), "kv_cache_bytes": "1MiB"},
    }
    engines = load_engines(
        Settings(home=tmp_path, redis_url=redis_server, redis_namespace=redis_namespace, tiers=tiers)
    )
    on, off = engines["on"].engine, engines["off"].engine
    assert on is not off and off.kv_tier is None
    assert on.kv_tier is not None and on.kv_tier.tier.min_blocks == 2
    assert on.kv_tier.tier.key(b"\0" * 16).startswith(f"{redis_namespace}:kv:{on.kv_tier.tier.fingerprint}:")
    # Without Redis there is nothing to share through: the tier is off, the engine serves.
    alone = load_engines(Settings(home=tmp_path, tiers={"on": tiers["on"]}))
    assert alone["on"].engine.kv_tier is None
    on.kv_tier.tier.close()


def test_a_corrupt_block_is_a_miss_and_gets_replaced(tiny_dir: Path, redis_server: str, redis_namespace: str) -> None:
    model, tokenizer = load_model(tiny_dir, "bf16"), Tokenizer(tiny_dir)
    config = EngineConfig(kv_cache_bytes=4 << 20)
    checkpoint = checkpoint_fingerprint(tiny_dir)
    prompt = list(range(50, 150))
    expected = run(Engine(model, tokenizer, config), prompt, "cold")
    writer = tier(redis_server, redis_namespace, checkpoint)
    engine = Engine(model, tokenizer, config, kv_tier=writer)
    run(engine, prompt)
    writer.flush()
    first = writer.key(chain_digests(prompt, f"{engine.salt}|", 16, 1)[0])  # a request without a cache salt
    client = redis.Redis.from_url(redis_server)
    client.set(first, b"SBKV" + b"\0" * 100)  # truncated, as from an interrupted or foreign writer

    reader = tier(redis_server, redis_namespace, checkpoint)
    assert run(Engine(model, tokenizer, config, kv_tier=reader), prompt) == expected
    reader.flush()
    assert reader.stats.errors == 1 and reader.stats.hit_blocks == 0
    assert reader.stats.blocks_written == 1  # dropped, then written again whole by the reader's prefill
    healed = tier(redis_server, redis_namespace, checkpoint)
    assert run(Engine(model, tokenizer, config, kv_tier=healed), prompt) == expected
    assert healed.stats.hit_blocks == (len(prompt) - 1) // 16 and healed.stats.errors == 0
    client.close()
