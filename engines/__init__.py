"""The in-process inference engine, bottom up: `kernels` (the hot ops: torch reference, C++ CPU library,
Triton) and `kv` (the paged KV pool, shared budgets, the Redis prefix tier); `layers` and `models` (the
decoders); `checkpoints` (weights on disk: fetch, convert, quantize, load); `speculative` (drafting and
verification); on top, the engine itself (`engine`: scheduler, block manager, model runner, sampler) and
what the gateway sees of it (`protocol`, `request`, `async_engine`), with `remote` serving a tier from
another server behind the same protocol. Importing this package imports nothing: `engines.checkpoints.fetch`
stays torch-free.
"""
