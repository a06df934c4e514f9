"""The prompt sets of `edgekv bench spec`, fixed before anything was tuned: the number of
prompts and `max_tokens` of each workload are constants here, and the prompts are built from
committed text only (the packaged manual, fixed code and records), so every run asks the same.

- `rag`: a manual section and a question on it, answered by quoting the section;
- `code_edit`: a function and a rename in it, answered with the whole function;
- `summary`: a manual section to summarise;
- `chat`: multi-turn conversations; each turn's history holds the model's own earlier answers
  (the bench fills them from the reference server's greedy answers, `ChatTurn`);
- `json`: a request to turn a sentence into a tool call with the arguments it names.
"""

from __future__ import annotations

from dataclasses import dataclass

from .texts import MANUAL

__all__ = ["CHAT_CONVERSATIONS", "MAX_TOKENS", "PROMPTS_PER_WORKLOAD", "SpecPrompt",
           "WORKLOADS", "single_turn_prompts"]

WORKLOADS = ("rag", "code_edit", "summary", "chat", "json")
PROMPTS_PER_WORKLOAD = 6  # chat: 2 conversations of 3 turns
MAX_TOKENS = {"rag": 96, "code_edit": 128, "summary": 96, "chat": 64, "json": 64}

SECTIONS = MANUAL.split("\n\n")[1:]  # the eight numbered sections

_RAG = (
    (0, "How long does the hub take to start, and what does the ring do meanwhile?"),
    (1, "How do I pair a Zigbee device?"),
    (2, "What can trigger an automation?"),
    (4, "Where is camera video processed and stored?"),
    (5, "What does a red ring mean, and what should I do?"),
    (7, "Which radios does the hub have?"),
)

_CODE = (
    ("def total_price(items, tax):\n    total = 0\n    for item in items:\n"
     "        total += item.price * item.count\n    total = total * (1 + tax)\n"
     "    return round(total, 2)\n", "total", "amount"),
    ("def read_config(path):\n    with open(path) as handle:\n        lines = handle.readlines()\n"
     "    config = {}\n    for line in lines:\n        key, value = line.split('=', 1)\n"
     "        config[key.strip()] = value.strip()\n    return config\n", "config", "settings"),
    ("def mean_temperature(readings):\n    values = [r.celsius for r in readings]\n"
     "    if not values:\n        return None\n    return sum(values) / len(values)\n",
     "values", "temps"),
    ("def find_device(devices, name):\n    for device in devices:\n"
     "        if device.name == name:\n            return device\n"
     "    raise KeyError(name)\n", "device", "candidate"),
    ("def schedule(events, day):\n    chosen = []\n    for event in events:\n"
     "        if event.day == day:\n            chosen.append(event)\n"
     "    chosen.sort(key=lambda e: e.start)\n    return chosen\n", "chosen", "todays"),
    ("def battery_report(sensors, low=20):\n"
     "    weak = [s.name for s in sensors if s.battery < low]\n"
     "    text = ', '.join(weak)\n"
     "    return f'Replace batteries: {text}' if weak else 'All good'\n", "weak", "flat"),
)

_SUMMARY = (0, 1, 3, 4, 5, 6)

_JSON = (
    "Set the hallway light to 40 percent brightness.",
    "Turn the living room thermostat to 21.5 degrees at 7 am on weekdays.",
    "Lock the back door and the garage door at 11 pm.",
    "Send me a notification when the kitchen sensor sees smoke.",
    "Record the front camera for 30 seconds when the doorbell rings.",
    "Switch off the smart plug called coffee machine after 45 minutes.",
)

# two conversations of three user turns each (answers between them are the model's own)
CHAT_CONVERSATIONS = (
    ("I just bought a Lumen X2 hub. Where should I put it?",
     "And how do I connect it to my Wi-Fi?",
     "Can you repeat the placement advice in one sentence?"),
    ("What does the Energy tab of the Lumen app show?",
     "How often are readings taken?",
     "Summarise what you told me so far."),
)
CHAT_SYSTEM = "You are the Lumen X2 hub's assistant. The manual says:\n\n" + "\n\n".join(
    SECTIONS[:4])


@dataclass(frozen=True, slots=True)
class SpecPrompt:
    """One prompt of a workload: its id and chat messages (role, content)."""

    workload: str
    id: str
    messages: tuple[tuple[str, str], ...]


def single_turn_prompts(workload: str) -> list[SpecPrompt]:
    """The prompts of a single-turn workload (every one but `chat`), in their fixed order."""
    if workload == "rag":
        return [SpecPrompt("rag", f"rag-{i}", (
            ("system", "Answer from the passage, quoting its words."),
            ("user", f"Passage:\n{SECTIONS[s]}\n\nQuestion: {q}")))
            for i, (s, q) in enumerate(_RAG)]
    if workload == "code_edit":
        return [SpecPrompt("code_edit", f"code-{i}", (
            ("user", f"```python\n{code}```\n\nRename the variable `{old}` to `{new}` in the "
                     "function above. Reply with the whole function only."),))
            for i, (code, old, new) in enumerate(_CODE)]
    if workload == "summary":
        return [SpecPrompt("summary", f"summary-{i}", (
            ("user", f"Summarise this text in two or three sentences.\n\n{SECTIONS[s]}"),))
            for i, s in enumerate(_SUMMARY)]
    if workload == "json":
        return [SpecPrompt("json", f"json-{i}", (
            ("system", 'Reply with one JSON object {"tool": ..., "arguments": {...}} and '
                       "nothing else. Tools: set_light, set_thermostat, lock, notify, record, "
                       "switch_plug."),
            ("user", text)))
            for i, text in enumerate(_JSON)]
    raise ValueError(f"{workload!r} is not a single-turn workload of {WORKLOADS}")
