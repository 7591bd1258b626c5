"""PEFT adapters for the tests: random A and B on a Hugging Face checkpoint, saved exactly as `peft` saves one."""

from __future__ import annotations

from pathlib import Path

import torch

from engines.lora.adapter import PROJECTIONS

EVERY = list(PROJECTIONS)  # every projection an adapter may train


def make_adapter(
    base: Path, out: Path, seed: int, targets: list[str] = EVERY, scale: float = 20, **config: object
) -> Path:
    """A PEFT adapter on the model at `base`, random A and B (so it changes the output), saved as PEFT does. B at
    PEFT's `init_lora_weights=False` is small; `scale` multiplies it so the adapter moves the logits clearly."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": targets, "init_lora_weights": False} | config
    model = peft.get_peft_model(hf, peft.LoraConfig(**settings))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(out)
    return out
