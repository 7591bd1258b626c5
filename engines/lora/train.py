"""A LoRA adapter trained on a checkpoint from (prompt, answer) token pairs: response distillation, the teacher's
answer tokens as targets (cross-entropy on the answer only, never on the prompt), and logit distillation where the
teacher's top-k next-token distributions come with them (KL on those k, as `engines.speculative.distill` trains
drafts; the held-out loss stays the answers' cross-entropy, comparable between runs).

transformers' own model class for the checkpoint's family and `peft` do the model and the adapter (what vLLM and
transformers load back: `adapter_config.json` + `adapter_model.safetensors`); this module owns the loop:

- **Steps**: `accumulate` examples a step (one at a time: CPU batches of ragged prompts waste more on padding
  than they save), AdamW on the adapter's weights only, the learning rate warmed up over the first steps.
- **Stopping**: after each epoch the held-out examples' loss; the adapter kept is the epoch with the lowest, and
  training stops at the first epoch that does not improve it (`patience` 1).
- **Resumable**: every `save_every` steps (and at each epoch's end) the adapter's weights, the optimizer, the
  step, the best epoch so far and the RNG go to `checkpoint.pt` in the output folder, written whole then renamed.
  A run started again on the same folder, data and config continues from there, to the same result as one that
  was never stopped (the same examples in the same order, the same updates); other data or config is refused.
- **Progress**: `say` gets a line every `say_every` steps (step, examples a second, the running loss).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engines.lora.adapter import PROJECTIONS

__all__ = ["Example", "TrainConfig", "TrainResult", "train_adapter"]

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class Example:
    prompt: list[int]  # the prompt as the served tier tokenizes it (its chat template applied)
    answer: list[int]  # the teacher's answer, its end-of-turn token included
    # per answer token, where the teacher gave them: its top-k next-token ids and log-probabilities at that
    # position (logit distillation); shorter than `answer` where the last ones have none (the end-of-turn token)
    top: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...] = ()


@dataclass(frozen=True)
class TrainConfig:
    rank: int = 16
    alpha: int = 32
    targets: tuple[str, ...] = PROJECTIONS  # every one
    learning_rate: float = 2e-4
    epochs: int = 2
    accumulate: int = 4  # examples per optimizer step
    warmup_steps: int = 4
    max_tokens: int = 1024  # prompt + answer; longer examples keep the answer's start and the prompt's end
    save_every: int = 10  # steps between checkpoints
    seed: int = 0
    patience: int = 1  # epochs without a better held-out loss before stopping
    top_weight: float = 0.5  # where examples carry the teacher's top-k: loss = (1 − w)·CE + w·KL(teacher ‖ student)


@dataclass(frozen=True)
class TrainResult:
    adapter: Path  # the PEFT folder
    epochs: int  # run to the end (or stopped early)
    best_epoch: int
    heldout_loss: list[float]  # after each epoch
    base_heldout_loss: float  # before any training
    examples: int
    steps: int
    seconds: float  # this run's, resumed parts excluded
    resumed_from: int  # the step it resumed at (0: a fresh start)
    history: list[dict] = field(default_factory=list)


def _digest(examples: Sequence[Example], heldout: Sequence[Example], config: TrainConfig) -> str:
    h = hashlib.sha256(json.dumps(asdict(config), sort_keys=True).encode())
    for ex in [*examples, None, *heldout]:
        h.update(b"|" if ex is None else json.dumps([ex.prompt, ex.answer, ex.top]).encode())
    return h.hexdigest()


def _fit(ex: Example, max_tokens: int) -> tuple[list[int], int]:
    """The ids a step reads and where the answer starts, within `max_tokens`."""
    answer = ex.answer[: max_tokens - 1]
    prompt = ex.prompt[-(max_tokens - len(answer)) :] if len(ex.prompt) + len(answer) > max_tokens else ex.prompt
    return prompt + answer, len(prompt)


def _loss(model: torch.nn.Module, ex: Example, max_tokens: int, top_weight: float = 0.0) -> torch.Tensor:
    """Cross-entropy on the answer's tokens; with the teacher's top-k (`ex.top`) and `top_weight`, mixed with the
    KL divergence from the teacher's top-k distribution (renormalised over its k) to the student's, at the
    positions that have one: how far the student's next-token distribution is from the teacher's, not only
    from its choice."""
    ids, start = _fit(ex, max_tokens)
    x = torch.tensor([ids])
    logits = model(input_ids=x).logits[0, start - 1 : -1].float()
    ce = torch.nn.functional.cross_entropy(logits, x[0, start:])
    positions = min(len(ex.top), logits.shape[0])
    if not top_weight or positions == 0:
        return ce
    k = min(len(t[0]) for t in ex.top[:positions])
    top_ids = torch.tensor([list(t[0][:k]) for t in ex.top[:positions]])
    teacher = torch.log_softmax(torch.tensor([list(t[1][:k]) for t in ex.top[:positions]]), dim=-1)
    student = torch.log_softmax(logits[:positions], dim=-1).gather(1, top_ids)
    kl = (teacher.exp() * (teacher - student)).sum(-1).mean()
    return (1 - top_weight) * ce + top_weight * kl


def _heldout_loss(model: torch.nn.Module, heldout: Sequence[Example], max_tokens: int) -> float:
    """The mean per-token loss on the held-out answers."""
    if not heldout:
        return float("nan")
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ex in heldout:
            ids, start = _fit(ex, max_tokens)
            n = len(ids) - start
            total += float(_loss(model, ex, max_tokens)) * n
            tokens += n
    model.train()
    return total / max(1, tokens)


def train_adapter(
    base_dir: Path,
    examples: Sequence[Example],
    heldout: Sequence[Example],
    out: Path,
    config: TrainConfig = TrainConfig(),
    say: Callable[[str], None] = print,
    say_every: int = 5,
    stop_after_steps: int | None = None,
    replace_other: bool = False,
) -> TrainResult:
    """Train (or resume training) an adapter on the checkpoint at `base_dir`; the best epoch's adapter is left
    in `out/adapter`. `stop_after_steps`: return after that many steps of this run (a test's stand-in for a
    killed process; the checkpoint is where a resumed run continues). A checkpoint in `out` of another run (other
    examples or settings) is an error, or with `replace_other` discarded: this run starts from step 0."""
    if not examples:
        raise ValueError("no training examples")
    run = _Run(base_dir, examples, heldout, out, config, say, replace_other)
    started, ran, seen, running = time.monotonic(), 0, 0, 0.0
    while run.state["step"] < run.total_steps and run.state["bad_epochs"] < config.patience:
        step_loss, taken = run.step()
        ran, seen = ran + 1, seen + taken
        running = step_loss if ran == 1 else 0.9 * running + 0.1 * step_loss
        step = run.state["step"]
        if step % say_every == 0:
            rate = seen / max(1e-9, time.monotonic() - started)
            say(f"  step {step}/{run.total_steps}: loss {running:.4f}, {rate:.2f} examples/s")
        if step % run.per_epoch == 0:
            run.epoch_end()
        elif step % config.save_every == 0:
            run.save()
        if stop_after_steps is not None and ran >= stop_after_steps and step < run.total_steps:
            run.save()
            return _result(out, run.state, examples, run.resumed_from, time.monotonic() - started, done=False)
    run.finish()
    return _result(out, run.state, examples, run.resumed_from, time.monotonic() - started, done=True)


class _Run:
    """One training run's model, optimizer and state (restored from the checkpoint where there is one)."""

    def __init__(
        self,
        base_dir: Path,
        examples: Sequence[Example],
        heldout: Sequence[Example],
        out: Path,
        config: TrainConfig,
        say: Callable[[str], None],
        replace_other: bool = False,
    ) -> None:
        import peft
        from peft.utils import set_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        self.examples, self.heldout, self.out, self.config, self.say = examples, heldout, out, config, say
        out.mkdir(parents=True, exist_ok=True)
        self.digest = _digest(examples, heldout, config)
        torch.manual_seed(config.seed)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        lora = peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, target_modules=list(config.targets),
                               lora_dropout=0.0, task_type="CAUSAL_LM")  # fmt: skip
        self.model = peft.get_peft_model(base, lora)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
        self.per_epoch = math.ceil(len(examples) / config.accumulate)
        self.total_steps = self.per_epoch * config.epochs
        self.state: dict = {"step": 0, "heldout": [], "best": None, "best_epoch": -1, "bad_epochs": 0,
                            "history": [], "base_heldout": None}  # fmt: skip
        self.checkpoint = out / CHECKPOINT
        saved = torch.load(self.checkpoint, weights_only=False) if self.checkpoint.exists() else None
        if saved is not None and saved["digest"] != self.digest:
            if not replace_other:
                raise ValueError(f"{self.checkpoint} is another run's (other data or settings): use another folder "
                                 "or delete it")  # fmt: skip
            say(f"{self.checkpoint} is another run's (other data or settings): starting afresh")
            saved = None
        if saved is not None:
            set_peft_model_state_dict(self.model, saved["lora"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.state = saved["state"]
            torch.set_rng_state(saved["rng"])
            say(f"resuming at step {self.state['step']} of {self.total_steps}")
        self.resumed_from = self.state["step"]
        if self.resumed_from == 0:
            self.state["base_heldout"] = _heldout_loss(self.model, heldout, config.max_tokens)

    def step(self) -> tuple[float, int]:
        """One optimizer step over the next `accumulate` examples of this epoch's order: (its loss, examples)."""
        config, state = self.config, self.state
        epoch, within = divmod(state["step"], self.per_epoch)
        order = list(range(len(self.examples)))
        random.Random(config.seed * 1000 + epoch).shuffle(order)
        batch = order[within * config.accumulate : (within + 1) * config.accumulate]
        for group in self.optimizer.param_groups:
            group["lr"] = config.learning_rate * min(1.0, (state["step"] + 1) / max(1, config.warmup_steps))
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i in batch:
            loss = _loss(self.model, self.examples[i], config.max_tokens, config.top_weight) / len(batch)
            loss.backward()
            total += float(loss.detach())  # a plain number: the graph is spent
        self.optimizer.step()
        state["step"] += 1
        state["history"].append({"step": state["step"], "loss": round(total, 5)})
        return total, len(batch)

    def epoch_end(self) -> None:
        """The held-out loss decides: keep this epoch's weights if best, else count an epoch without progress."""
        from peft.utils import get_peft_model_state_dict

        state, epoch = self.state, self.state["step"] // self.per_epoch - 1
        loss = _heldout_loss(self.model, self.heldout, self.config.max_tokens)
        state["heldout"].append(loss)
        improved = state["best"] is None or not self.heldout or loss < min(state["heldout"][:-1], default=math.inf)
        if improved:
            best = {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}
            state["best"], state["best_epoch"], state["bad_epochs"] = best, epoch, 0
        else:
            state["bad_epochs"] += 1
        stops = not improved and state["bad_epochs"] >= self.config.patience
        note = "" if improved else " (no better: stopping)" if stops else " (no better)"
        self.say(f"  epoch {epoch + 1}: held-out loss {loss:.4f}{note}")
        self.save()

    def save(self) -> None:
        from peft.utils import get_peft_model_state_dict

        part = self.out / (CHECKPOINT + ".part")
        blob = {
            "digest": self.digest,
            "lora": get_peft_model_state_dict(self.model),
            "optimizer": self.optimizer.state_dict(),
            "state": self.state,
            "rng": torch.get_rng_state(),
        }
        torch.save(blob, part)
        part.replace(self.checkpoint)

    def finish(self) -> None:
        """The best epoch's weights, saved as PEFT saves an adapter."""
        from peft.utils import set_peft_model_state_dict

        if self.state["best"] is not None:
            set_peft_model_state_dict(self.model, self.state["best"])
        self.model.save_pretrained(self.out / "adapter")
        self.save()


def _result(
    out: Path, state: dict, examples: Sequence[Example], resumed: int, seconds: float, done: bool
) -> TrainResult:
    return TrainResult(
        adapter=out / "adapter",
        epochs=len(state["heldout"]),
        best_epoch=state["best_epoch"] + 1,
        heldout_loss=list(state["heldout"]),
        base_heldout_loss=state["base_heldout"] if state["base_heldout"] is not None else float("nan"),
        examples=len(examples),
        steps=state["step"],
        seconds=round(seconds, 2),
        resumed_from=resumed,
        history=list(state["history"]) if done else [],
    )
