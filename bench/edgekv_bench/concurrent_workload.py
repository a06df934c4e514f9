"""The workloads of `edgekv bench serve --concurrency`: requests from several users at once,
built before any server starts, so that every server answers the same prompts.

- `chat`: users of one deployment share its long system prompt; each user's turn holds their
  earlier questions and canned earlier answers (the start of a paragraph of the deployment's
  own document), which exist before any server runs, unlike the sequential bench's history of
  the reference's own answers (under concurrency no server's answer comes first);
- `docs`: each user has a document of their own (a deployment's document, a few hundred
  tokens, no two users the same) before each question: a cache can share nothing across users
  but the short instruction, and a user's document across their own questions.

The users take turns (request i comes from user i mod users), so at concurrency c the
requests in flight come from c different users while c <= users.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from edgekv.errors import ConfigError

__all__ = ["DOCS_INSTRUCTION", "WORKLOADS", "Messages", "Prompt", "build_prompts",
           "chat_messages", "docs_messages"]

WORKLOADS = ("chat", "docs")
ANSWER_WORDS = 36  # a canned earlier answer: about the length of a 48-token reply
DOCS_INSTRUCTION = ("Answer the question using only the user's document. If the document "
                    "does not say, answer that it does not say.")

Messages = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request as every server gets it: the user it comes from, its rendered text."""

    user: int
    text: str
    tokens: int


def _document(name: str) -> list[str]:
    from .workload import passages

    return [text for cluster, text in passages() if cluster == name]


def chat_messages(requests: int, *, users: int, seed: int = 0
                  ) -> list[tuple[int, str, int, list[Messages]]]:
    """Per request (user, conversation id, turn, candidate message lists): users of one
    deployment in turn, each asking its questions in a seeded order. Candidate i leaves out
    the turns before i (the conversation restarted there, once it no longer fit).

    Earlier answers are canned (the start of a paragraph of the deployment's document), so
    they exist before any server runs and every server sees the same history."""
    from .corpus import CLUSTERS, WORDINGS

    rng = random.Random(seed)
    c = rng.choice(CLUSTERS)
    paragraphs = _document(c.name)
    n = len(c.intents)
    base = rng.sample(range(n), n)
    # user u asks the questions in `base` from its u-th on: users ask different things at
    # the same turn, as a shared prompt's users do (no whole-prompt repeats between users)
    plans = [base[u % n:] + base[: u % n] for u in range(users)]
    words = [[rng.randrange(WORDINGS) for _ in range(n)] for _ in range(users)]
    out = []
    for i in range(requests):
        u, k = i % users, (i // users) % n  # after every question, a new conversation
        asked = [c.intents[j][words[u][j]] for j in plans[u][: k + 1]]
        answers = [" ".join(paragraphs[j % len(paragraphs)].split()[:ANSWER_WORDS])
                   for j in plans[u][:k]]
        candidates = []
        for start in range(k + 1):
            msgs: list[tuple[str, str]] = [("system", c.system)]
            for q, a in zip(asked[start:k], answers[start:k]):
                msgs += [("user", q), ("assistant", a)]
            candidates.append((*msgs, ("user", asked[k])))
        out.append((u, f"user{u}/conv{(i // users) // n}", k, candidates))
    return out


def docs_messages(requests: int, *, users: int, seed: int = 0) -> list[tuple[int, Messages]]:
    """Per request (user, messages): each user's own deployment document (no two users share
    one) and one of that deployment's questions, the users in turn."""
    from .corpus import CLUSTERS, WORDINGS

    if users > len(CLUSTERS):
        raise ConfigError(f"the docs workload has {len(CLUSTERS)} documents, one per user: "
                          f"--users {users} is too many; give at most {len(CLUSTERS)}")
    rng = random.Random(seed)
    clusters = rng.sample(CLUSTERS, users)
    docs = ["\n\n".join(_document(c.name)) for c in clusters]
    plans = [rng.sample(range(len(c.intents)), len(c.intents)) for c in clusters]
    out: list[tuple[int, Messages]] = []
    for i in range(requests):
        u, k = i % users, i // users
        c = clusters[u]
        q = c.intents[plans[u][k % len(plans[u])]][rng.randrange(WORDINGS)]
        out.append((u, (("system", DOCS_INSTRUCTION),
                        ("user", f"Document:\n{docs[u]}\n\nQuestion: {q}"))))
    return out


def build_prompts(workload: str, requests: int, *, users: int, seed: int, budget: int,
                  render: Callable[[Messages], str], count: Callable[[str], int]
                  ) -> list[Prompt]:
    """The rendered prompts of `workload`, each at most `budget` tokens (what one sequence's
    context leaves beside its answer when the most requests are in flight). A chat turn that does
    not fit restarts its conversation there, as a chat front end drops old turns."""
    out = []
    if workload == "docs":
        for u, msgs in docs_messages(requests, users=users, seed=seed):
            text = render(msgs)
            out.append(Prompt(u, text, count(text)))
    else:
        start: dict[str, int] = {}
        for u, conv, k, candidates in chat_messages(requests, users=users, seed=seed):
            text = render(candidates[start.get(conv, 0)])
            if count(text) > budget:
                start[conv] = k
                text = render(candidates[k])
            out.append(Prompt(u, text, count(text)))
    worst = max(out, key=lambda p: p.tokens)
    if worst.tokens > budget:
        raise ConfigError(f"a {workload} prompt of {worst.tokens} tokens is over the {budget} "
                          "a prompt may have (one sequence's share of --n-ctx, less "
                          "--max-tokens); raise --n-ctx")
    return out
