"""Workloads: the seed's experiment shape, multi-turn chats, or any request list from a JSONL file.

Seed (EdgeSync-LLM benchmark/runner.go): 8 semantic prompt clusters, 64 unique prompts with 4
variants each, 1000 requests. Here each cluster is an assistant deployment with a shared long
context (system prompt + document or tool list, several hundred tokens) and short user turns;
a unique prompt is one user intent, its 4 variants are rewordings. Requests draw clusters and
intents with Zipf-like popularity (a few contexts and questions dominate, as in real usage)
and variants uniformly, from a seeded RNG, so a run is reproducible.

RAG: a short fixed instruction, then k (3-6) passages a retriever returned for the question,
in the order it ranked them (which varies from request to request), then the question. The
passages come from the deployments' documents cut into paragraphs; two or three are from the
question's own document (popular paragraphs recur), the rest are distractors from others.

Header: the deployment's system prompt behind a dynamic header (today's date, the user's name),
as assistants that personalise their prompt write it: the shared part no longer starts the
prompt, so a prefix cache shares it only between requests of the same user on the same day.

Chat: a few users, each talking to one deployment (several users share one, so the long system
prompt is shared across users too), each conversation growing turn by turn, the users' turns
interleaved. A turn's prompt holds the model's own earlier answers, which exist only at run
time: a chat request carries its conversation id and turn index, and `ChatHistory` fills the
answers in as the benchmark produces them.
"""

from __future__ import annotations

import datetime
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from edgekv.errors import ConfigError

__all__ = ["CHAT_MAX_TOKENS", "WORKLOADS", "ChatHistory", "WorkloadItem", "chat_workload",
           "header_workload", "load_jsonl", "load_workload", "parse_workload", "passages",
           "rag_workload", "render", "seed_workload", "unique_prompts", "with_history"]

# generated workloads, by name; anything else is a JSONL path
WORKLOADS = ("seed", "chat", "rag", "header")
DEFAULT_REQUESTS = 1000  # the seed's run length
SEED_MAX_TOKENS = 16  # enough greedy tokens to compare outputs (fidelity)
CHAT_MAX_TOKENS = 48  # answers long enough that the model's own words make up the history
CHAT_USERS = 6
CHAT_TURNS = (3, 8)  # questions per conversation, at most one per intent of the deployment


@dataclass(frozen=True, slots=True)
class WorkloadItem:
    """One request of a benchmark workload (not the library's `core.request.Request`)."""

    messages: tuple[tuple[str, str], ...] | None  # (role, content), rendered with the template
    prompt: str | None  # raw prompt text (JSONL workloads), used as is
    cluster: str
    intent: str
    max_tokens: int
    conversation: str | None = None  # chat: the conversation this turn belongs to
    turn: int = 0  # chat: index of this turn in its conversation (0 = first question)


def _zipf(n: int, s: float = 1.0) -> list[float]:
    w = [1.0 / (i + 1) ** s for i in range(n)]
    total = sum(w)
    return [x / total for x in w]


def seed_workload(requests: int = 1000, *, seed: int = 0,
                  max_tokens: int = SEED_MAX_TOKENS) -> list[WorkloadItem]:
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
        out.append(WorkloadItem((("system", c.system), ("user", c.intents[i][v])), None, c.name,
                           f"{c.name}/{i}", max_tokens))
    return out


# -- RAG and dynamic headers -----------------------------------------------------------------

RAG_INSTRUCTION = ("Answer the question using only the numbered passages. Quote the passage "
                   "number you used. If the passages do not answer it, say so.")
RAG_K = (3, 6)
HEADER_USERS = ("Amara", "Bilal", "Chen Wei", "Dagny", "Esteban", "Fatima", "Goran", "Hiroko")


