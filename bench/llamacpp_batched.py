"""llama.cpp batched greedy decoding throughput through llama-cpp-python's low-level API.

One context, one `llama_batch` per step carrying N sequence ids, as llama.cpp's `batched` example does.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.llamacpp_batched --gguf FILE --n 16 --tokens 64 --threads 2

llama.cpp is the build bench/llamacpp_pick.py chooses for this CPU (the fastest that runs here correctly), named on
stderr before the first measurement.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from bench.llamacpp_pick import load

_NO_LOG: list[Any] = []  # the ctypes callback, kept alive for as long as llama.cpp may call it


def llama_cpp(gguf: Path, threads: int) -> ModuleType:
    """The chosen build's `llama_cpp` module, its logging silenced."""
    lc = load(gguf, threads, lambda message: print(message, file=sys.stderr, flush=True))
    if not _NO_LOG:
        _NO_LOG.append(lc.llama_log_callback(lambda level, text, user_data: None))
    lc.llama_log_set(_NO_LOG[0], ctypes.c_void_p())
    return lc


def _fill(batch: Any, entries: list[tuple[int, int, int, bool]]) -> None:
    """entries: (token, position, seq id, logits wanted)."""
    for i, (tok, pos, seq, want) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = want
    batch.n_tokens = len(entries)


def llamacpp_batched_decode(
    gguf: Path, prompts: list[list[int]], max_new_tokens: int, threads: int, *, n_ctx: int | None = None
) -> dict:
    """Greedy-decode max_new_tokens for every prompt at once (EOS ignored); returns timings and tokens."""
    n_seqs = len(prompts)
    lc = llama_cpp(gguf, threads)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError(f"cannot load {gguf}")
    cparams = lc.llama_context_default_params()
    need = sum(len(p) + max_new_tokens for p in prompts)
    cparams.n_ctx = n_ctx or -(-need // 256) * 256
    cparams.n_batch = max(sum(len(p) for p in prompts), n_seqs)
    cparams.n_seq_max = n_seqs
    cparams.kv_unified = True  # one KV buffer shared by all sequences, so n_ctx only needs the sum
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        lc.llama_model_free(model)
        raise RuntimeError("cannot create context")
    batch = lc.llama_batch_init(cparams.n_batch, 0, 1)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))

    def argmax(i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))

    try:
        entries, last = [], []
        for seq, prompt in enumerate(prompts):
            entries += [(tok, pos, seq, pos == len(prompt) - 1) for pos, tok in enumerate(prompt)]
            last.append(len(entries) - 1)
        _fill(batch, entries)
        started = time.perf_counter()
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("prefill llama_decode failed")
        tokens = [[argmax(i)] for i in last]
        prefill_s = time.perf_counter() - started

        started = time.perf_counter()
        for step in range(max_new_tokens - 1):
            _fill(batch, [(tokens[s][-1], len(prompts[s]) + step, s, True) for s in range(n_seqs)])
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError(f"llama_decode failed at step {step}")
            for s in range(n_seqs):
                tokens[s].append(argmax(s))
        decode_s = time.perf_counter() - started
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    # The first new token comes from the prefill; the loop produces the other max_new_tokens - 1 per sequence.
    decoded = n_seqs * (max_new_tokens - 1)
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_tok_s": decoded / decode_s if decode_s > 0 else float("nan"),
        "tokens": tokens,
        "n_seqs": n_seqs,
    }


def _high_level_greedy(gguf: Path, prompt: list[int], n: int, threads: int) -> list[int]:
    # Llama() turns flash attention off by default; the low-level default ("auto") turns it on for CPU, and the two
    # round differently enough to flip a greedy token a few dozen steps in. Match the kernel for the comparison.
    llm = llama_cpp(gguf, threads).Llama(
        model_path=str(gguf), n_threads=threads, n_ctx=len(prompt) + n + 16, flash_attn=True, verbose=False
    )
    out: list[int] = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(int(tok))
        if len(out) == n:
            break
    llm.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.llamacpp_batched", description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--n", type=int, default=16, help="number of parallel sequences")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per sequence")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", default="Write a long story about a dragon who learns to code.")
    args = parser.parse_args()
    lc = llama_cpp(args.gguf, args.threads)  # before any Llama(): even vocab_only=True logs a warning
    vocab = lc.Llama(model_path=str(args.gguf), vocab_only=True, verbose=False)
    prompt = vocab.tokenize(args.prompt.encode(), add_bos=True)
    vocab.close()

    one = llamacpp_batched_decode(args.gguf, [prompt], args.tokens, args.threads)
    ref = _high_level_greedy(args.gguf, prompt, args.tokens, args.threads)
    print(f"N=1: {one['decode_tok_s']:.1f} tok/s decode, prefill {one['prefill_s'] * 1000:.0f} ms")
    print(f"N=1 matches high-level Llama greedy: {one['tokens'][0] == ref}")
    if args.n > 1:
        many = llamacpp_batched_decode(args.gguf, [prompt] * args.n, args.tokens, args.threads)
        ref1 = one["tokens"][0]
        same = sum(t == ref1 for t in many["tokens"])
        diff = min(
            (i for t in many["tokens"] for i, (a, b) in enumerate(zip(t, ref1, strict=True)) if a != b), default=None
        )
        distinct = len({tuple(t) for t in many["tokens"]})
        print(f"N={args.n}: {many['decode_tok_s']:.1f} tok/s decode, prefill {many['prefill_s'] * 1000:.0f} ms")
        print(
            f"N={args.n}: {same}/{args.n} sequences equal N=1 (first difference at token {diff}), {distinct} distinct"
        )


if __name__ == "__main__":
    main()
