"""The browser demo end to end in real headless Chromium (Debian's, driven by Playwright) against a real server with
the tiny model and a local fake LLM: Opus packets arrive and decode with WebCodecs, the AudioWorklet plays them, the
page shows its time to first audio, and a barge-in silences the audio and stops the LLM. There is no audio device:
the worklet's own count of played samples shows it ran. A screenshot is kept in test-artifacts/."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from playwright.sync_api import Page, sync_playwright

from realtime.gateway import Limits
from realtime.llm import LLMConfig
from tests.fake_llm import running_fake_llm
from tests.gateway_server import running_server

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("VOXGATE_TEST_ARTIFACTS", ROOT / "test-artifacts"))
CHROMIUM = "/usr/bin/chromium"  # Debian's package (.ci/run installs it)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--autoplay-policy=no-user-gesture-required", "--disable-component-update", "--disable-sync",
                  "--no-first-run", "--disable-quic"]
REPLY = ["Sure", "!", " Let", " me", " tell", " you", " a", " long", " story", ","] + [" and", " then"] * 150


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


def open_demo(browser, url: str, init_script: str | None = None) -> Page:
    page = browser.new_page()
    page.thrown = []  # asserted empty by the tests (an exception in a Playwright handler would be lost)
    page.on("pageerror", lambda error: page.thrown.append(str(error)))
    if init_script:
        page.add_init_script(init_script)
    page.goto(url)
    page.wait_for_function("window.voxgateDemo && window.voxgateDemo.ready", timeout=60_000)
    return page


def demo(page: Page) -> dict:
    return page.evaluate("({...window.voxgateDemo})")


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def say(page: Page, text: str) -> None:
    page.fill("#message", text)
    page.click("#send")


def test_llm_reply_is_spoken_while_it_streams_and_barge_in_stops_it(browser):
    with running_fake_llm(REPLY, token_delay_s=0.03) as llm, \
            running_server(Limits(api_keys=("demo-key",)), llm=LLMConfig(llm.url, "fake-chat")) as server:
        page = open_demo(browser, server.http + "/?token=demo-key")
        state = demo(page)
        assert state["format"] == "opus" and state["llm"] == {"model": "fake-chat"}
        assert "fake-chat" in page.text_content("#note")
        assert page.eval_on_selector_all("#voice option", "options => options.map(o => o.value)")[:1] == ["aiden"]

        say(page, "Tell me a story.")
        page.wait_for_function("window.voxgateDemo.played > 4800", timeout=120_000)  # 0.1 s through the worklet
        state = demo(page)
        assert state["frames"] > 0 and state["bytes"] > 0 and state["decodedSamples"] >= state["played"]
        assert isinstance(state["ttfaMs"], int) and state["ttfaMs"] > 0
        assert page.text_content("#ttfa") == f"{state['ttfaMs']} ms"
        assert page.text_content("#bitrate").endswith("kbit/s")
        assert page.text_content(".bubble.assistant").startswith("Sure! Let me tell you")
        assert llm.calls[-1].outcome == "streaming"  # the LLM is still writing while the audio plays
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "web-demo.png"), full_page=True)

        page.click("#stop")
        page.wait_for_function("window.voxgateDemo.cancelAcks === 1 && window.voxgateDemo.bufferedMs === 0",
                               timeout=30_000)
        played = demo(page)["played"]
        time.sleep(1.0)
        assert demo(page)["played"] == played  # silent: nothing more reaches the worklet
        wait_until(lambda: llm.calls[-1].outcome == "cancelled")

        say(page, "Another one, please.")  # a new message after the barge-in speaks again
        page.wait_for_function(f"window.voxgateDemo.played > {played + 4800}", timeout=120_000)
        say(page, "Stop, and answer this instead.")  # barge-in by a new message
        page.wait_for_function("window.voxgateDemo.cancelAcks === 2", timeout=30_000)
        wait_until(lambda: len(llm.calls) == 3)
        assert [call.outcome for call in llm.calls] == ["cancelled", "cancelled", "streaming"]
        history = llm.calls[-1].body["messages"]
        assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant", "user"]
        assert history[-1]["content"].startswith("Stop")
        heard = history[1]["content"]  # a barged-in answer is remembered as far as it was heard
        assert heard.endswith("…") and "".join(REPLY).startswith(heard[:-1])
        assert demo(page)["errors"] == [] and page.thrown == []
        page.close()


def test_without_an_llm_the_page_speaks_what_is_typed_over_pcm_where_opus_is_missing(browser):
    with running_server(Limits()) as server:
        page = open_demo(browser, server.http + "/", init_script="delete window.AudioDecoder")
        state = demo(page)
        assert state["format"] == "pcm" and state["llm"] is None
        assert "No LLM is configured" in page.text_content("#note")
        say(page, "Hello from the browser.")
        page.wait_for_function("window.voxgateDemo.played > 4800", timeout=120_000)
        assert page.text_content(".bubble.assistant") == "Hello from the browser."
        page.wait_for_function("document.getElementById('status').textContent === 'done'", timeout=120_000)
        state = demo(page)
        assert state["serverTtfaMs"] > 0 and state["errors"] == [] and page.thrown == []
        assert abs(state["bytes"] / 2 - state["decodedSamples"]) == 0  # PCM s16le at 48 kHz, as played
        page.close()


def test_a_voice_design_model_speaks_with_the_instructions_the_page_fills_in(browser, tiny_checkpoints):
    with running_server(Limits(), model=tiny_checkpoints["voice_design"]) as server:
        page = open_demo(browser, server.http + "/")
        assert page.input_value("#voice") == "design" and page.input_value("#instructions")
        say(page, "Hello.")
        page.wait_for_function("window.voxgateDemo.played > 4800", timeout=120_000)
        assert demo(page)["errors"] == [] and page.thrown == []
        page.close()
