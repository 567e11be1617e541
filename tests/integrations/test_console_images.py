"""The console's playground with an image, in headless Chromium: an image picked from a file is sent as a data: URL in
a chat request to every ticked model side by side, and each pane shows that model's answer — the text a plain chat
request with the same image answers (greedy). The server serves the tiny Qwen2.5-VL with an adapter
(tests/vision_requests.py)."""

from __future__ import annotations

import base64

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.browser_helpers import launch_chromium
from tests.image_inputs import GOOD_PNG
from tests.server_utils import ServerProcess
from tests.vision_requests import build_vl_set

MAX_TOKENS = 6
PROMPT = "what is it?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    model_dir, adapters = build_vl_set(root)
    adapter_dir = adapters["a4"]
    with ServerProcess("--model-path", str(model_dir), "--served-model-name", "vl", "--lora-paths",
                       f"seer={adapter_dir}", "--max-total-tokens", "2048", "--context-length", "512") as proc:
        yield proc


@pytest.fixture
def page():
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.set_default_timeout(60_000)
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        yield page
        browser.close()
        assert not errors, errors


def chat_answer(server: ServerProcess, model: str) -> str:
    url = "data:image/png;base64," + base64.b64encode(GOOD_PNG).decode()
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]}]}
    return server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]


def test_an_image_goes_to_every_ticked_model_and_each_answers(page, server, tmp_path):
    image_path = tmp_path / "cat.png"
    image_path.write_bytes(GOOD_PNG)
    page.goto(server.url + "/")
    targets = page.get_by_role("group", name="Send to")
    expect(targets.get_by_label("vl (base)")).to_be_checked()
    expect(targets.get_by_label("seer", exact=True)).to_be_checked()
    page.get_by_label("Prompt", exact=True).fill(PROMPT)
    page.get_by_label("Max tokens", exact=True).fill(str(MAX_TOKENS))
    page.get_by_label("Image (for a vision model)").set_input_files(str(image_path))
    expect(page.locator("#play-image-preview figcaption")).to_contain_text("cat.png")
    preview = page.locator("#play-image-preview img")  # shown (the page's CSP lets data: images in)
    page.wait_for_function("img => img.complete", arg=preview.element_handle())
    assert preview.evaluate("img => img.naturalWidth") == 32
    page.get_by_role("button", name="Run").click()
    expect(page.locator("#play-status")).to_contain_text("Done:")
    for model in ("vl", "seer"):
        pane = page.locator(f'#play-panes article[data-model="{model}"]')
        expect(pane.locator(".pane-meta")).to_contain_text(f"{MAX_TOKENS} tokens")
        expect(pane).not_to_have_class("pane failed")
        reference = chat_answer(server, model)
        assert reference and pane.locator(".pane-text").text_content() == reference, model
    # The image removed: the next Run is a plain completion again
    page.get_by_role("button", name="Remove image").click()
    expect(page.locator("#play-image-preview")).to_be_hidden()
