"""The page at `/` in a real browser: headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by Selenium) on `edgekv serve` with the real model.

It opens the page, gives the API key the page asks for, sends two turns of a chat that share a
system prompt, and checks that the second answer's bar shows cached tokens and that the cache
pane's hit rate moved; then a message holding markup must stay text, and (the server runs with
`--passage-reuse`) a document added in the page is placed from the passage cache the second
time it is sent. Each state is saved as a
PNG in $EDGEKV_SCREENSHOTS (default: the test's temporary directory); docs/ui/ holds one set.
The page load and the turns' times to first token are measured in the browser and printed.

Where Chromium, its driver or Selenium is missing the tests skip and say what to install,
because `make test` needs no root; with CI=true (`.ci/run`, which installs them) they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from edgekv.engines.models import default_model_path
from edgekv_bench.texts import MANUAL, SYSTEM_PROMPT

from ..conftest import real_stack

real_stack("the real server stack", "llama_cpp", "fastapi", "uvicorn",
           check=default_model_path)

from .servekit import serve_process  # noqa: E402

pytestmark = pytest.mark.real
KEY = "browser-test-key"
SYSTEM = SYSTEM_PROMPT + "\n\n" + MANUAL  # ~1,000 tokens, shared by both turns
QUESTIONS = ("What does an orange ring mean?", "And how do I reset the hub?")
DOCUMENT = MANUAL[:1200]  # a few hundred tokens
MARKUP = '<script>window.__pwned = 1</script><img src="x" onerror="window.__pwned = 2"><b>bold?</b>'
CHROME_ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
               "--window-size=1280,960", "--hide-scrollbars")


def browser_or_skip() -> tuple[str, str]:
    """Chromium's and chromedriver's paths; a skip naming what is missing (a failure with
    CI=true)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    missing = [name for name, found in (("chromium", chromium), ("chromium-driver", driver))
               if not found]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install -e '.[test]')")
    if missing:
        why = (f"the browser test needs {', '.join(missing)}: as root, `apt-get install "
               "chromium chromium-driver` (Debian's packages; .ci/run installs them)")
        if os.environ.get("CI") == "true":
            pytest.fail(why + " -- CI=true: required, not skipped")
        pytest.skip(why)
    assert chromium and driver
    return chromium, driver


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Callable[[Any, str], Path]:
    """`shots(driver, name)`: save a PNG of the page as it is now."""
    out = Path(os.environ.get("EDGEKV_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots: {out}")

    def take(driver: Any, name: str) -> Path:
        path = out / f"{name}.png"
        assert driver.save_screenshot(str(path)), path
        return path

    return take


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """`edgekv serve --passage-reuse` with one API key, on a free port, a fresh cache directory
    and whole-chunk reuse forced (the start then skips the batch-invariance probe)."""
    browser_or_skip()  # before the model loads
    tmp = tmp_path_factory.mktemp("serve-ui")
    keys = tmp / "keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o600)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "EDGEKV_REUSE_GRANULARITY": "chunk"}
    env.pop("EDGEKV_API_KEYS", None)
    with serve_process(["--port", "0", "--cache-dir", str(tmp), "--api-key-file", str(keys),
                        "--passage-reuse"], tmp / "server.log", env) as url:
        yield url


@pytest.fixture(scope="module")
def browser(server, tmp_path_factory) -> Iterator[Any]:
    chromium, driver_path = browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tmp_path_factory.mktemp("chromium-profile")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in (*CHROME_ARGS, f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=driver_path, log_output=str(profile / "driver.log"))
    driver = webdriver.Chrome(service=service, options=opts)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver: Any, script: str, timeout: float = 180, what: str = "") -> Any:
    """Poll a JavaScript expression until it is truthy; its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script("return " + script)
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what or script}"
        time.sleep(0.1)


def ask(driver: Any, question: str, turn: int) -> dict[str, str]:
    """Type `question`, press Enter, wait for the answer; the answer's data attributes."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(By.ID, "prompt")
    box.send_keys(question)
    box.send_keys(Keys.ENTER)
    wait(driver, f"document.querySelectorAll('#messages li.assistant.done, "
         f"#messages li.assistant.failed').length >= {turn}", what=f"answer {turn}")
    li = driver.find_elements(By.CSS_SELECTOR, "#messages li.assistant")[turn - 1]
    assert "failed" not in (li.get_attribute("class") or ""), li.text
    return driver.execute_script("return Object.assign({}, arguments[0].dataset)", li)


def hit_rate(driver: Any, above: float = -1.0) -> float:
    """The cache pane's hit rate once a refresh shows one above `above`."""
    value = wait(driver, "(() => { const r = document.getElementById('hit-rate').dataset.rate;"
                 f" return r !== '' && r !== undefined && Number(r) > {above} ? r : null; }})()",
                 timeout=30, what=f"a hit rate above {above}")
    return float(value)


