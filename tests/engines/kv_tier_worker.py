"""One side of the KV tier's fresh-process test: load a model, run prompts greedily, print JSON.

    python tests/engines/kv_tier_worker.py '{"model_dir": ..., "redis_url": ..., "namespace": ...,
                                     "runs": [{"prompt": [ids], "tier": true}, ...]}'

Each run gets a fresh engine (an empty KV pool and prefix cache) over the one loaded model; a run with
the tier on waits for its writes before the next starts. Prints one object per run: the generated
tokens, the engine's stats and the tokens the prompt had to compute.
"""

from __future__ import annotations

import json
import sys

from engines.checkpoints.loader import load_model
from engines.engine import Engine, EngineConfig
from engines.kv.tier import KVTier, checkpoint_fingerprint
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from engines.tokenizer import Tokenizer


def main(spec: dict) -> list[dict]:
    model = load_model(spec["model_dir"], spec.get("dtype", "bf16"))
    tokenizer = Tokenizer(spec["model_dir"])
    checkpoint = checkpoint_fingerprint(spec["model_dir"])
    results = []
    for i, run in enumerate(spec["runs"]):
        tier = KVTier(spec["redis_url"], spec["namespace"], checkpoint=checkpoint) if run["tier"] else None
        engine = Engine(model, tokenizer, EngineConfig(kv_cache_bytes=64 << 20), kv_tier=tier)
        prompt = run["prompt"]
        engine.add_request(
            EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=run.get("max_tokens", 24), temperature=0.0))
        )
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        if tier is not None:
            tier.flush()
            tier.close()
        stats = engine.stats().as_dict()
        # Every token that went through the model, less the generated ones that did: the prompt's share.
        prompt_computed = stats["tokens_computed"] - (len(tokens) - 1)
        results.append({"tokens": tokens, "stats": stats, "prompt_computed": prompt_computed})
    return results


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
