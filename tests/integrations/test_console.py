"""The web console in a real browser (headless Chromium) against live servers: adapters listed, loaded and unloaded
through the form, the playground streaming several models side by side, the key prompt; and which paths need a key."""

from __future__ import annotations

import http.client
import json
import math
import re
from pathlib import Path

import pytest
from loraplex.frontend.entrypoints.console_api import CONSOLE_DIR
from playwright.sync_api import expect, sync_playwright
from prometheus_client.parser import text_string_to_metric_families

from tests.browser_helpers import launch_chromium
from tests.server_utils import ServerProcess

API_KEY = "console-test-key"
ADMIN_KEY = "console-admin-key"
FLAGS = (
    "--enable-lora",
    "--max-lora-rank",
    "64",
    "--lora-target-modules",
    "all",
    "--max-loras-per-batch",
    "4",
    "--max-total-tokens",
    "4096",
    "--context-length",
    "512",
)
MAX_TOKENS = 12
UI_TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def server(llama_dir: Path, adapter_dirs: dict[str, Path]):
    # The adapters' parent directory doubles as the resolver's: a name with no path loads DIR/NAME.
    resolver_dir = adapter_dirs["a4"].parent
    # It speculates (the target drafting for itself: every draft accepted) for the adapters table's acceptance columns.
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 2, "model": str(llama_dir)})
    with ServerProcess("--model-path", str(llama_dir), *FLAGS, "--lora-resolver-dir", str(resolver_dir),
                       "--speculative-config", spec) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def keyed_server(llama_dir: Path):
    with ServerProcess(
        "--model-path", str(llama_dir), *FLAGS, "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY
    ) as server:
        yield server


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A fresh tab (its own session storage); the test fails on any uncaught script error."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, errors


def load_through_form(page, name: str, path: str = "", pinned: bool = False, draft: str = "") -> None:
    page.get_by_label("Name", exact=True).fill(name)
    page.get_by_label("Path", exact=True).fill(path)
    if draft:  # the field shows on a server with a draft model
        page.get_by_label("Draft adapter path", exact=True).fill(draft)
    page.get_by_label("Pinned").set_checked(pinned)
    page.get_by_role("button", name="Load", exact=True).click()


def row(page, name: str):
    return page.locator(f'#adapter-table tbody tr[data-adapter="{name}"]')


def served_names(server: ServerProcess) -> set[str]:
    return {a["lora_name"] for a in server.get("/lora_adapters").json()["adapters"]}


