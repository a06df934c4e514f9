"""SparKV's fill step as the stream tests drive it: one device (an EdgeKV built with a
`HybridLoader` as its fill step) whose `generate(prompt, strategy=...)` switches the loader's
strategy for that request and returns the generation's result with the step's own account
(`GenerationResult.fill_report`, a `HybridResult`) readable on the same object."""

from __future__ import annotations

from typing import Any

from edgekv import EdgeKV
from edgekv.stream.client import KVClient
from edgekv.stream.costmodel import CostModel
from edgekv.stream.hybrid import HybridLoader


class Outcome:
    """A `GenerationResult` and its `HybridResult`: an attribute is the step's if it has it."""

    def __init__(self, result: Any) -> None:
        self.result, self.report = result, result.fill_report

    def __getattr__(self, name: str) -> Any:
        if hasattr(self.report, name):
            return getattr(self.report, name)
        return getattr(self.result, name)


class Device:
    def __init__(self, kv: EdgeKV, client: KVClient | None, cost: CostModel | None = None,
                 **kw: Any) -> None:
        self.loader = HybridLoader(client, cost, **kw)
        self.kv = EdgeKV(kv.adapter, kv.store, kv.config, fill=self.loader)

    def generate(self, prompt: Any, *, strategy: str = "hybrid", **kw: Any) -> Outcome:
        self.loader.strategy = strategy
        # strict whole chunks from the device's cache; approximate KV is never streamed onto
        return Outcome(self.kv.generate(prompt, approximate=False, **kw))

    def __getattr__(self, name: str) -> Any:  # wait_ready, rtt_measured_s, cost, ...
        return getattr(self.loader, name)
