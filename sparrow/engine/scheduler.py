"""What the engine runs next: a policy over waiting and running requests, with no model and no
threads, so that it can be tested on its own.

Each step is either one prefill chunk of the oldest waiting request or one decode step of
every running request. The two alternate while both have work, so a new request starts
between decode steps instead of waiting for the batch to drain, and a long prompt (many
chunks) never stalls the running requests for more than one chunk at a time.

Requests are any objects with boolean `cancelled` and `finished` attributes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class Step:
    kind: str  # "prefill": one chunk of reqs[0]; "decode": one token for each of reqs
    reqs: list


class Scheduler:
    def __init__(self, max_batch: int = 16):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.max_batch = max_batch
        self.waiting: deque = deque()  # queued, or part-way through prefill (head only)
        self.running: list = []
        self._last_prefill = False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, reqs) -> None:
        self.waiting.extend(reqs)

    def drop_cancelled(self) -> list:
        """Removes cancelled requests from both queues; returns them."""
        gone = [r for r in self.waiting if r.cancelled] + [r for r in self.running if r.cancelled]
        if gone:
            self.waiting = deque(r for r in self.waiting if not r.cancelled)
            self.running = [r for r in self.running if not r.cancelled]
        return gone

    def next_step(self) -> Step | None:
        prefill = (
            bool(self.waiting) and len(self.running) < self.max_batch and (not self.running or not self._last_prefill)
        )
        self._last_prefill = prefill
        if prefill:
            return Step("prefill", [self.waiting[0]])
        if self.running:
            return Step("decode", list(self.running))
        return None

    def prefill_done(self, req) -> None:
        """The head request's prompt is in; it decodes from the next step unless it finished."""
        if self.waiting and self.waiting[0] is req:
            self.waiting.popleft()
        if not req.finished:
            self.running.append(req)

    def prefill_failed(self, req) -> None:
        if self.waiting and self.waiting[0] is req:
            self.waiting.popleft()

    def preempt(self, req, behind_head: bool = False) -> None:
        """Moves req (running, or the waiting head) to the front of the queue, behind the head
        when that one is part-way through its prefill; it resumes before anything newer."""
        if req in self.running:
            self.running.remove(req)
        elif self.waiting and self.waiting[0] is req:
            self.waiting.popleft()
        self.waiting.insert(1 if behind_head and self.waiting else 0, req)

    def retire(self) -> None:
        """Drops finished requests from the running batch (after a decode step)."""
        self.running = [r for r in self.running if not r.finished]

    def drain(self) -> list:
        """Empties both queues (shutdown); returns what was in them."""
        out = list(self.waiting) + self.running
        self.waiting, self.running = deque(), []
        return out
