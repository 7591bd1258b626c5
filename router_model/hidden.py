"""The router's feature from the serving tier itself: the small tier's hidden state of a prompt's last
token, from the prefill it runs anyway.

A prefill-only engine request (`EngineRequest.hidden_layer`) computes the prompt inside the engine's
continuous batching and returns the residual stream after `layer` decoder layers; the prompt's full KV
blocks stay in the prefix cache, so a request routed small then skips that prefill. One prefill of the
596 shipped labeled prompts through Qwen2.5-Coder-0.5B at layer 18 of 24 (3/4 of the depth; layers 6-24
gave AUC 0.79-0.84, mean pooling worse) separated small_ok with AUC 0.84 against 0.77 for the text
features, out of fold.

Training needs the state of every labeled prompt: `hidden_states` batches them through an `Engine`
(64 prompts in flight), and `FeatureCache` keeps them on disk by (model, layer, prompt token ids), so a
retrain computes only new prompts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from engines.engine import Engine
from engines.request import EngineRequest
from engines.sampling import SamplingParams
from router_model.features import Messages

IN_FLIGHT = 64  # prompts per engine batch: the engine's step budget chunks them anyway
SALT = "router-features"  # training prompts share prefixes only among themselves
FEATURES_DIR = "router-features"  # under the settings' home: the feature cache


def default_layer(num_layers: int) -> int:
    """3/4 of the depth: 18 of Qwen2.5-Coder-0.5B's 24 layers, the best measured."""
    return max(1, round(0.75 * num_layers))


@dataclass(frozen=True)
class HiddenSpec:
    """Which hidden state a router was trained on: the tier's model (as labels name it) and the layer."""

    tier: str
    model: str
    layer: int
    dim: int

    def as_dict(self) -> dict[str, object]:
        return {"tier": self.tier, "model": self.model, "layer": self.layer, "dim": self.dim}

    @classmethod
    def from_dict(cls, d: dict) -> HiddenSpec:
        return cls(str(d["tier"]), str(d["model"]), int(d["layer"]), int(d["dim"]))


def prompt_ids(engine: Engine, messages: Messages) -> list[int]:
    return engine.tokenizer.encode_chat([dict(m) for m in messages])


def hidden_states(
    engine: Engine, prompts: Sequence[list[int]], layer: int, *, progress: bool = False, salt: str = SALT
) -> np.ndarray:
    """(len(prompts), hidden) float32: each prompt's last-token state after `layer` layers, computed on
    `engine` (this thread steps it: use an engine nothing else is stepping)."""
    out = np.zeros((len(prompts), engine.model.config.hidden_size), np.float32)
    pending = list(enumerate(prompts))
    bar = tqdm(total=len(prompts), desc="hidden states", unit="prompt", disable=not progress)
    index: dict[str, int] = {}
    while pending or engine.has_unfinished():
        while pending and len(index) < IN_FLIGHT:
            i, ids = pending.pop(0)
            rid = f"{salt}#{i}"
            index[rid] = i
            engine.add_request(
                EngineRequest(rid, ids, SamplingParams(max_tokens=1), cache_salt=salt, hidden_layer=layer)
            )
        for o in engine.step():
            if o.request_id in index and o.finished:
                if o.hidden is None:
                    raise RuntimeError(f"prompt {index[o.request_id]}: no hidden state ({o.finish_reason}: {o.error})")
                out[index.pop(o.request_id)] = o.hidden.numpy()
                bar.update(1)
    bar.close()
    return out


class FeatureCache:
    """Hidden states on disk, one `.npz` per (model, layer), keyed by the sha256 of the prompt's token ids."""

    def __init__(self, directory: Path, model: str, layer: int) -> None:
        name = hashlib.sha256(f"{model}|{layer}".encode()).hexdigest()[:16]
        self.path = Path(directory).expanduser() / f"hidden-{name}.npz"
        self._states: dict[str, np.ndarray] = {}
        if self.path.is_file():
            with np.load(self.path) as data:
                self._states = dict(zip(data["keys"].tolist(), data["states"], strict=True))

    @staticmethod
    def key(ids: Sequence[int]) -> str:
        return hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()

    def states(self, engine: Engine, prompts: Sequence[list[int]], layer: int, progress: bool = False) -> np.ndarray:
        """Every prompt's state, computing (and saving) only the ones not cached yet."""
        keys = [self.key(p) for p in prompts]
        todo = sorted({k: i for i, k in enumerate(keys) if k not in self._states}.values())
        if todo:
            fresh = hidden_states(engine, [prompts[i] for i in todo], layer, progress=progress)
            self._states |= {keys[i]: s for i, s in zip(todo, fresh, strict=True)}
            self._save()
        return np.stack([self._states[k] for k in keys]) if keys else np.zeros((0, 0), np.float32)

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp.npz")
        keys = list(self._states)
        np.savez(tmp, keys=np.array(keys), states=np.stack([self._states[k] for k in keys]))
        tmp.replace(self.path)


def conversation_states(
    engine: Engine, conversations: Sequence[Messages], spec: HiddenSpec, cache_dir: Path, progress: bool = False
) -> np.ndarray:
    """The states `spec` names for conversations, as the gateway computes them (the client's messages
    through the tier's chat template), from `cache_dir`'s feature cache where they are already there."""
    cache = FeatureCache(cache_dir, spec.model, spec.layer)
    return cache.states(engine, [prompt_ids(engine, m) for m in conversations], spec.layer, progress=progress)
