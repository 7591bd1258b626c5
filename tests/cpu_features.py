"""What this CPU's bf16 matmuls promise, for tests that compare greedy outputs bit for bit.

The engine keeps a request's greedy answer the same however it is batched (see `engines.model_runner`):
on AVX-512 and AVX2 machines oneDNN's bf16 matmul gives the same bits for a row at any row count of two
or more. On CPUs with AMX tiles (Intel Sapphire Rapids and later: `amx_bf16` in /proc/cpuinfo) it does
not: it switches kernels with the row count (measured on one: a 896x4864 weight gives one result for a
row in batches of up to 32 rows, another above; a 576x49152 head switches back again at 512), so bf16
logits and near-tie greedy tokens can change with the batch. fp32 and our int8/int4 kernels keep the
promise there too. Tests of that promise in bf16 are expected to fail on such CPUs (`BF16_BATCH_VARIES`).
"""

from __future__ import annotations

import pytest

from engines.kernels.cpu_info import cpu_flags

AMX_BF16 = "amx_bf16" in cpu_flags()

BF16_BATCH_VARIES = pytest.mark.xfail(
    AMX_BF16,
    reason="AMX CPU: oneDNN's bf16 matmul picks its kernel by row count, so batching can change bf16 bits "
    "(tests/cpu_features.py)",
    strict=False,
)