def test_two_turns_show_the_cache_working(server, browser, shots):
    from selenium.webdriver.common.keys import Keys

    d = browser
    navigation = ("document.readyState === 'complete' && "
                  "performance.getEntriesByType('navigation')[0].toJSON()")
    d.get(server + "/")
    nav = wait(d, navigation, 30)  # the browser's first page
    d.refresh()
    again = wait(d, navigation, 30)  # the same page once more (the browser started)
    wait(d, "!document.getElementById('stats-error').hidden", 30, "the key to be asked for")
    assert "API key" in d.find_element("id", "stats-error").text
    shots(d, "01-asks-for-the-key")

    d.find_element("id", "key").send_keys(KEY, Keys.ENTER)
    wait(d, "document.getElementById('stats-error').hidden", 30, "the stats with the key")
    wait(d, "document.getElementById('health').textContent.includes('ready')", 30)
    d.execute_script("document.getElementById('system').value = arguments[0];"
                     "document.getElementById('max-tokens').value = '32';", SYSTEM)
    shots(d, "02-ready")

    first = ask(d, QUESTIONS[0], 1)
    assert int(first["cached"]) == 0 and int(first["computed"]) == int(first["prompt"]) > 900
    cold_rate = hit_rate(d)
    shots(d, "03-first-turn-cold")

    second = ask(d, QUESTIONS[1], 2)
    cached = int(second["cached"])
    assert cached > 512, second  # the system prompt's chunks, and the first turn's
    assert cached + int(second["computed"]) + int(second["streamed"]) == int(second["prompt"])
    seg = d.find_elements("css selector", "#messages li.assistant")[1].find_elements(
        "css selector", ".bar .seg.cached")
    assert len(seg) == 1 and seg[0].value_of_css_property("flex-grow") == str(cached)
    warm_rate = hit_rate(d, above=cold_rate)
    assert warm_rate > cold_rate
    rows = d.find_elements("css selector", "#tiers tbody tr")
    assert rows and any(int(r.find_elements("tag name", "td")[2].text.replace(",", "")) > 0
                        for r in rows)  # a tier holds the fragments
    wait(d, "document.querySelector('#spark polyline')", 30, "the TTFT sparkline")
    shots(d, "04-second-turn-warm")

    timings = {"page_load_ms": round(nav["loadEventEnd"] - nav["startTime"], 1),
               "reload_ms": round(again["loadEventEnd"] - again["startTime"], 1),
               "reload_dom_content_loaded_ms": round(again["domContentLoadedEventEnd"]
                                                     - again["startTime"], 1),
               "cold_ttft_ms": float(first["ttftMs"]), "warm_ttft_ms": float(second["ttftMs"]),
               "warm_cached_tokens": cached, "warm_prompt_tokens": int(second["prompt"]),
               "hit_rate": [cold_rate, warm_rate]}
    print("\nbrowser timings: " + json.dumps(timings))
    if os.environ.get("EDGEKV_BROWSER_TIMINGS"):  # docs/bench/ui-browser.json
        from edgekv_bench.report import environment, write_json

        write_json(os.environ["EDGEKV_BROWSER_TIMINGS"],
                   {"bench": "ui-browser", "test": "tests/serve/test_browser.py",
                    "environment": environment(), **timings})
    assert float(second["ttftMs"]) < float(first["ttftMs"])  # ~1,000 tokens not prefilled


def test_markup_in_a_message_stays_text(server, browser, shots):
    d = browser
    if not d.current_url.startswith(server):
        d.get(server + "/")
    d.find_element("id", "new-chat").click()
    key = d.find_element("id", "key")
    if not key.get_attribute("value"):
        key.send_keys(KEY)
    ask(d, MARKUP, 1)
    user = d.find_elements("css selector", "#messages li.user .text")
    assert [u.get_attribute("textContent") for u in user] == [MARKUP]
    counts = d.execute_script(
        "const m = document.getElementById('messages');"
        "return [m.querySelectorAll('script, img, b').length, window.__pwned === undefined]")
    assert counts == [0, True]
    errors = [e["message"] for e in d.get_log("browser")
              if "Content Security Policy" in e["message"] or "Uncaught" in e["message"]]
    assert not errors, errors  # the page runs within its own CSP, without script errors
    shots(d, "05-markup-stays-text")


def test_a_document_is_placed_from_the_passage_cache_the_second_time(server, browser, shots):
    d = browser
    if not d.current_url.startswith(server):
        d.get(server + "/")
    key = d.find_element("id", "key")
    if not key.get_attribute("value"):
        key.send_keys(KEY)
    d.execute_script("document.getElementById('system').value = 'Answer from the documents.';"
                     "document.getElementById('documents').open = true;")
    d.find_element("id", "add-doc").click()
    d.find_element("css selector", "#doc-list .doc textarea").send_keys(DOCUMENT)
    answers = []
    for _ in range(2):
        d.find_element("id", "new-chat").click()
        answers.append(ask(d, QUESTIONS[0], 1))
    first, again = answers
    assert int(first["placed"]) == 0 and int(again["placed"]) > 100, answers
    assert (int(again["cached"]) + int(again["placed"]) + int(again["computed"])
            == int(again["prompt"]))
    legend = d.find_element("css selector", "#messages li.assistant .legend").text
    assert "from the passage cache" in legend
    shots(d, "06-document-from-the-passage-cache")
