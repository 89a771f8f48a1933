"""Two threads calling in strict turn: a server's two request threads on one model, one call at a time (Triton's
interpreter is not thread-safe, so the kept calls' tests cannot run threads at once on the CPU)."""

from __future__ import annotations

import threading
from typing import Callable

import torch


def in_turn(call: Callable[[], torch.Tensor], rounds: int) -> list[torch.Tensor]:
    """``call()`` from two threads in turn, ``rounds`` calls each, without autograd; the outputs in call order."""
    turns, outs = [threading.Event(), threading.Event()], []

    def calls(me: int) -> None:
        with torch.no_grad():
            for _ in range(rounds):
                turns[me].wait()
                turns[me].clear()
                outs.append(call())
                turns[1 - me].set()

    threads = [threading.Thread(target=calls, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    turns[0].set()
    for thread in threads:
        thread.join()
    return outs
