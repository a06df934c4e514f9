"""The workloads of `edgekv bench serve --concurrency/--rate`: requests from several users,
built before any server starts, so that every server answers the same prompts.

- `chat`: users of one deployment share its long system prompt; each user's turn holds their
  earlier questions and canned earlier answers (the start of a paragraph of the deployment's
  own document), which exist before any server runs, unlike the sequential bench's history of
  the reference's own answers (under concurrency no server's answer comes first);
- `docs`: each user has a document of their own before each question, no two users the same:
  the 8 deployment documents, and for users 9-16 the same documents with their paragraphs in
  another order (they share no prefix with the first 8 beyond the instruction). A cache can
  share nothing across users but the short instruction, and a user's document across their
  own questions;
- `gsp`: SGLang `bench_serving`'s generated shared prefix: `groups` system prompts of
  `system_tokens` tokens each (a deployment's document, cut there), `prompts_per_group`
  questions of `question_tokens` tokens per group (text from the other deployments' documents,
  then one of the group's questions), every request in a seeded shuffled order;
- `multiround`: LMCache's multi-round QA: `users` users share one system prompt (a
  deployment's document); each asks `rounds` questions, and each round's prompt holds the
  user's earlier rounds (canned answers, as in `chat`). Round r of every user comes before
  round r + 1 of any, and a user's round is sent only once their last one has answered
  (`Prompt.after`, `load`).

The users take turns (request i comes from user i mod users), so at concurrency c the
requests in flight come from c different users while c <= users.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from edgekv.errors import ConfigError

__all__ = ["DEFAULT_USERS", "DOCS_INSTRUCTION", "WORKLOADS", "Messages", "Prompt", "Shape",
           "build_prompts", "chat_messages", "docs_messages", "gsp_messages",
           "multiround_messages"]

WORKLOADS = ("chat", "docs", "gsp", "multiround")
DEFAULT_USERS = {"chat": 8, "docs": 16, "multiround": 8}  # gsp: groups, not users


@dataclass(frozen=True, slots=True)
class Shape:
    """The sizes of the workloads beyond `requests` and `users` (SGLang's gsp options,
    LMCache's rounds)."""

    gsp_groups: int = 4
    gsp_prompts_per_group: int = 4
    gsp_system_tokens: int = 512
    gsp_question_tokens: int = 64
    rounds: int = 3  # multiround: questions per user

    def __post_init__(self) -> None:
        for name in ("gsp_groups", "gsp_prompts_per_group", "gsp_system_tokens",
                     "gsp_question_tokens", "rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)} must be "
                                  ">= 1")
ANSWER_WORDS = 36  # a canned earlier answer: about the length of a 48-token reply
DOCS_INSTRUCTION = ("Answer the question using only the user's document. If the document "
                    "does not say, answer that it does not say.")

Messages = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request as every server gets it: the user it comes from, its rendered text; the
    request of the same session it is sent after (multiround: the user's last round)."""

    user: int
    text: str
    tokens: int
    after: int | None = None


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

    if users > 2 * len(CLUSTERS):
        raise ConfigError(f"the docs workload has {2 * len(CLUSTERS)} documents, one per "
                          f"user: --users {users} is too many; give at most "
                          f"{2 * len(CLUSTERS)}")
    rng = random.Random(seed)
    order = rng.sample(range(2 * len(CLUSTERS)), users)  # document d: cluster d mod 8
    clusters = [CLUSTERS[d % len(CLUSTERS)] for d in order]
    docs = []
    for d, c in zip(order, clusters):
        paras = _document(c.name)
        if d >= len(CLUSTERS):  # the second copy: its paragraphs from the middle on first
            half = len(paras) // 2 or 1
            paras = paras[half:] + paras[:half]
        docs.append("\n\n".join(paras))
    plans = [rng.sample(range(len(c.intents)), len(c.intents)) for c in clusters]
    out: list[tuple[int, Messages]] = []
    for i in range(requests):
        u, k = i % users, i // users
        c = clusters[u]
        q = c.intents[plans[u][k % len(plans[u])]][rng.randrange(WORDINGS)]
        out.append((u, (("system", DOCS_INSTRUCTION),
                        ("user", f"Document:\n{docs[u]}\n\nQuestion: {q}"))))
    return out


def _cut(text: str, tokens: int, count: Callable[[str], int]) -> str:
    """The longest run of `text`'s leading words of at most `tokens` tokens (by `count`)."""
    words = text.split()
    lo, hi = 0, len(words)
    while lo < hi:  # the most words that fit
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def gsp_messages(shape: Shape, *, seed: int, count: Callable[[str], int]
                 ) -> list[tuple[int, Messages]]:
    """Per request (group, messages): the generated-shared-prefix workload (module doc)."""
    from .corpus import CLUSTERS, WORDINGS

    rng = random.Random(seed)
    groups = [CLUSTERS[i % len(CLUSTERS)] for i in range(shape.gsp_groups)]
    filler = [w for c in CLUSTERS for p in _document(c.name) for w in p.split()]
    out: list[tuple[int, Messages]] = []
    for g, c in enumerate(groups):
        system = _cut(f"[group {g}] " + c.system, shape.gsp_system_tokens, count)
        for _ in range(shape.gsp_prompts_per_group):
            q = c.intents[rng.randrange(len(c.intents))][rng.randrange(WORDINGS)]
            start = rng.randrange(len(filler) - 400)
            context = _cut(" ".join(filler[start:start + 400]),
                           max(1, shape.gsp_question_tokens - count(q) - 2), count)
            out.append((g, (("system", system), ("user", f"{context}\n\n{q}"))))
    rng.shuffle(out)
    return out


def multiround_messages(users: int, shape: Shape, *, seed: int
                        ) -> list[tuple[int, Messages, int | None]]:
    """Per request (user, messages, index of the user's last round or None): round-major,
    each round's prompt holding the user's earlier rounds (module doc)."""
    from .corpus import CLUSTERS, WORDINGS

    rng = random.Random(seed)
    c = rng.choice(CLUSTERS)
    paragraphs = _document(c.name)
    n = len(c.intents)
    asked = [[c.intents[(u + r) % n][rng.randrange(WORDINGS)] for r in range(shape.rounds)]
             for u in range(users)]
    answers = [[" ".join(paragraphs[(u + r) % len(paragraphs)].split()[:ANSWER_WORDS])
                for r in range(shape.rounds)] for u in range(users)]
    out: list[tuple[int, Messages, int | None]] = []
    for r in range(shape.rounds):
        for u in range(users):
            msgs: list[tuple[str, str]] = [("system", c.system)]
            for k in range(r):
                msgs += [("user", asked[u][k]), ("assistant", answers[u][k])]
            msgs.append(("user", asked[u][r]))
            out.append((u, tuple(msgs), None if r == 0 else (r - 1) * users + u))
    return out


def build_prompts(workload: str, requests: int, *, users: int, seed: int, budget: int,
                  render: Callable[[Messages], str], count: Callable[[str], int],
                  shape: Shape | None = None) -> list[Prompt]:
    """The rendered prompts of `workload`, each at most `budget` tokens (what one sequence's
    context leaves beside its answer when the most requests are in flight). A chat turn that does
    not fit restarts its conversation there, as a chat front end drops old turns. gsp makes
    groups x prompts per group requests and multiround users x rounds (`shape`), whatever
    `requests` says."""
    shape = shape or Shape()
    out = []
    if workload == "gsp":
        for g, msgs in gsp_messages(shape, seed=seed, count=count):
            text = render(msgs)
            out.append(Prompt(g, text, count(text)))
    elif workload == "multiround":
        for u, msgs, after in multiround_messages(users, shape, seed=seed):
            text = render(msgs)
            out.append(Prompt(u, text, count(text), after))
    elif workload == "docs":
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
