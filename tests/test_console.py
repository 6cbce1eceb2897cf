"""The web console in a real browser (Debian's chromium, driven through its chromedriver by Selenium) against a
real 2-stage pipeline of skippyd processes: the pipeline map, chat, sessions, kill, drain, history, 64 live
sessions, and a stage killed with SIGKILL. A screenshot of each page (1280×800) goes to the test's directory.

The browser runs headless and offline: no sandbox (root), no GPU, none of its background traffic to the
network, a fresh profile. Without chromium or chromedriver (scripts/test installs both with apt-get where it
may) these tests skip with the reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import trio

from skippyctl.client import ControlError, open_control
from skippyd.control import messages as m
from tests.openai_api import httpx2
from tests.procs import Pipeline, free_ports, split_for_test

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
LANES = 64
# each link slowed down a little, so that a generation lasts long enough to be seen running (and killed)
CONFIG = {"stage.link_delay_ms": 15.0}
# where the screenshots are copied too, when set (the README's are made with SKIPPY_CONSOLE_SHOTS=docs/console)
SHOTS = os.environ.get("SKIPPY_CONSOLE_SHOTS")


def _need_browser() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        pytest.skip(f"no {' or '.join(missing)} (apt-get install chromium chromium-driver)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("the selenium package is not installed")


@pytest.fixture(scope="module")
def console(default_model_path, tmp_path_factory):
    _need_browser()
    work = tmp_path_factory.mktemp("console")
    split_for_test(default_model_path, 2, work)
    port = free_ports(1)[0]
    pipe = Pipeline(work / "topology.toml", work, config=CONFIG,
                    extra=["--openai", f"127.0.0.1:{port}", "--ctx", "192", "--lanes", str(LANES)]).start()
    try:
        yield Console(pipe, f"http://127.0.0.1:{port}", work)
    finally:
        pipe.stop()


@pytest.fixture(scope="module")
def browser(console, tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,800",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_window_size(1280, 800)
    try:
        yield driver
    finally:
        driver.quit()


class Console:
    def __init__(self, pipe: Pipeline, base: str, work: Path):
        self.pipe, self.base, self.work = pipe, base, work

    def generate_in_background(self, n: int = 1, **kw) -> list:
        """Start `n` generations on the control channel (as skippyctl generate does) in a thread; the list
        fills with their results (or ControlErrors) as they end."""
        results: list = []

        async def one(client):
            try:
                results.append(await client.call(m.Generate(id=client.new_id(), stream=True, **kw)))
            except ControlError as exc:
                results.append(exc)

        async def many():
            async with open_control(self.pipe.head.url, self.pipe.head.token_file) as client:
                async with trio.open_nursery() as nursery:
                    for _ in range(n):
                        nursery.start_soon(one, client)

        threading.Thread(target=trio.run, args=(many,), daemon=True).start()
        return results


def wait_for(driver, condition, timeout: float = 10.0, what: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d), message=what)


def css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def shot(driver, name: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.png"
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 1000
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(SHOTS) / f"{name}.png")


def open_page(driver, console: Console, page: str) -> None:
    if not driver.current_url.startswith(console.base):
        driver.get(console.base + "/#" + page)
        wait_for(driver, lambda d: d.execute_script("return window.skippyConsole.events") > 0, what="first event")
    css(driver, f"#tab-{page}")[0].click()


def rows(driver) -> list:
    return css(driver, "#sessions-table tbody tr")


def cli_rows(driver) -> list[list[str]]:
    """The cells of the rows of generations started on the control channel, read at one instant."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#sessions-table tbody tr[data-origin=\"CLI\"]')]"
        ".map((tr) => [...tr.children].map((td) => td.textContent))")


# ---------------------------------------------------------------- the pages
def _text_of(elements) -> str | None:
    """The first element's text, or None while there is none or it was redrawn under us."""
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        return elements[0].text if elements else None
    except StaleElementReferenceException:
        return None


def test_pipeline_page_shows_both_stages_healthy(console, browser, tmp_path):
    open_page(browser, console, "pipeline")
    topo = console.pipe.topology
    for spec in topo.stages:
        # the text is read as the element is found: the page redraws a stage's card on every update
        up = f'.stage[data-index="{spec.index}"][data-health="up"]'
        text = wait_for(browser, lambda d, up=up: _text_of(css(d, up)), what=f"stage {spec.index} up")
        assert f"layers {spec.layer_start}–{spec.layer_end}" in text
        assert f"{spec.host}:{spec.port}" in text
    # the link between them was measured
    wait_for(browser, lambda d: "ms" in css(d, '.link[data-from="0"]')[0].text, what="the link's round trip")
    shot(browser, "pipeline", tmp_path)


def test_a_chat_streams_its_reply_into_the_page(console, browser, tmp_path):
    open_page(browser, console, "chat")
    css(browser, "#chat-temperature")[0].clear()
    css(browser, "#chat-temperature")[0].send_keys("0")
    css(browser, "#chat-max-tokens")[0].clear()
    css(browser, "#chat-max-tokens")[0].send_keys("24")
    css(browser, "#chat-input")[0].send_keys("Name three colours.")
    css(browser, "#chat-send")[0].click()
    reply = wait_for(browser, lambda d: (css(d, '.msg.assistant[data-done="yes"]') or [None])[0], timeout=30,
                     what="the reply")
    stats = reply.find_element("css selector", ".reply-stats").text
    assert "tok/s" in stats and "TTFT" in stats, stats
    text = reply.text.replace(stats, "").strip()
    # what the API answers for the same chat, whole (greedy: the same tokens)
    with httpx2.Client(base_url=console.base, timeout=60) as h:
        whole = h.post("/v1/chat/completions", json={
            "model": MODEL_ID, "temperature": 0, "max_tokens": 24,
            "messages": [{"role": "user", "content": "Name three colours."}]}).json()
    assert text == whole["choices"][0]["message"]["content"].strip()
    shot(browser, "chat", tmp_path)


