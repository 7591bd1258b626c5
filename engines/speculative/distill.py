"""Logit distillation of a draft model toward its target: `switchboard models distill`.

A draft's acceptance rate is how often it predicts what the target would emit, so the draft is
trained to match the target's next-token distribution: KL(target ‖ draft) at every position of
shipped text (`engines.checkpoints.corpus`: Python's docs and stdlib and our calibration text; no evaluation
data). The target's distribution is kept as its top-k tokens (renormalised), computed once per
window with our engine's forward and cached on disk. The student is the draft's HF checkpoint,
trained with transformers' model code (autograd; ours is inference-only) in fp32 on the CPU, only its
last `train_layers` decoder layers and final norm, which keeps a step to seconds and the embedding
(tied to the output head) intact. Progress is printed; a state file in the output directory lets an
interrupted run resume where it stopped. The result is a HF directory: a new draft checkpoint.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

STATE = "distill-state.pt"


@dataclass(frozen=True)
class DistillConfig:
    steps: int = 64
    window: int = 256  # tokens per training sequence
    top_k: int = 32  # teacher tokens kept per position
    lr: float = 2e-5
    train_layers: int = 6
    save_every: int = 16
    eval_windows: int = 4  # held out from the end of the corpus: KL before and after training
    seed: int = 0


@torch.inference_mode()
def teacher_targets(teacher_dir: Path, windows: list[list[int]], top_k: int, progress: bool) -> list[tuple]:
    """(top-k ids, top-k log-probs) of the teacher at every position of each window."""
    from engines.block_manager import BlockTable
    from engines.engine import Engine, EngineConfig
    from engines.kernels.metadata import AttentionMetadata

    engine = Engine.from_dir(teacher_dir, config=EngineConfig(kv_cache_bytes=64 << 20))
    bm, bs = engine.block_manager, engine.config.block_size
    out = []
    for ids in tqdm(windows, desc="teacher", unit="window", disable=not progress):
        table = BlockTable(salt="distill")
        bm.allocate(table, -(-len(ids) // bs))
        if fresh := bm.first_use:
            engine.cache.zero_blocks(fresh)
            fresh.clear()
        meta = AttentionMetadata.build(bs, [table.block_ids], [0], [len(ids)])
        hidden = engine.model(torch.tensor(ids), torch.arange(len(ids)), engine.runner.backend, meta)
        logp = torch.log_softmax(engine.model.compute_logits(hidden), dim=-1)
        top = torch.topk(logp, top_k, dim=-1)
        out.append((top.indices.to(torch.int32), top.values.to(torch.float16)))
        bm.free(table)
    return out


def _kl(model: torch.nn.Module, ids: list[int], target: tuple) -> torch.Tensor:
    """KL(teacher ‖ student) on the teacher's top-k (renormalised), mean over positions."""
    top_ids, top_logp = target
    logits = model(torch.tensor([ids])).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(1, top_ids.long())
    p = torch.softmax(top_logp.float(), dim=-1)
    return (p * (torch.log(p.clamp_min(1e-12)) - logp)).sum(-1).mean()


@torch.no_grad()
def held_out_kl(model: torch.nn.Module, windows: list[list[int]], targets: list[tuple]) -> float:
    return sum(float(_kl(model, w, t)) for w, t in zip(windows, targets, strict=True)) / max(1, len(windows))


