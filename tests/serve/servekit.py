"""Helpers for the server tests: a fake engine with a chat template and a gate (and one with
control tokens, as a real tokenizer has), an in-process uvicorn server on a free port, and
readers for SSE streams and Prometheus text."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from edgekv import EdgeKV
from edgekv.engines.fake import FakeAdapter
from edgekv.serve import ServeOptions, bind, create_app

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}<|im_start|>assistant\n")


class ChatFake(FakeAdapter):
    """The fake engine plus a chat template, a gate that holds each decode step while closed
    (so a test can keep a request running), and a log of the prompts it prefilled."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.gate = threading.Event()
        self.gate.set()
        self.decoding = threading.Event()  # set once a decode step waits at the gate
        self.prefills: list[tuple[int, ...]] = []

    def chat_template(self) -> str:
        return CHATML

    def prefill(self, tokens: Sequence[int], *, align: int):  # type: ignore[no-untyped-def]
        if align == 1:  # one sampled token: a decode step
            self.decoding.set()
            if not self.gate.wait(20):
                raise TimeoutError("the test never opened the gate")
        else:
            self.prefills.append(tuple(tokens))
        return super().prefill(tokens, align=align)


class ControlFake(ChatFake):
    """ChatFake whose tokenizer knows ChatML's control tokens, as a real one does: with
    `special=True` their text becomes their id, with `special=False` it stays bytes."""

    CONTROLS = {"<|im_start|>": 300, "<|im_end|>": 301, "<|endoftext|>": 302}

    def __init__(self, **kw: Any) -> None:
        super().__init__(vocab=512, **kw)

    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        ids = [1] if add_bos else []
        if not special:
            return ids + super().tokenize(text, add_bos=False)
        for piece in re.split("(" + "|".join(map(re.escape, self.CONTROLS)) + ")", text):
            ids += ([self.CONTROLS[piece]] if piece in self.CONTROLS
                    else super().tokenize(piece, add_bos=False))
        return ids

    def control_tokens(self) -> dict[str, int]:
        return dict(self.CONTROLS)


@contextmanager
def live_server(kv: EdgeKV | Any, *, model_id: str | None = "fake-model",
                **options: Any) -> Iterator[str]:
    """Serve `kv` (an EdgeKV or a loader) with uvicorn on a free loopback port; yields the URL."""
    app = create_app(kv, model_id=model_id, options=ServeOptions(**options))
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws="none", lifespan="on",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.005)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        adapter = getattr(kv, "adapter", None)
        if isinstance(adapter, ChatFake):
            adapter.gate.set()
        server.should_exit = True
        thread.join(15)
        sock.close()


def sse_chunks(body: str) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body, checking the framing and the final [DONE]."""
    frames = [f for f in body.split("\n\n") if f]
    assert frames and frames[-1] == "data: [DONE]", body[-200:]
    assert all(f.startswith("data: ") for f in frames)
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def metric(url: str, name: str, key: str | None = None, **labels: str) -> float:
    """A sample's value from GET /metrics (0 if absent); `key`: the API key to send."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{url}/metrics", headers=headers)
    assert r.status_code == 200, r.text
    text = r.text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def wait_for(cond: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextmanager
def serve_process(args: Sequence[str], log_path: Path, env: dict[str, str], *,
                  check: Callable[[subprocess.Popen[str]], None] = lambda p: None,
                  timeout_s: float = 180) -> Iterator[str]:
    """A real `edgekv serve ARGS` process, its stderr in `log_path`: yields its URL once
    /health answers 200 (the model loaded), stops it after. `check(proc)` runs once it is up."""
    from edgekv.serve.runner import stop_process

    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "edgekv", "serve", *args],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        check(proc)
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert "listening on" in line, (line, log_path.read_text()[-2000:])
        url = line.split("listening on ")[1].split()[0]
        deadline = time.monotonic() + timeout_s
        while httpx.get(f"{url}/health").status_code != 200:
            assert proc.poll() is None, log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, f"the model did not load within {timeout_s} s"
            time.sleep(0.2)
        yield url
    finally:
        stop_process(proc)
        proc.stdout.close()  # type: ignore[union-attr]
        log.close()
