"""Workloads: the seed's experiment shape, or any request list from a JSONL file.

Seed (EdgeSync-LLM benchmark/runner.go): 8 semantic prompt clusters, 64 unique prompts with 4
variants each, 1000 requests. Here each cluster is an assistant deployment with a shared long
context (system prompt + document or tool list, several hundred tokens) and short user turns;
a unique prompt is one user intent, its 4 variants are rewordings. Requests draw clusters and
intents with Zipf-like popularity (a few contexts and questions dominate, as in real usage)
and variants uniformly, from a seeded RNG, so a run is reproducible.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

__all__ = ["Request", "load_jsonl", "seed_workload"]


@dataclass(frozen=True, slots=True)
class Request:
    messages: tuple[tuple[str, str], ...] | None  # (role, content); rendered with the model's template
    prompt: str | None  # raw prompt text (JSONL workloads), used as is
    cluster: str
    intent: str
    max_tokens: int


def _zipf(n: int, s: float = 1.0) -> list[float]:
    w = [1.0 / (i + 1) ** s for i in range(n)]
    total = sum(w)
    return [x / total for x in w]


def seed_workload(requests: int = 1000, *, seed: int = 0, max_tokens: int = 16) -> list[Request]:
    from .corpus import CLUSTERS

    if requests < 1:
        raise ConfigError(f"requests={requests} must be >= 1")
    rng = random.Random(seed)
    clusters = list(CLUSTERS)
    rng.shuffle(clusters)  # which context is popular depends on the seed
    cw = _zipf(len(clusters))
    out = []
    for _ in range(requests):
        c = rng.choices(clusters, cw)[0]
        i = rng.choices(range(len(c.intents)), _zipf(len(c.intents)))[0]
        v = rng.randrange(len(c.intents[i]))
        out.append(Request((("system", c.system), ("user", c.intents[i][v])), None, c.name,
                           f"{c.name}/{i}", max_tokens))
    return out


def load_jsonl(path: str | Path, *, default_max_tokens: int = 16) -> list[Request]:
    """One JSON object per line: `prompt` (string, required), optional `cluster`, `max_tokens`."""
    p = Path(path)
    out = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read workload {p}: {e}") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{p}:{n}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise ConfigError(f"{p}:{n}: each line needs a non-empty string field 'prompt'")
        mt = obj.get("max_tokens", default_max_tokens)
        if not isinstance(mt, int) or mt < 1:
            raise ConfigError(f"{p}:{n}: max_tokens must be a positive integer, got {mt!r}")
        cluster = str(obj.get("cluster", "unlabelled"))
        out.append(Request(None, obj["prompt"], cluster, obj["prompt"], mt))
    if not out:
        raise ConfigError(f"{p} holds no requests")
    return out


def render(req: Request, template: str | None, render_chat: object) -> str:
    if req.prompt is not None:
        return req.prompt
    assert req.messages is not None
    msgs = [{"role": r, "content": c} for r, c in req.messages]
    return render_chat(template, msgs)  # type: ignore[operator]


def unique_prompts(reqs: Sequence[Request]) -> int:
    return len({(r.messages, r.prompt) for r in reqs})