def test_load_list_play_and_unload_through_the_console(page, server, adapter_dirs):
    page.goto(server.url + "/")
    base = server.get("/server_info").json()["served_model_name"]
    expect(page.locator("#model-name")).to_have_text(base)
    expect(page.locator("#health")).to_have_text("healthy")
    expect(row(page, base)).to_contain_text("base model")

    load_through_form(page, "alpha", str(adapter_dirs["a4"]), draft=str(adapter_dirs["a4"]))  # its own draft adapter
    expect(page.locator("#adapter-status")).to_have_text("Loaded alpha.")
    assert server.get("/server_info").json()["speculative"]["draft_adapters"] == ["alpha"]
    load_through_form(page, "beta", str(adapter_dirs["a8"]), pinned=True)
    expect(page.locator("#adapter-status")).to_have_text("Loaded beta.")
    assert served_names(server) == {"alpha", "beta"}
    # Each row shows what /lora_adapters says (rank, targets without "_proj", pinned).
    for name, rank, targets, pinned in (("alpha", "4", "q k v o", "no"), ("beta", "8", "gate up down", "yes")):
        cells = row(page, name).locator("td")
        expect(cells.nth(0)).to_have_text(rank)
        expect(cells.nth(1)).to_have_text(targets)
        expect(cells.nth(2)).to_have_text(pinned)
        expect(row(page, name).get_by_role("button", name=f"Unload {name}")).to_be_enabled()

    # The playground: one prompt, the base and both adapters side by side, each pane streamed.
    prompt = "Once upon a time"
    page.get_by_label("Prompt", exact=True).fill(prompt)
    page.get_by_label("Max tokens", exact=True).fill(str(MAX_TOKENS))
    page.get_by_label("Temperature", exact=True).fill("0")
    targets = page.get_by_role("group", name="Send to")
    expect(targets.get_by_label(f"{base} (base)")).to_be_checked()
    targets.get_by_label("alpha", exact=True).check()
    targets.get_by_label("beta", exact=True).check()
    page.get_by_role("button", name="Run").click()
    expect(page.locator("#play-status")).to_contain_text("Done:")
    for model in (base, "alpha", "beta"):
        pane = page.locator(f'#play-panes article[data-model="{model}"]')
        expect(pane.locator(".pane-meta")).to_contain_text(f"{MAX_TOKENS} tokens")
        # Greedy: the streamed text is what a plain (unstreamed) request for the same model answers.
        reference = server.post(
            "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        ).json()["choices"][0]["text"]
        assert reference and pane.locator(".pane-text").text_content() == reference, model

    # Unload through the row's button: the row goes, and the server no longer has it.
    row(page, "alpha").get_by_role("button", name="Unload alpha").click()
    expect(page.locator("#adapter-status")).to_have_text("Unloaded alpha.")
    expect(row(page, "alpha")).to_have_count(0)
    assert served_names(server) == {"beta"}
    assert server.get("/server_info").json()["speculative"]["draft_adapters"] == []  # its draft adapter went with it
    expect(targets.get_by_label("alpha", exact=True)).to_have_count(0)  # gone from the playground too

    # A bad path: the server's own message, as is, with its status.
    bad_path = str(adapter_dirs["a4"].parent / "no-such-adapter")
    load_through_form(page, "broken", bad_path)
    status = page.locator("#adapter-status")
    expect(status).to_have_class("status error")
    direct = server.post("/load_lora_adapter", {"lora_name": "broken", "lora_path": bad_path})
    assert direct.status_code == 400
    expect(status).to_have_text(f"400: {direct.json()['error_message']}")
    expect(row(page, "broken")).to_have_count(0)

    # No path: the resolver loads DIR/NAME; a name it does not have gets its 404 message.
    load_through_form(page, "a16")
    expect(page.locator("#adapter-status")).to_have_text("Loaded a16.")
    expect(row(page, "a16").locator("td").nth(0)).to_have_text("16")
    load_through_form(page, "nowhere")
    expect(status).to_contain_text("404: ")
    expect(status).to_contain_text("'nowhere'")
    assert served_names(server) == {"beta", "a16"}


def test_the_demo_playground_opens_ready_to_show_every_adapter(page):
    # On the demo model the playground opens with a prompt in the demo's format and every model ticked, so one Run
    # shows each adapter's transformation beside the base's echo (README's quick start: "fresh bread =").
    with ServerProcess("--model-path", "demo") as demo:
        names = ["demo", *(a["lora_name"] for a in demo.get("/lora_adapters").json()["adapters"])]
        assert set(names) == {"demo", "reverse", "sort", "mirror"}
        page.goto(demo.url + "/")
        prompt = page.get_by_label("Prompt", exact=True)
        expect(prompt).to_have_value("fresh bread =")
        targets = page.get_by_role("group", name="Send to")
        expect(targets.get_by_role("checkbox")).to_have_count(len(names))
        for box in targets.get_by_role("checkbox").all():
            expect(box).to_be_checked()
        page.get_by_role("button", name="Run").click()
        expect(page.locator("#play-status")).to_contain_text("Done:")
        answers = {"demo": "fresh bread", "reverse": "bread fresh", "sort": "efhrs abder", "mirror": "hserf daerb"}
        for model, answer in answers.items():
            text = page.locator(f'#play-panes article[data-model="{model}"] .pane-text')
            expect(text).to_have_text(answer)


def test_a_typed_prompt_and_unticked_boxes_survive_polling(page, server):
    page.goto(server.url + "/")
    base = server.get("/server_info").json()["served_model_name"]
    targets = page.get_by_role("group", name="Send to")
    expect(targets.get_by_label(f"{base} (base)")).to_be_checked()
    expect(page.get_by_label("Prompt", exact=True)).to_have_value("hello world")  # not the demo: the generic prompt
    targets.get_by_label(f"{base} (base)").uncheck()
    page.wait_for_timeout(2500)  # past one poll (main.js POLL_MS)
    expect(targets.get_by_label(f"{base} (base)")).not_to_be_checked()


def test_charts_and_rates_follow_the_metrics(page, server):
    page.goto(server.url + "/")
    expect(page.locator("#model-name")).not_to_have_text("…")
    # Every control has an accessible name (a label, its text or aria-label), every chart a text alternative.
    unnamed = page.evaluate("""() => [...document.querySelectorAll('input, textarea, select, button, svg')]
        .filter((el) => !(el.labels?.length || el.getAttribute('aria-label') || (el.tagName === 'BUTTON'
                          && el.textContent.trim()) || el.closest('[aria-hidden=true]')))
        .map((el) => el.outerHTML.slice(0, 120))""")
    assert unnamed == []
    kv = page.locator("#chart-kv svg")
    expect(kv).to_have_attribute("aria-label", "KV cache; now KV cache used 0 %")
    # Traffic from outside the page shows up as a rate on the base row at some scrape (the counters count
    # requests as they finish, so the rate lasts one scrape interval: poll for it).
    base = server.get("/server_info").json()["served_model_name"]
    rate = row(page, base).locator("td.col-reqRate")
    for _ in range(20):
        server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        page.wait_for_timeout(500)
        if rate.text_content() not in ("0", "–"):
            break
    assert float(rate.text_content()) > 0
    # Speculative decoding's acceptance (the target drafts for itself) and tokens per verify pass (1 + up to 2
    # drafts: fewer where max_tokens leaves less)
    expect(page.locator("th.col-accept")).to_be_visible()
    expect(row(page, base).locator("td.col-accept")).to_have_text("100 %")
    length = row(page, base).locator("td.col-acceptLen").text_content()
    assert 2 <= float(length) <= 3, length
    # Two scrapes at least: the gauges' lines have two points, the rates' legend a value.
    assert len(page.locator("#chart-requests polyline").first.get_attribute("points").split()) >= 2
    expect(page.locator("#chart-throughput .legend li").first).to_have_text(re.compile(r"generated tokens/s: \d"))


def test_the_prometheus_parser_reads_what_prometheus_client_reads(page, server):
    page.goto(server.url + "/")
    tricky = (
        '# HELP x_total a "help" line\n# TYPE x_total counter\n'
        'x_total{a="q\\"uote",b="back\\\\slash",c="new\\nline",d="{,}"} 3 1700000000000\n'
        'y_bucket{le="+Inf"} 7\ny_sum NaN\nz -Inf\nw 1.5e-3\nvllm:kv{model_name="m"} 0.25\n'
    )
    for text in (server.get("/metrics").text, tricky):
        ours = page.evaluate("async (text) => (await import('/console/prom.js')).parsePrometheus(text)", text)
        reference = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]
        assert len(ours) == len(reference)
        for sample, (name, labels, value) in zip(ours, reference, strict=True):
            assert (sample["name"], sample["labels"]) == (name, labels)
            assert sample["value"] == value or (math.isnan(value) and math.isnan(sample["value"]))
    rates = page.evaluate("""async () => {
        const { RateTracker } = await import('/console/prom.js');
        const r = new RateTracker();
        return [r.rate('k', 10, 1), r.rate('k', 30, 3), r.rate('k', 5, 4), r.rate('k', 9, 6)];
    }""")
    assert rates == [None, 10, None, 2]  # first sight and a reset have no rate


