"""RequestSamples: one request's n samples (SamplingParams.n), from submit to the end of the last one.

The one owner of the n-sample rule: sample 0 is queued and computes the prompt for all of them; the others wait
here (not in the scheduler's queues) until sample 0's prompt is computed and its first token sampled, then fork from
it (`take_forks`; Scheduler.fork gives each its pages: the tree's for what is cached, copied slots for the rest) and
draw their first token from the same logits. If sample 0 ends before that (abort, error), the samples still waiting
end with it (`end`). Engine thread only.
"""

from __future__ import annotations

from radixcache.worker.engine.sequence import Sequence


class RequestSamples:
    def __init__(self, samples: list[Sequence]) -> None:
        if not samples:
            raise ValueError("a request has at least one sample")
        self.first = samples[0]
        self.unfinished: list[Sequence] = list(samples)
        self._waiting_forks: list[Sequence] = samples[1:]

    @property
    def has_waiting_forks(self) -> bool:
        return bool(self._waiting_forks)

    def take_forks(self) -> list[Sequence]:
        """The samples waiting on sample 0, once (call when sample 0's prompt is computed and sampled)."""
        forks, self._waiting_forks = self._waiting_forks, []
        return forks

    def end(self, seq: Sequence) -> list[Sequence]:
        """seq has ended: the samples that must end with it (sample 0 ending before the others forked)."""
        if seq in self.unfinished:
            self.unfinished.remove(seq)
        return self.take_forks() if seq is self.first else []

    @property
    def done(self) -> bool:
        """Every sample has ended: the request id is free again."""
        return not self.unfinished
