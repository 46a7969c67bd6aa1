"""A screenshot of the capsule explorer (README's picture): a test digit of the embedded split dropped on the page of a
running `capsnet serve`, one pose dimension moved, the perturbation grid drawn; in Debian's headless Chromium driven
by Playwright (the dev extra), as tests/serving/transports/test_serving_page.py drives it.

Usage: python scripts/explorer_screenshot.py OUT.png [--url http://127.0.0.1:8000/] [--digit 3] [--dimension D]
(--dimension: the slider moved, by default the dimension the export recorded as moving the drawing most)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import urllib.request
from pathlib import Path

from PIL import Image
from playwright.sync_api import sync_playwright

from capsnet.training.data import load_embedded

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def recorded_strongest(url: str) -> int:
    """The pose dimension the served decoder's recorded figures say moves the drawing most (0 without figures)."""
    with urllib.request.urlopen(f"{url}v2/models/capsnet-decoder/config", timeout=30) as answer:
        figures = json.load(answer).get("parameters", {}).get("pose_figures")
    if not figures:
        return 0
    levels = json.loads(figures["string_value"])["sensitivity"]
    return max(range(len(levels)), key=levels.__getitem__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--url", default="http://127.0.0.1:8000/")
    parser.add_argument("--digit", type=int, default=3, help="index in the embedded test split (default 3)")
    parser.add_argument("--dimension", type=int, help="the pose dimension moved to +0.25")
    args = parser.parse_args()
    url = args.url if args.url.endswith("/") else args.url + "/"
    dimension = recorded_strongest(url) if args.dimension is None else args.dimension
    test = load_embedded().test
    with tempfile.TemporaryDirectory() as folder, sync_playwright() as playwright:
        digit = Path(folder) / "digit.png"
        Image.fromarray(test.images[args.digit][0]).save(digit)
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(url)
        page.wait_for_selector("body[data-ready=true]", timeout=60_000)
        page.set_input_files("#file", str(digit))
        page.wait_for_function("() => Number(document.getElementById('reconstruction').dataset.drawn) > 0",
                               timeout=60_000)
        drawn = int(page.locator("#reconstruction").get_attribute("data-drawn"))
        page.focus(f"#dim-{dimension}")
        page.keyboard.press("End")
        page.wait_for_function(f"() => Number(document.getElementById('reconstruction').dataset.drawn) > {drawn}",
                               timeout=60_000)
        page.click("#grid-make")
        page.wait_for_function("() => !document.getElementById('grid').hidden", timeout=60_000)
        page.screenshot(path=str(args.out), full_page=True)
        browser.close()
    print(f"{args.out}: digit {args.digit} (label {test.labels[args.digit]}), dimension {dimension + 1} at +0.25")


if __name__ == "__main__":
    main()
