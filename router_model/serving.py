"""The router as the gateway runs it: P(small is good enough) for a conversation, computed on a thread
of its own so the event loop never runs MiniLM.

One thread with one torch thread, decisions one after another: the engines own the cores, and on a
busy 2-CPU machine two torch threads made an 80-word-piece embedding 3x slower. Decisions are not
batched: on a CPU the encoder's time is its tokens, and a batch pads every conversation to the longest
(16 shipped prompts at once: 628 ms median per decision batched, 305 ms one after another).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from router_model.features import Messages
from router_model.model import Assessment, Router, load_router


class RouterService:
    def __init__(self, router: Router, threads: int = 1) -> None:
        self.router = router
        before = torch.get_num_threads()
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="router", initializer=torch.set_num_threads, initargs=(threads,)
        )
        self._pool.submit(lambda: None).result()  # the thread exists and runs on `threads` torch threads
        # torch also takes the last set_num_threads as every new thread's default: give back the caller's
        torch.set_num_threads(before)

    @classmethod
    def load(cls, directory: Path, threads: int = 1) -> RouterService:
        """The router saved in `directory`, warmed up (MiniLM loaded); RouterLoadError if there is none."""
        service = cls(load_router(directory), threads)
        service._pool.submit(service.router.p_small_ok, [[{"role": "user", "content": "warm up"}]]).result()
        return service

    async def p_small_ok(self, conversation: Messages) -> float:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._score, conversation)

    async def p_ok(self, conversation: Messages, hidden: np.ndarray | None = None) -> dict[str, float]:
        """P(good enough) per tier the router predicts (small, and tiny where trained), from `hidden` (the
        small tier's state of the conversation) where given, else from the text."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.router.p_ok, conversation, hidden)

    async def assess(self, conversation: Messages, hidden: np.ndarray | None = None) -> Assessment:
        """`p_ok`, and where the conversation lies among the router's labels (`Router.assess`)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.router.assess, conversation, hidden)

    def _score(self, conversation: Messages) -> float:
        return float(self.router.p_small_ok([conversation])[0])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
