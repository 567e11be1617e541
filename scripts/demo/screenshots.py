"""Screenshots of the web console for the docs: the adapters view (with live charts, under traffic) and the
playground with the base and each adapter answering one prompt side by side.

    python -m scripts.demo.screenshots                    # the demo model -> docs/img/console-*.png
    python -m scripts.demo.screenshots --model-path DIR   # any model; its --lora-paths via --server-arg

Starts its own server (CPU), drives the page in headless Chromium (/usr/bin/chromium), and stops the server.
"""

from __future__ import annotations

import argparse
import itertools
import threading
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

from tests.browser_helpers import launch_chromium
from tests.server_utils import ServerProcess

REPO_ROOT = Path(__file__).resolve().parents[2]
VIEWPORT = {"width": 1200, "height": 900}
MAX_PANES = 4  # the base and up to three adapters side by side


def send_traffic(server: ServerProcess, models: list[str], prompt: str, stop: threading.Event) -> None:
    """Requests round-robin over the models until `stop`, so the rates and charts have something to show."""
    for model in itertools.cycle(models):
        if stop.is_set():
            return
        server.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0.8})


def repo_relative_paths(route) -> None:
    """/lora_adapters with adapter paths under this checkout shown relative to it: the docs' pictures carry no
    machine's directory names (the server itself always reports the real, resolved path)."""
    response = route.fetch()
    route.fulfill(response=response, body=response.text().replace(f"{REPO_ROOT}/", ""))


def take(server: ServerProcess, out_dir: Path, prompt: str, traffic_s: float, num_clients: int) -> list[Path]:
    base = server.get("/server_info").json()["served_model_name"]
    adapters = [a["lora_name"] for a in server.get("/lora_adapters").json()["adapters"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    adapters_png, playground_png = out_dir / "console-adapters.png", out_dir / "console-playground.png"
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        page = browser.new_page(viewport=VIEWPORT)
        page.set_default_timeout(120_000)
        page.route("**/lora_adapters", repo_relative_paths)
        page.goto(server.url + "/")
        expect(page.locator("#model-name")).to_have_text(base)

        stop = threading.Event()
        clients = [
            threading.Thread(target=send_traffic, args=(server, [base, *adapters], prompt, stop))
            for _ in range(num_clients)
        ]
        for client in clients:
            client.start()
        try:
            page.wait_for_timeout(traffic_s * 1000)
            # The adapters view: header, adapters and charts (the playground hidden for this shot).
            page.evaluate("document.getElementById('playground').hidden = true")
            page.screenshot(path=adapters_png, full_page=True)
            page.evaluate("document.getElementById('playground').hidden = false")
        finally:
            stop.set()
            for client in clients:
                client.join()

        targets = page.get_by_role("group", name="Send to")
        for name in adapters[: MAX_PANES - 1]:
            targets.get_by_label(name, exact=True).check()
        page.get_by_label("Prompt", exact=True).fill(prompt)
        page.get_by_label("Max tokens", exact=True).fill("24")
        page.get_by_role("button", name="Run").click()
        expect(page.locator("#play-status")).to_contain_text("Done:")
        page.locator("#playground").screenshot(path=playground_png)
        browser.close()
    return [adapters_png, playground_png]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="demo")
    parser.add_argument("--server-arg", action="append", default=[], help="an extra server flag (repeatable)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "docs" / "img")
    parser.add_argument("--prompt", default="fresh bread =")  # the demo's format: words, then " ="
    parser.add_argument("--traffic-s", type=float, default=20.0, help="traffic before the adapters view is taken")
    parser.add_argument("--clients", type=int, default=3, help="concurrent clients sending that traffic")
    args = parser.parse_args()
    with ServerProcess("--model-path", args.model_path, *args.server_arg, start_timeout_s=600) as server:
        for path in take(server, args.out_dir, args.prompt, args.traffic_s, args.clients):
            print(
                f"{path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path}: "
                f"{path.stat().st_size // 1024} KB"
            )


if __name__ == "__main__":
    main()
