"""Build a sparse MoE checkpoint from a dense one: `switchboard models moe SRC DST`.

- `upcycle` (sparse upcycling, Komatsuzaki et al. 2022): every expert is a copy of the dense MLP and
  the router starts random. With identical experts and renormalised top-k weights the MoE computes
  exactly the dense model, which makes it the exact test of the MoE code path (and the starting point
  for MoE training, which we do not do here). E copies: E times the MLP bytes, active the same.
- `split` (MoEfication, Zhang et al. 2022): the MLP's intermediate neurons are partitioned into E
  experts of equal size, so a token running K of them reads K/E of the MLP. Neurons are grouped by
  co-activation over calibration text (k-means on their |activation| profiles, balanced to equal
  sizes); optionally the most active neurons form a shared expert every token runs. Each layer's
  router is a ridge regression from the MLP input to each expert's output norm, fitted on the same
  text; a token runs the K experts it predicts largest, summed unweighted (partitions of one MLP
  add up to it: `switchboard_moe_weighting = "none"`).

Output: a HF-format Qwen2-MoE (from Qwen2) or Mixtral (from Llama) directory: config.json,
model.safetensors, tokenizer files. Calibration text is `engines.checkpoints.corpus` (no evaluation data).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engines.models.config import ModelConfig, UnsupportedModelError
from engines.tokenizer import copy_tokenizer_files

MOE_ARCH = {"Qwen2ForCausalLM": "Qwen2MoeForCausalLM", "LlamaForCausalLM": "MixtralForCausalLM"}


@dataclass(frozen=True)
class SplitReport:
    """What a split cost: how well the fitted routers pick each token's most important experts."""

    router_recall: float  # mean over layers: of each token's true top-K experts, the share the router picks
    active_mlp_fraction: float  # of the MLP's neurons, the share a token runs (shared expert included)


def build_moe(
    src: Path, dst: Path, *, experts: int, top_k: int, method: str, shared: int = 0,
    calibration_tokens: int = 4096, calibration_ids: list[int] | None = None, seed: int = 0, progress: bool = True,
) -> SplitReport | None:  # fmt: skip
    """`calibration_ids`: token ids to fit the split on instead of `engines.checkpoints.corpus` text."""
    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    if cfg.moe.num_experts:
        raise UnsupportedModelError(f"{src} is already a MoE model")
    if not 1 <= top_k <= experts:
        raise ValueError("top-k must be between 1 and the number of experts")
    if method not in ("upcycle", "split"):
        raise ValueError(f"method must be upcycle or split, not {method!r}")
    tensors = _read(src)
    report = None
    if method == "upcycle":
        moe_size, shared = cfg.intermediate_size, 0
        mlps = {
            layer: _upcycle_layer(tensors, layer, experts, cfg.hidden_size, seed)
            for layer in range(cfg.num_hidden_layers)
        }
    else:
        if (cfg.intermediate_size - shared) % experts:
            raise ValueError(
                f"intermediate size {cfg.intermediate_size} minus {shared} shared does not split into {experts}"
            )
        moe_size = (cfg.intermediate_size - shared) // experts
        ids = calibration_ids or _corpus_ids(src, calibration_tokens)
        mlps, report = _split(src, cfg, tensors, experts, top_k, shared, ids[:calibration_tokens], seed, progress)
    out = _moe_config(raw, cfg, experts, top_k, moe_size, shared, weighting="router" if method == "upcycle" else "none")
    for layer in range(cfg.num_hidden_layers):
        for part in ("gate_proj", "up_proj", "down_proj"):
            tensors.pop(f"model.layers.{layer}.mlp.{part}.weight")
        tensors.update(_named(mlps[layer], layer, out["architectures"][0]))
    _write(src, dst, tensors, out)
    return report


