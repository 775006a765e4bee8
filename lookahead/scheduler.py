"""Continuous batching for the server: one worker thread runs the batch; requests join it at step boundaries.

    request -> submit(lane, done) -> inbox -> [worker] join -> its prompt's prefill, alone, by chunks between steps
            -> steps with the others -> done(lane) once it finishes, or done(exception); a cancelled lane leaves
            at the next step

While the batch runs, new requests are admitted between steps (up to ``max_batch`` lanes), so one long
request no longer holds the others in a queue, and a joining prompt goes in ``prefill_chunk`` tokens a step,
so a long one no longer freezes the others' streams for its whole prefill; with nothing running the worker
sleeps on the inbox.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch

from lookahead.config import PREFILL_CHUNK
from lookahead.generator import LookaheadGenerator
from lookahead.lane import Lane
from lookahead.loop import Batch

Done = Callable[[Lane | BaseException], None]


class Scheduler:
    """The worker thread that owns the running batch."""

    def __init__(self, gen: LookaheadGenerator, max_batch: int, lock: threading.Lock,
                 on_step: Callable[[int], None] = lambda size: None, prefill_chunk: int = PREFILL_CHUNK) -> None:
        """lock: held while the batch runs a step or a join (it shares the drafting state with whoever takes it);
        on_step(lanes): called after every step with the number of lanes it carried (for the metrics)."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        first = gen.new_batch(prefill_chunk=prefill_chunk)  # a bad prefill_chunk raises here, not in the worker
        self.gen, self.lock, self.on_step, self.prefill_chunk = gen, lock, on_step, prefill_chunk
        self.max_batch = max_batch if gen.batchable else 1  # where sequences cannot share a step exactly
        self.inbox: queue.Queue[tuple[Lane, Done] | None] = queue.Queue()
        self.running = 0  # lanes in the batch (read by the metrics)
        self.thread = threading.Thread(target=self._work, args=(first,), name="lookahead-batch", daemon=True)
        self.thread.start()

    def submit(self, lane: Lane, done: Done) -> None:
        """Queue ``lane``; ``done`` is called from the worker thread with the finished lane or the exception."""
        self.inbox.put((lane, done))

    def stop(self) -> None:
        """Stop after the current step (lanes still running are dropped: the server is shutting down)."""
        self.inbox.put(None)
        self.thread.join(timeout=60)

    def _work(self, batch: Batch) -> None:
        waiting: dict[Lane, Done] = {}
        while True:
            # admit: block only when nothing runs; a joining request's prefill runs alone (by chunks while others run)
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
                if lane in batch:
                    waiting[lane] = done
                else:  # finished at its first token
                    done(lane)
            # one step for every lane; those that finish leave and get their answer
            try:
                size = len(batch.lanes)
                with self.lock, torch.inference_mode():
                    finished = batch.step()
                self.on_step(size)
            except Exception as e:  # noqa: BLE001 -- a failing step fails the lanes in it, not the server
                for done in waiting.values():
                    done(e)
                batch, waiting = self.gen.new_batch(prefill_chunk=self.prefill_chunk), {}
                continue
            for lane in finished:
                waiting.pop(lane)(lane)
            self.running = len(batch)