def passages(min_chars: int = 120) -> list[tuple[str, str]]:
    """(cluster name, paragraph) for every paragraph of every deployment's document after its
    first (the persona); a short paragraph (a heading) is joined to the one after it."""
    from .corpus import CLUSTERS

    out = []
    for c in CLUSTERS:
        pending = ""
        for para in [x.strip() for x in c.system.split("\n\n") if x.strip()][1:]:
            pending = f"{pending}\n{para}" if pending else para
            if len(pending) >= min_chars:
                out.append((c.name, pending))
                pending = ""
        if pending:
            out.append((c.name, pending))
    return out


def rag_workload(requests: int = 1000, *, seed: int = 0, max_tokens: int = SEED_MAX_TOKENS,
                 k: tuple[int, int] = RAG_K) -> list[WorkloadItem]:
    """`requests` RAG questions: the seed's question popularity, k retrieved passages each."""
    from .corpus import CLUSTERS

    if requests < 1 or not 1 <= k[0] <= k[1]:
        raise ConfigError(f"requests={requests} must be >= 1 and k={k} (low, high) >= 1")
    rng = random.Random(seed)
    pool = passages()
    by_cluster: dict[str, list[str]] = {}
    for name, text in pool:
        by_cluster.setdefault(name, []).append(text)
    clusters = list(CLUSTERS)
    rng.shuffle(clusters)
    cw = _zipf(len(clusters))
    out = []
    for _ in range(requests):
        c = rng.choices(clusters, cw)[0]
        i = rng.choices(range(len(c.intents)), _zipf(len(c.intents)))[0]
        question = rng.choice(c.intents[i])
        own = by_cluster[c.name]
        n = rng.randint(*k)
        relevant = rng.sample(own, min(len(own), rng.randint(2, 3), n))
        others = [t for name, t in pool if name != c.name]
        chosen = relevant + rng.sample(others, n - len(relevant))
        rng.shuffle(chosen)  # the retriever's ranking differs from request to request
        body = "\n\n".join(f"[{j + 1}] {t}" for j, t in enumerate(chosen))
        out.append(WorkloadItem((("system", RAG_INSTRUCTION),
                            ("user", f"Passages:\n{body}\n\nQuestion: {question}")), None,
                           c.name, f"{c.name}/{i}", max_tokens))
    return out


def header_workload(requests: int = 1000, *, seed: int = 0,
                    max_tokens: int = SEED_MAX_TOKENS, days: int = 3) -> list[WorkloadItem]:
    """The seed workload's questions behind a dynamic header: the date moves forward over the
    run (`days` days), each request comes from one of `HEADER_USERS`."""
    base = seed_workload(requests, seed=seed, max_tokens=max_tokens)
    rng = random.Random(seed + 1)
    out = []
    for n, r in enumerate(base):
        assert r.messages is not None
        day = 1 + n * days // len(base)
        user = rng.choice(HEADER_USERS)
        date = datetime.date(2026, 11, day)
        header = (f"Today is {date:%A %Y-%m-%d}. You are talking to {user}; address them by "
                  "name.\n\n")
        (_, system), *rest = r.messages
        out.append(replace(r, messages=(("system", header + system), *rest)))
    return out


# -- chat ----------------------------------------------------------------------------------


def _conversation_plan(intents: Sequence[Sequence[str]], rng: random.Random,
                       turns: tuple[int, int]) -> list[tuple[int, str]]:
    """(intent index, wording) per turn: distinct intents, as a user asks new things."""
    n = min(rng.randint(*turns), len(intents))
    return [(i, rng.choice(intents[i])) for i in rng.sample(range(len(intents)), n)]


