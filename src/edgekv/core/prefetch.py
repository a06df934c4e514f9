"""N-gram prefetch: predict the next request's context and warm its fragments into RAM.

A request's signature is the chain key of its deepest full chunk, which names its context
(system prompt, document) independently of the user's turn. The predictor counts which
signature followed the last one and the last two (trigram, backing off to bigram, then to
overall frequency) and proposes the top 3. A background thread walks each proposed chain
from disk into the RAM tier. Hit rate = share of predicted requests whose signature was among
the proposals made just before them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter, defaultdict, deque
from collections.abc import Callable

__all__ = ["NgramPredictor", "Prefetcher"]

log = logging.getLogger(__name__)


class NgramPredictor:
    def __init__(self, top: int = 3, history: int = 4096) -> None:
        self.top = top
        self._hist: deque[str] = deque(maxlen=history)
        self._bi: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self._tri: defaultdict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        self._uni: Counter[str] = Counter()

    def observe(self, sig: str) -> None:
        h = self._hist
        if h:
            self._bi[h[-1]][sig] += 1
        if len(h) >= 2:
            self._tri[(h[-2], h[-1])][sig] += 1
        self._uni[sig] += 1
        h.append(sig)

    def predict(self) -> list[str]:
        out: list[str] = []
        h = self._hist
        sources: list[Counter[str]] = []
        if len(h) >= 2:
            sources.append(self._tri.get((h[-2], h[-1]), Counter()))
        if h:
            sources.append(self._bi.get(h[-1], Counter()))
        sources.append(self._uni)
        for counts in sources:
            for sig, _ in counts.most_common():
                if sig not in out:
                    out.append(sig)
                if len(out) == self.top:
                    return out
        return out


class Prefetcher:
    """Runs `warm(signature)` for predicted signatures on a background thread."""

    def __init__(self, warm: Callable[[str], int], predictor: NgramPredictor | None = None) -> None:
        self.predictor = predictor or NgramPredictor()
        self._warm = warm
        self._pending: list[str] = []
        self.requests = self.predicted = self.hits = self.warmed_fragments = 0
        self._q: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="edgekv-prefetch", daemon=True)
        self._thread.start()

    @property
    def hit_rate(self) -> float:
        return self.hits / self.predicted if self.predicted else 0.0

    def observe(self, sig: str | None) -> None:
        if sig is None:
            return
        self.requests += 1
        if self._pending:
            self.predicted += 1
            self.hits += sig in self._pending
        self.predictor.observe(sig)
        self._pending = self.predictor.predict()
        for s in self._pending:
            self._q.put(s)

    def drain(self) -> None:
        """Wait until queued warm-ups are done (tests and benchmarks)."""
        self._q.join()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            sig = self._q.get()
            try:
                if sig is None:
                    return
                self.warmed_fragments += self._warm(sig)
            except Exception as e:  # noqa: BLE001 - prefetch must never break requests
                log.warning("prefetch of %s failed: %s", sig[:12] if sig else sig, e)
            finally:
                self._q.task_done()

    def stats(self) -> dict[str, float]:
        return {"requests": self.requests, "predicted": self.predicted, "hits": self.hits,
                "hit_rate": round(self.hit_rate, 4), "warmed_fragments": self.warmed_fragments}