def test_a_cli_generation_comes_and_goes_in_the_sessions_view(console, browser, tmp_path):
    open_page(browser, console, "sessions")
    results = console.generate_in_background(prompt="Write a long story about a lighthouse.", max_tokens=60)
    cells = wait_for(browser, lambda d: (cli_rows(d) or [None])[0], what="the session's row")
    assert cells[1] == "CLI" and cells[3].isdigit() and int(cells[3]) > 0, cells
    wait_for(browser, lambda d: results and not rows(d), timeout=60, what="the row gone once it ended")
    assert results[0]["finish_reason"] in ("stop", "length"), results


def test_killing_from_the_page_frees_the_session_on_every_stage(console, browser):
    open_page(browser, console, "sessions")
    results = console.generate_in_background(prompt="Count from one to a thousand, in words.", max_tokens=160)
    wait_for(browser, lambda d: any(int(cells[4] or 0) > 2 for cells in cli_rows(d)), what="decoding")
    css(browser, '#sessions-table tr[data-origin="CLI"] button.kill')[0].click()
    wait_for(browser, lambda d: not rows(d), timeout=10, what="the row gone after the kill")
    wait_for(browser, lambda d: results, timeout=10, what="the generation's result")
    assert results[0]["finish_reason"] == "cancelled", results
    trio.run(console.pipe.wait_all_released, 3.0)  # every stage: no session, every slot free


def test_drain_from_the_page_refuses_new_requests(console, browser, tmp_path):
    open_page(browser, console, "lanes")
    css(browser, "#drain")[0].click()
    wait_for(browser, lambda d: css(d, "#lanes-state")[0].get_attribute("data-draining") == "yes", what="draining")
    try:
        with httpx2.Client(base_url=console.base, timeout=60) as h:
            refused = h.post("/v1/chat/completions", json={"model": MODEL_ID, "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "Hi"}]})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining", refused.text
        shot(browser, "lanes", tmp_path)
    finally:
        css(browser, "#undrain")[0].click()
        wait_for(browser, lambda d: css(d, "#lanes-state")[0].get_attribute("data-draining") == "no",
                 what="undrained")


def test_history_charts(console, browser, tmp_path):
    open_page(browser, console, "history")
    # the generations above were recorded: tok/s has points, and so has the time to first token
    wait_for(browser, lambda d: int(css(d, "#chart-tps")[0].get_attribute("data-points") or 0) > 0, what="tok/s")
    wait_for(browser, lambda d: int(css(d, "#chart-ttft")[0].get_attribute("data-points") or 0) > 0, what="TTFT")
    assert css(browser, "#chart-tps path.line")
    shot(browser, "history", tmp_path)


def test_64_live_sessions_render_at_a_bounded_rate(console, browser, tmp_path):
    from skippyd.console.feed import MIN_INTERVAL_S

    open_page(browser, console, "sessions")
    results = console.generate_in_background(LANES, prompt="Tell me about the sea.", max_tokens=120,
                                             temperature=0.8)
    wait_for(browser, lambda d: len(rows(d)) == LANES, timeout=30, what=f"{LANES} rows")
    assert css(browser, "#sessions-count")[0].text == str(LANES)
    count = browser.execute_script
    before, started = count("return [window.skippyConsole.events, window.skippyConsole.renders]"), time.monotonic()
    time.sleep(2.0)
    after, elapsed = count("return [window.skippyConsole.events, window.skippyConsole.renders]"), \
        time.monotonic() - started
    events, renders = after[0] - before[0], after[1] - before[1]
    # the daemon publishes at most once per MIN_INTERVAL_S (whatever 64 sessions do), the page renders at most
    # once per event
    assert 0 < events <= elapsed / MIN_INTERVAL_S + 2, (events, elapsed)
    assert renders <= events + 1, (renders, events)
    for row in rows(browser)[:3]:
        assert row.get_attribute("data-state") in ("prefill", "decode", "queued")
    wait_for(browser, lambda d: len(css(d, '#sessions-table tr[data-state="decode"]')) >= LANES // 2, timeout=30,
             what="half of them decoding")
    shot(browser, "sessions", tmp_path)
    # under load the pipeline page has each stage's busy share, compute per step and the stage that limits
    css(browser, "#tab-pipeline")[0].click()
    wait_for(browser, lambda d: len(css(d, ".stage.limiting")) == 1, timeout=5, what="the limiting stage")
    shot(browser, "pipeline", tmp_path)
    async def kill_all():
        async with open_control(console.pipe.head.url, console.pipe.head.token_file) as client:
            for s in await client.call(m.SessionsList(id=client.new_id())):
                await client.call(m.SessionKill(id=client.new_id(), session_id=s["session_id"]))

    trio.run(kill_all)
    wait_for(browser, lambda d: len(results) == LANES and not rows(d), timeout=30, what="every session gone")


def test_a_stage_killed_turns_unhealthy_within_3_s(console, browser):
    open_page(browser, console, "pipeline")
    wait_for(browser, lambda d: css(d, '.stage[data-index="1"][data-health="up"]'), what="stage 1 up")
    console.pipe.stages[1].signal(signal.SIGKILL)
    started = time.monotonic()
    wait_for(browser, lambda d: css(d, '.stage[data-index="1"][data-health="down"]'), timeout=5,
             what="stage 1 down")
    assert time.monotonic() - started <= 3.0
    console.pipe.stages[1].wait_exit()