def chat_workload(requests: int = 1000, *, seed: int = 0, max_tokens: int = CHAT_MAX_TOKENS,
                  users: int = CHAT_USERS,
                  turns: tuple[int, int] = CHAT_TURNS) -> list[WorkloadItem]:
    """`requests` chat turns of `users` users, interleaved by a seeded RNG.

    Each request's messages are the system prompt and the user's questions so far; the
    assistant answers between them are filled in at run time (`ChatHistory`). When a user's
    conversation has asked all its questions, that user starts a new one.
    """
    from .corpus import CLUSTERS

    if requests < 1 or users < 1 or max_tokens < 1:
        raise ConfigError(f"requests={requests}, users={users} and max_tokens={max_tokens} "
                          "must all be >= 1")
    if not 1 <= turns[0] <= turns[1]:
        raise ConfigError(f"turns={turns} must be (low, high) with 1 <= low <= high")
    rng = random.Random(seed)
    # half as many deployments as users: users share long system prompts, as on one device
    deployments = rng.sample(CLUSTERS, k=max(1, min(len(CLUSTERS), users // 2)))
    cluster_of = [deployments[u % len(deployments)] for u in range(users)]
    plans: list[list[tuple[int, str]]] = [[] for _ in range(users)]
    asked = [0] * users
    sessions = [-1] * users
    out = []
    for _ in range(requests):
        u = rng.randrange(users)
        c = cluster_of[u]
        if asked[u] == len(plans[u]):  # conversation over (or none yet): start a new one
            plans[u], asked[u] = _conversation_plan(c.intents, rng, turns), 0
            sessions[u] += 1
        k = asked[u]
        asked[u] += 1
        questions = tuple(("user", q) for _, q in plans[u][: k + 1])
        out.append(WorkloadItem((("system", c.system), *questions), None, c.name,
                           f"{c.name}/{plans[u][k][0]}", max_tokens,
                           conversation=f"user{u}/conv{sessions[u]}", turn=k))
    return out


def with_history(req: WorkloadItem, answers: Sequence[str], *, start: int = 0) -> WorkloadItem:
    """`req` with the assistant's `answers` to its earlier questions put between them.

    Turns before `start` are left out (the conversation was restarted there because it no
    longer fit the context window); `answers[i]` is the answer to question `i`.
    """
    if req.conversation is None or req.messages is None:
        return req
    if len(answers) < req.turn or not 0 <= start <= req.turn:
        raise ValueError(f"{req.conversation} turn {req.turn}: needs {req.turn} earlier "
                         f"answers from turn {start}, got {len(answers)}")
    system = [m for m in req.messages if m[0] == "system"]
    questions = [c for r, c in req.messages if r == "user"]
    msgs = list(system)
    for i in range(start, req.turn):
        msgs += [("user", questions[i]), ("assistant", answers[i])]
    msgs.append(("user", questions[req.turn]))
    return replace(req, messages=tuple(msgs))


class ChatHistory:
    """The reference system's answers per conversation, recorded as the benchmark runs them."""

    def __init__(self) -> None:
        self._answers: dict[str, list[str]] = {}
        self._start: dict[str, int] = {}
        self.restarts = 0

    def fill(self, req: WorkloadItem) -> WorkloadItem:
        """The request every mode answers: `req` with its conversation's earlier answers."""
        if req.conversation is None:
            return req
        answers = self._answers.get(req.conversation, [])
        if len(answers) != req.turn:
            raise ValueError(f"{req.conversation} turn {req.turn} arrived after "
                             f"{len(answers)} answered turns; turns must come in order")
        return with_history(req, answers, start=self._start.get(req.conversation, 0))

    def restart(self, req: WorkloadItem) -> WorkloadItem:
        """Start the conversation afresh at this turn (its history no longer fits)."""
        if req.conversation is None:
            return req
        self._start[req.conversation] = req.turn
        self.restarts += 1
        return self.fill(req)

    def record(self, req: WorkloadItem, answer: str) -> None:
        if req.conversation is not None:
            # stripped as a chat front end stores it; the template adds its own separators
            self._answers.setdefault(req.conversation, []).append(answer.strip())


# -- files and names -----------------------------------------------------------------------


def load_jsonl(path: str | Path, *,
               default_max_tokens: int = SEED_MAX_TOKENS) -> list[WorkloadItem]:
    """One JSON object per line: `prompt` (string, required), optional `cluster`, `max_tokens`.
    Any defect of the file (not UTF-8, a line that is not a JSON object, a prompt that is not
    text) is a ConfigError naming the line."""
    p = Path(path)
    out = []
    try:
        # lines end at "\n" only: JSON strings may hold U+2028 and friends, which
        # str.splitlines would take for line ends
        lines = p.read_bytes().decode("utf-8").split("\n")
    except OSError as e:
        raise ConfigError(f"cannot read workload {p}: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
            raise ConfigError(f"{p}:{n}: not valid JSON ({str(e)[:80]})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise ConfigError(f"{p}:{n}: each line needs a non-empty string field 'prompt'")
        try:
            obj["prompt"].encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{p}:{n}: the prompt holds a lone surrogate (\\ud800-\\udfff), "
                              "which is no text") from None
        mt = obj.get("max_tokens", default_max_tokens)
        if type(mt) is not int or mt < 1:  # bool is an int, but true is no token count
            raise ConfigError(f"{p}:{n}: max_tokens must be a positive integer, got {mt!r:.40}")
        cluster = str(obj.get("cluster", "unlabelled"))
        out.append(WorkloadItem(None, obj["prompt"], cluster, obj["prompt"], mt))
    if not out:
        raise ConfigError(f"{p} holds no requests")
    return out


def parse_workload(spec: str | None) -> str | Path:
    """A workload name (`seed`, the default, `chat`, `rag`, `header`) or a JSONL file's path.

    Names win over files of the same name; write `./chat` for a file called `chat`.
    """
    if spec is None or spec in WORKLOADS:
        return spec or "seed"
    p = Path(spec)
    if p.is_file():
        return p
    raise ConfigError(f"--workload {spec!r} is neither a workload name "
                      f"({', '.join(WORKLOADS)}) nor an existing JSONL file; pass one of the "
                      "names or the path of a file with one {\"prompt\": ...} per line")


def load_workload(spec: str | None, *, requests: int | None = None, seed: int = 0,
                  max_tokens: int | None = None) -> tuple[str, list[WorkloadItem]]:
    """(name recorded in the results, requests) for `--workload`, `--requests`, `--max-tokens`.

    Generated workloads have `requests` requests (default 1000); a file's list is cut to
    `requests`. Without `max_tokens`, chat answers get `CHAT_MAX_TOKENS`, others 16.
    """
    kind = parse_workload(spec)
    n = requests or DEFAULT_REQUESTS
    if kind == "seed":
        return "seed", seed_workload(n, seed=seed, max_tokens=max_tokens or SEED_MAX_TOKENS)
    if kind == "chat":
        return "chat", chat_workload(n, seed=seed, max_tokens=max_tokens or CHAT_MAX_TOKENS)
    if kind == "rag":
        return "rag", rag_workload(n, seed=seed, max_tokens=max_tokens or SEED_MAX_TOKENS)
    if kind == "header":
        return "header", header_workload(n, seed=seed,
                                         max_tokens=max_tokens or SEED_MAX_TOKENS)
    reqs = load_jsonl(kind, default_max_tokens=max_tokens or SEED_MAX_TOKENS)
    return str(kind), reqs[:requests] if requests else reqs


def render(req: WorkloadItem, template: str | None, render_chat: object) -> str:
    if req.prompt is not None:
        return req.prompt
    assert req.messages is not None
    roles = [r for r, _ in req.messages]
    if any(a == b == "user" for a, b in zip(roles, roles[1:])):
        # two user turns in a row: the answers between them were never filled in
        raise ValueError(f"{req.conversation} turn {req.turn}: fill the chat history first "
                         "(ChatHistory.fill)")
    msgs = [{"role": r, "content": c} for r, c in req.messages]
    return render_chat(template, msgs)  # type: ignore[operator]


def unique_prompts(reqs: Sequence[WorkloadItem]) -> int:
    return len({(r.messages, r.prompt) for r in reqs})
