"""Continuous batching for the server: one worker thread runs the batch; requests join it at step boundaries.

    request -> submit(lane, done) -> inbox -> [worker] join (its prefill, alone) -> steps with the others
            -> done(lane) once it finishes, or done(exception); a cancelled lane leaves at the next step

While the batch runs, new requests are admitted between steps (up to ``max_batch`` lanes), so one long
request no longer holds the others in a queue; with nothing running the worker sleeps on the inbox.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch

from lookahead.generator import LookaheadGenerator
from lookahead.loop import Lane

Done = Callable[[Lane | BaseException], None]


class Scheduler:
    """The worker thread that owns the running batch."""

    def __init__(self, gen: LookaheadGenerator, max_batch: int, lock: threading.Lock,
                 on_step: Callable[[int], None] = lambda size: None) -> None:
        """lock: held while the batch runs a step or a join (it shares the drafting state with whoever takes it);
        on_step(lanes): called after every step with the number of lanes it carried (for the metrics)."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.gen, self.lock, self.on_step = gen, lock, on_step
        self.max_batch = max_batch if gen.batchable else 1  # where sequences cannot share a step exactly
        self.inbox: queue.Queue[tuple[Lane, Done] | None] = queue.Queue()
        self.running = 0  # lanes in the batch (read by the metrics)
        self.thread = threading.Thread(target=self._work, name="lookahead-batch", daemon=True)
        self.thread.start()

    def submit(self, lane: Lane, done: Done) -> None:
        """Queue ``lane``; ``done`` is called from the worker thread with the finished lane or the exception."""
        self.inbox.put((lane, done))

    def stop(self) -> None:
        """Stop after the current step (lanes still running are dropped: the server is shutting down)."""
        self.inbox.put(None)
        self.thread.join(timeout=60)

    def _work(self) -> None:
        batch, waiting = self.gen.new_batch(), {}
        while True:
            # admit: block only when nothing runs; a joining request's prefill runs alone, once
            while len(batch) < self.max_batch:
                try:
                    item = self.inbox.get(block=not len(batch))
                except queue.Empty:
                    break
                if item is None:
                    return
                lane, done = item
                try:
                    with self.lock, torch.inference_mode():
                        batch.join(lane)
                except Exception as e:  # noqa: BLE001 -- handed to its request, the server goes on
                    done(e)
                    continue
                if lane in batch.lanes:
                    waiting[lane] = done
                else:  # finished at its first token
                    done(lane)
            # one step for every lane; those that finish leave and get their answer
            try:
                size = len(batch)
                with self.lock, torch.inference_mode():
                    finished = batch.step()
                self.on_step(size)
            except Exception as e:  # noqa: BLE001 -- a failing step fails the lanes in it, not the server
                for done in waiting.values():
                    done(e)
                batch, waiting = self.gen.new_batch(), {}
                continue
            for lane in finished:
                waiting.pop(lane)(lane)
            self.running = len(batch)