def _read(src: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = f.get_tensor(name)
    if not tensors:
        raise UnsupportedModelError(f"{src} has no *.safetensors weights")
    return tensors


def _upcycle_layer(tensors: dict, layer: int, experts: int, hidden: int, seed: int) -> dict:
    p = f"model.layers.{layer}.mlp."
    gate, up, down = (tensors[p + n + ".weight"] for n in ("gate_proj", "up_proj", "down_proj"))
    g = torch.Generator().manual_seed(seed * 1000 + layer)
    router = (torch.randn(experts, hidden, generator=g) * hidden**-0.5).to(gate.dtype)
    return {
        "router": router,
        "experts": [(gate.clone(), up.clone(), down.clone()) for _ in range(experts)],
        "shared": None,
    }


def _named(mlp: dict, layer: int, arch: str) -> dict[str, torch.Tensor]:
    """HF names: Qwen2-MoE `mlp.experts.e.{gate,up,down}_proj`, Mixtral `block_sparse_moe.experts.e.w1/w3/w2`."""
    mixtral = arch == "MixtralForCausalLM"
    block = f"model.layers.{layer}." + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {block + "gate.weight": mlp["router"]}
    for e, weights in enumerate(mlp["experts"]):
        for name, w in zip(names, weights, strict=True):
            out[f"{block}experts.{e}.{name}.weight"] = w.contiguous()
    if mlp["shared"] is not None:
        for name, w in zip(("gate_proj", "up_proj", "down_proj"), mlp["shared"], strict=True):
            out[f"{block}shared_expert.{name}.weight"] = w.contiguous()
    return out


def _moe_config(raw: dict, cfg: ModelConfig, experts: int, top_k: int, size: int, shared: int, weighting: str) -> dict:
    arch = MOE_ARCH[cfg.architecture]
    out = dict(raw, architectures=[arch], num_experts_per_tok=top_k, switchboard_moe_weighting=weighting)
    if arch == "MixtralForCausalLM":
        if shared:
            raise ValueError("Mixtral has no shared expert")
        return out | {"model_type": "mixtral", "num_local_experts": experts, "intermediate_size": size}
    return out | {
        "model_type": "qwen2_moe",
        "num_experts": experts,
        "moe_intermediate_size": size,
        "shared_expert_intermediate_size": shared,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
    try:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(staging / "model.safetensors"),
            metadata={"format": "pt"},
        )
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        copy_tokenizer_files(src, staging)
        if dst.exists():
            shutil.rmtree(dst)
        staging.rename(dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --- split -----------------------------------------------------------------------------------------


def _corpus_ids(src: Path, num_tokens: int) -> list[int]:
    from engines.checkpoints.corpus import calibration_text, python_texts
    from engines.tokenizer import Tokenizer

    ids = Tokenizer(src).encode(calibration_text() + "\n\n" + "\n\n".join(python_texts()))[:num_tokens]
    if len(ids) < 64:
        raise ValueError(f"the calibration text gives only {len(ids)} tokens with this tokenizer")
    return ids


@torch.inference_mode()
def _mlp_inputs(src: Path, cfg: ModelConfig, ids: list[int], progress: bool) -> dict[int, torch.Tensor]:
    """Each layer's MLP input (after its norm) on the calibration tokens, fp32."""
    from engines.checkpoints.loader import load_model
    from engines.kernels.metadata import AttentionMetadata
    from engines.kernels.reference import TorchPagedAttention
    from engines.kv.cache import PagedKVCache

    model = load_model(src, "fp32")
    found: dict[int, list[torch.Tensor]] = {i: [] for i in range(cfg.num_hidden_layers)}
    hooks = [
        layer.mlp.register_forward_hook(lambda _m, inputs, _o, i=i: found[i].append(inputs[0].float().clone()))
        for i, layer in enumerate(model.layers)
    ]
    window = min(1024, cfg.max_position_embeddings)
    try:
        for start in tqdm(range(0, len(ids), window), desc="calibration", unit="window", disable=not progress):
            chunk = ids[start : start + window]
            blocks = -(-len(chunk) // 16)
            cache = PagedKVCache(
                cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, blocks, 16, torch.float32
            )
            cache.buffer.zero_()
            meta = AttentionMetadata.build(16, [list(range(blocks))], [0], [len(chunk)])
            model(torch.tensor(chunk), torch.arange(len(chunk)), TorchPagedAttention(cache), meta)
    finally:
        for h in hooks:
            h.remove()
    return {i: torch.cat(xs) for i, xs in found.items()}


def _balanced_clusters(features: np.ndarray, k: int, seed: int) -> list[np.ndarray]:
    """k groups of equal size: k-means centroids, then each neuron to its nearest centroid with room,
    the most confident assignments first."""
    from sklearn.cluster import KMeans

    n = len(features)
    size = n // k
    km = KMeans(n_clusters=k, n_init=1, random_state=seed).fit(features)
    dist = ((features[:, None, :] - km.cluster_centers_[None]) ** 2).sum(-1)  # (n, k)
    order = np.argsort(dist, axis=None)
    taken = np.zeros(n, dtype=bool)
    groups: list[list[int]] = [[] for _ in range(k)]
    for flat in order:
        neuron, cluster = divmod(int(flat), k)
        if taken[neuron] or len(groups[cluster]) >= size:
            continue
        taken[neuron] = True
        groups[cluster].append(neuron)
    return [np.array(sorted(g)) for g in groups]


def _split(
    src: Path, cfg: ModelConfig, tensors: dict, experts: int, top_k: int, shared: int,
    ids: list[int], seed: int, progress: bool,
) -> tuple[dict, SplitReport]:  # fmt: skip
    inputs = _mlp_inputs(src, cfg, ids, progress)
    rng = np.random.default_rng(seed)
    mlps, recalls = {}, []
    for layer in tqdm(range(cfg.num_hidden_layers), desc="split", unit="layer", disable=not progress):
        p = f"model.layers.{layer}.mlp."
        gate, up, down = (tensors[p + n + ".weight"].float() for n in ("gate_proj", "up_proj", "down_proj"))
        x = inputs[layer]
        acts = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)  # (tokens, neurons)
        strength = acts.abs()
        order = torch.argsort(strength.mean(0), descending=True)
        shared_idx, rest = order[:shared].sort().values, order[shared:].sort().values
        # Co-activation profiles, scaled per neuron and projected to 256 dims for k-means.
        profile = (strength[:, rest] / strength[:, rest].norm(dim=0).clamp_min(1e-9)).T.numpy()
        projection = rng.standard_normal((profile.shape[1], 256)).astype(np.float32) / 16
        groups = [rest[torch.from_numpy(g)] for g in _balanced_clusters(profile @ projection, experts, seed)]
        # Each expert's output norm per token: what the router must rank.
        importance = torch.stack([(acts[:, g] @ down[:, g].T).norm(dim=1) for g in groups], dim=1)
        router = _ridge(x, importance)
        picked = torch.topk(x @ router.T, top_k, dim=1).indices
        best = torch.topk(importance, top_k, dim=1).indices
        recalls.append(float((picked.unsqueeze(2) == best.unsqueeze(1)).any(2).float().mean()))
        dtype = tensors[p + "gate_proj.weight"].dtype
        mlps[layer] = {
            "router": router.to(dtype),
            "experts": [(gate[g].to(dtype), up[g].to(dtype), down[:, g].to(dtype)) for g in groups],
            "shared": (gate[shared_idx].to(dtype), up[shared_idx].to(dtype), down[:, shared_idx].to(dtype))
            if shared
            else None,
        }
    active = (shared + top_k * (cfg.intermediate_size - shared) // experts) / cfg.intermediate_size
    return mlps, SplitReport(router_recall=round(float(np.mean(recalls)), 4), active_mlp_fraction=round(active, 4))


def _ridge(x: torch.Tensor, y: torch.Tensor, alpha: float = 1e-2) -> torch.Tensor:
    """W (outputs, inputs) minimising |x Wᵀ - y|² + alpha·n·|W|² (x standardised by its scale)."""
    n, d = x.shape
    gram = x.T @ x + alpha * n * float(x.pow(2).mean()) * torch.eye(d)
    return torch.linalg.solve(gram, x.T @ y).T.contiguous()