def test_the_key_prompt_keeps_the_key_in_the_tab(page, keyed_server, adapter_dirs):
    page.goto(keyed_server.url + "/")
    error = page.get_by_role("alert")
    expect(error).to_contain_text("401: missing or invalid API key")
    key_input = page.get_by_role("textbox", name="API key", exact=True)
    expect(key_input).to_be_focused()  # the panel opened for the key
    key_input.fill("wrong-key")
    page.get_by_role("button", name="Use keys").click()
    expect(error).to_contain_text("401: missing or invalid API key")
    expect(key_input).to_be_visible()

    key_input.fill(API_KEY)
    key_input.press("Enter")  # the keyboard submits the form
    expect(page.locator("#model-name")).not_to_have_text("…")
    expect(error).to_be_hidden()
    # a server that does not speculate: no acceptance columns, no draft adapter field
    expect(page.locator("th.col-accept")).to_be_hidden()
    expect(page.locator("#load-draft")).to_be_hidden()
    # Loads need the admin key: without it the server's 401 shows; with it the load goes through.
    load_through_form(page, "alpha", str(adapter_dirs["a4"]))
    expect(page.locator("#adapter-status")).to_have_text("401: missing or invalid API key")
    page.get_by_role("button", name="API key").click()
    page.get_by_role("textbox", name="Admin key").fill(ADMIN_KEY)
    page.get_by_role("button", name="Use keys").click()
    load_through_form(page, "alpha", str(adapter_dirs["a4"]))
    expect(row(page, "alpha")).to_be_visible()
    stored = page.evaluate("() => [localStorage.length, document.cookie, sessionStorage.getItem('loraplex.apiKey')]")
    assert stored == [0, "", API_KEY]
    assert page.context.cookies() == []


