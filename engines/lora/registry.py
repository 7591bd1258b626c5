"""The adapters an engine holds: loaded onto its model's linear layers at run time, by name, at most `capacity` at
once (the least recently used one that no running sequence uses makes room), and unloaded.

Loading is read-and-check first (`load_adapter`: a bad file loads nothing), then one dict entry per linear layer;
a sequence names its adapter when it is added (`Engine.add_request`), and the runner groups each step's rows by
adapter (`engines.layers.lora`). The name a request gives is the engine's key; the digest (of the files) is what
the prefix cache keys on, so a replaced adapter never reuses another's cached prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from pathlib import Path

from engines.layers.linear import Linear
from engines.lora.adapter import AdapterError, LoraAdapter, load_adapter
from engines.models.llama import LlamaForCausalLM

__all__ = ["DEFAULT_CAPACITY", "Adapters"]

DEFAULT_CAPACITY = 8  # adapters in memory per engine: rank 16 on every projection of a 0.5B model is ~17 MB each


class Adapters:
    def __init__(self, model: LlamaForCausalLM, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("an engine holds at least one adapter")
        self.model = model
        self.capacity = capacity
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}

    def load(self, name: str, path: str | Path, busy: Collection[str] = ()) -> LoraAdapter:
        """Read the adapter at `path` and serve it as `name` (`attach`)."""
        return self.attach(name, load_adapter(path, self.model), busy)

    def attach(self, name: str, adapter: LoraAdapter, busy: Collection[str] = ()) -> LoraAdapter:
        """Serve an adapter read for this model as `name` (replacing one of that name); AdapterError if the engine is
        full of adapters that `busy` (the running sequences' ones) says are in use, or the one replaced is."""
        if not name or "|" in name:
            raise AdapterError(f"adapter name {name!r}: give a non-empty name without '|'")
        if name in busy and name in self._loaded and self._loaded[name].digest != adapter.digest:
            raise AdapterError(f"adapter {name!r} is in use by running requests: it cannot be replaced now")
        if name not in self._loaded:
            while len(self._loaded) >= self.capacity:
                idle = next((n for n in self._loaded if n not in busy), None)
                if idle is None:
                    raise AdapterError(f"all {self.capacity} adapters this engine holds are in use")
                self.unload(idle)
        for module, pair in adapter.pairs.items():
            self._linears[module].loras.set(name, pair)
        for module, linear in self._linears.items():  # a replaced adapter's layers it no longer trains
            if module not in adapter.pairs:
                linear.loras.drop(name)
        self._loaded[name] = adapter
        self._loaded.move_to_end(name)
        return adapter

    def unload(self, name: str) -> bool:
        """Stop serving `name`; False if it was not loaded."""
        if self._loaded.pop(name, None) is None:
            return False
        for linear in self._linears.values():
            linear.loras.drop(name)
        return True

    def use(self, name: str) -> LoraAdapter | None:
        """The adapter a new request names (now the most recently used), or None if it is not loaded."""
        adapter = self._loaded.get(name)
        if adapter is not None:
            self._loaded.move_to_end(name)
        return adapter

    def __contains__(self, name: object) -> bool:
        return name in self._loaded

    @property
    def names(self) -> list[str]:
        return list(self._loaded)