def distill(
    student_dir: Path,
    teacher_dir: Path,
    out_dir: Path,
    config: DistillConfig | None = None,
    *,
    corpus_ids: list[int] | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Train and write the distilled draft to `out_dir`; returns the KL on held-out windows before and
    after.
    `corpus_ids`: token ids to train on instead of `engines.checkpoints.corpus` text."""
    from engines.tokenizer import copy_tokenizer_files

    config = config or DistillConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    windows, held_out = _windows(student_dir, corpus_ids, config)
    targets, held_targets = _teacher(Path(teacher_dir), out_dir, windows, held_out, config, progress)
    torch.manual_seed(config.seed)
    model, trainable, opt = _student(student_dir, config)
    held = (held_out, held_targets)
    losses, kl_before = _train(model, trainable, opt, windows, targets, held, config, out_dir, progress)
    model.eval()
    kl_after = held_out_kl(model, held_out, held_targets)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    copy_tokenizer_files(Path(student_dir), out_dir)
    summary = {
        "kl_before": kl_before,  # on the held-out windows
        "kl_after": kl_after,
        "steps": len(losses),
        "tokens": len(losses) * config.window,
    }
    (out_dir / "distill.json").write_text(json.dumps({"config": asdict(config), **summary}, indent=2))
    assert all(math.isfinite(x) for x in losses), "distillation diverged"
    return summary


def _windows(
    student_dir: Path, corpus_ids: list[int] | None, config: DistillConfig
) -> tuple[list[list[int]], list[list[int]]]:
    """(training windows, one per step; held-out windows from the corpus's end)."""
    from engines.checkpoints.corpus import calibration_text, python_texts
    from engines.tokenizer import Tokenizer

    if corpus_ids is None:
        text = calibration_text() + "\n\n" + "\n\n".join(python_texts())
        corpus_ids = Tokenizer(student_dir).encode(text)
    held_out = [
        corpus_ids[len(corpus_ids) - (i + 1) * config.window : len(corpus_ids) - i * config.window]
        for i in range(config.eval_windows)
    ]
    ids = corpus_ids[: len(corpus_ids) - config.eval_windows * config.window][: config.steps * config.window]
    windows = [ids[i : i + config.window] for i in range(0, len(ids) - config.window + 1, config.window)]
    if len(windows) < config.steps:
        raise ValueError(f"the corpus gives {len(windows)} windows, fewer than {config.steps} steps")
    return windows[: config.steps], held_out


def _teacher(
    teacher_dir: Path,
    out_dir: Path,
    windows: list[list[int]],
    held_out: list[list[int]],
    config: DistillConfig,
    progress: bool,
) -> tuple[list[tuple], list[tuple]]:
    """The teacher's targets for the training and the held-out windows, cached in `out_dir`."""
    targets_path = out_dir / "teacher-targets.pt"  # computed once; a longer run adds the windows it lacks
    targets = torch.load(targets_path) if targets_path.is_file() else []
    if len(targets) < len(windows):
        targets += teacher_targets(teacher_dir, windows[len(targets) :], config.top_k, progress)
        torch.save(targets, targets_path)
    held_path = out_dir / "teacher-held-out.pt"
    if held_path.is_file():
        held_targets = torch.load(held_path)
    else:
        held_targets = teacher_targets(teacher_dir, held_out, config.top_k, progress)
        torch.save(held_targets, held_path)
    return targets, held_targets


def _student(
    student_dir: Path, config: DistillConfig
) -> tuple[torch.nn.Module, list[torch.nn.Parameter], torch.optim.Optimizer]:
    """The student in fp32 with only its last `train_layers` layers and final norm trainable, and their optimizer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    model.train()
    layers = model.model.layers
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = [p for layer in layers[-config.train_layers :] for p in layer.parameters()] + list(
        model.model.norm.parameters()
    )
    for p in trainable:
        p.requires_grad_(True)
    return model, trainable, torch.optim.AdamW(trainable, lr=config.lr, weight_decay=0.0)


def _train(
    model: torch.nn.Module,
    trainable: list[torch.nn.Parameter],
    opt: torch.optim.Optimizer,
    windows: list[list[int]],
    targets: list[tuple],
    held: tuple[list[list[int]], list[tuple]],
    config: DistillConfig,
    out_dir: Path,
    progress: bool,
) -> tuple[list[float], float]:
    """Run the steps not done yet (resuming from the state file), saving every `save_every` steps; returns
    every step's loss and the held-out KL before training."""
    start, losses = 0, []
    state_path = out_dir / STATE
    if state_path.is_file():  # resume
        state = torch.load(state_path)
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["optimizer"])
        start, losses, kl_before = state["step"], state["losses"], state["kl_before"]
    else:
        kl_before = held_out_kl(model, *held)
    bar = tqdm(
        range(start, config.steps), desc="distill", unit="step", initial=start, total=config.steps, disable=not progress
    )
    for step in bar:
        loss = _kl(model, windows[step], targets[step])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(kl=f"{losses[-1]:.4f}")
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
            trained = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
            torch.save(
                {
                    "model": trained,
                    "optimizer": opt.state_dict(),
                    "step": step + 1,
                    "losses": losses,
                    "kl_before": kl_before,
                },
                state_path,
            )
    return losses, kl_before