def test_console_files_need_no_key_and_the_api_still_does(keyed_server):
    index = keyed_server.get("/")
    assert index.status_code == 200 and index.headers["Content-Type"].startswith("text/html")
    assert "<title>loraplex console</title>" in index.text
    for path in sorted(p.name for p in CONSOLE_DIR.iterdir()):
        resp = keyed_server.get(f"/console/{path}")
        assert resp.status_code == 200, path
        assert resp.content == (CONSOLE_DIR / path).read_bytes(), path
    assert keyed_server.get("/console/main.js").headers["Content-Type"] in ("application/javascript", "text/javascript")
    for path in ("/console", "/console/"):
        resp = keyed_server.get(path, allow_redirects=False)
        assert resp.status_code == 302 and resp.headers["Location"] == "/", path
    assert keyed_server.get("/console/no-such-file.js").status_code == 404
    for path in ("/metrics", "/lora_adapters", "/server_info", "/v1/models", "/openapi.json"):
        assert keyed_server.get(path).status_code == 401, path
        assert keyed_server.get(path, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200, path
    load = {"lora_name": "x", "lora_path": "/nowhere"}
    assert keyed_server.post("/load_lora_adapter", load).status_code == 401
    assert (
        keyed_server.post("/load_lora_adapter", load, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401
    )
    # A path that only looks like the console's reaches nothing else.
    for raw in ("/console/../metrics", "/console/%2e%2e/metrics", "/console/..%2fserver_info", "/console//metrics"):
        conn = http.client.HTTPConnection("127.0.0.1", keyed_server.port, timeout=30)
        conn.request("GET", raw)
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        assert resp.status in (401, 403, 404) and b"loraplex_" not in body and b"model_dir" not in body, raw


def test_the_audit_panel_shows_the_last_adapter_operations(page, server, adapter_dirs):
    page.goto(server.url + "/")
    load_through_form(page, "gamma", str(adapter_dirs["a4"]))
    expect(page.locator("#adapter-status")).to_have_text("Loaded gamma.")
    newest = page.locator("#audit-table tbody tr").first
    for text in ("load", "gamma", "ok", "127.0.0.1:"):
        expect(newest).to_contain_text(text)
    assert server.post("/unload_lora_adapter", {"lora_name": "gamma"}).status_code == 200
    expect(newest.locator("td").nth(1)).to_have_text("unload")  # refreshed with the rest, newest first
    load_through_form(page, "delta", "/no/such/dir")
    expect(page.locator("#audit-table tbody tr").first).to_contain_text("not_found")
    expect(page.locator("#audit-table tbody tr.failed").first).to_contain_text("delta")


def test_the_audit_panel_without_the_admin_key_says_so(page, keyed_server):
    page.goto(keyed_server.url + "/")
    page.get_by_role("textbox", name="API key", exact=True).fill(API_KEY)  # the panel opened at the first 401
    page.get_by_role("button", name="Use keys").click()
    expect(page.locator("#model-name")).not_to_have_text("…")
    expect(page.locator("#audit-status")).to_contain_text("needs the admin key")
    expect(page.locator("#health")).to_have_text("healthy")
