"""Text corpus for the on-device-assistant benchmark workload: 8 assistant deployments.

Each cluster models one deployment: a long shared context (a system prompt followed by a
document, tool list, policy or source file) and short user turns. Every cluster has 8 intents,
and every intent is worded 4 different ways, as different users would ask the same question.

All texts were written for this project; no dataset is fetched. Products, companies and the
medicine described here are fictional. The texts are data, not code: they live in
`edgekv_bench/data/corpus.json` (a list of {"name", "system", "intents": [[4 wordings], ...]}),
read once at import through `importlib.resources`, so they ship inside the package.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

__all__ = ["CLUSTERS", "Cluster", "load_clusters"]

WORDINGS = 4  # every intent is asked these many ways


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    system: str
    intents: tuple[tuple[str, str, str, str], ...]


def load_clusters(resource: str = "data/corpus.json") -> tuple[Cluster, ...]:
    """The clusters stored in the package resource `resource`, checked for shape."""
    text = resources.files("edgekv_bench").joinpath(resource).read_text(encoding="utf-8")
    out = []
    for c in json.loads(text):
        intents = tuple(tuple(str(w) for w in i) for i in c["intents"])
        if not intents or any(len(i) != WORDINGS for i in intents):
            raise ValueError(f"{resource}: cluster {c['name']!r} needs intents of "
                             f"{WORDINGS} wordings each")
        out.append(Cluster(str(c["name"]), str(c["system"]), intents))  # type: ignore[arg-type]
    return tuple(out)


CLUSTERS: tuple[Cluster, ...] = load_clusters()
