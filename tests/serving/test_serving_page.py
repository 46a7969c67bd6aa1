"""The page at / of the REST port, in Debian's headless Chromium driven by Playwright: an image of two digits
uploaded, or digits drawn, and what the page shows read back against what the exported graph answers."""

from __future__ import annotations

import json

import shutil
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from capsnet.serving.kserve_http import PAGE
from capsnet.training.data import load_dataset
from serving_helpers import ServerThread, graph_probabilities, server_config

CHROMIUM = Path("/usr/bin/chromium")
# what keeps Chromium off the network it would otherwise reach for at start (the page itself fetches nothing else)
CHROMIUM_FLAGS = ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def browser_skip_reason() -> str | None:
    if not CHROMIUM.is_file() or shutil.which(str(CHROMIUM)) is None:
        return f"{CHROMIUM} (Debian's chromium package) is not installed; scripts/test.sh installs it when run as root"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package (the dev extra) is not installed"
    return None


needs_browser = pytest.mark.skipif(browser_skip_reason() is not None, reason=str(browser_skip_reason()))


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


def url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.server.http_port}/"


def open_page(browser, server: ServerThread):
    """A new page of the server, every request it makes recorded; returns (page, requested URLs)."""
    page = browser.new_page()
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(url(server))
    page.wait_for_selector("body[data-ready=true]", timeout=30_000)
    return page, requested


def shown(page) -> tuple[np.ndarray, list[int]]:
    """The lengths the bars show, and the classes the page calls present, once the answer is in."""
    page.wait_for_selector("#present[data-state=done]", timeout=30_000)
    lengths = np.array([float(text) for text in page.locator(".length").all_inner_texts()], dtype=np.float32)
    present = page.locator("#present").get_attribute("data-classes")
    return lengths, [int(index) for index in present.split(",")] if present else []


def sent_pixels(page) -> np.ndarray:
    """The image the page sends for its canvas, as the model takes it: (1, C, H, W) in [0, 1]."""
    image = page.evaluate("pixels()")
    return (np.array(image["values"], dtype=np.float32) / 255).reshape(image["shape"])


@needs_browser
def test_an_uploaded_pair_shows_both_digits_present(any_size_server, shared_tiny_export, browser, tmp_path):
    answer = graph_probabilities(shared_tiny_export)
    test = load_dataset("embedded").test
    rng = np.random.default_rng(0)
    for _ in range(200):  # the first seeded pair of different digits whose two longest capsules are its classes
        first, second = rng.integers(len(test.labels), size=2)
        pixels = np.concatenate([test.images[first][0], test.images[second][0]], axis=1)  # (28, 56) uint8
        lengths = answer(pixels[None, None].astype(np.float32) / 255)[0]
        digits = {int(test.labels[first]), int(test.labels[second])}
        if len(digits) == 2 and set(np.argsort(-lengths)[:2].tolist()) == digits:
            break
    else:
        pytest.fail("no pair of 200 has its classes as the model's two longest capsules")
    path = tmp_path / "pair.png"
    Image.fromarray(pixels).save(path)

    page, requested = open_page(browser, any_size_server)
    page.set_input_files("#file", str(path))
    shown_lengths, present = shown(page)
    np.testing.assert_allclose(shown_lengths, lengths, rtol=0, atol=2e-3)  # shown with 3 decimals
    assert present == [index for index in np.argsort(-lengths, kind="stable") if lengths[index] > 0.5]
    assert "28x56 image sent" in page.locator("#status").inner_text()
    # a threshold between the second and third longest capsules: the page marks exactly the two digits present
    ranked = np.sort(lengths)[::-1]
    page.fill("#threshold", f"{(ranked[1] + ranked[2]) / 2:.4f}")
    _, present = shown(page)
    assert set(present) == digits and len(page.locator(".present.name").all()) == 2
    # the classes are named as model.json names them, which the page reads from Triton's model config
    names = json.loads((shared_tiny_export / "model.json").read_text())["class_names"]
    assert page.locator(".name").all_inner_texts() == names
    assert page.locator("#present").inner_text() == "present: " + ", ".join(names[index] for index in present)
    assert f"{url(any_size_server)}v2/models/capsnet/infer" in requested
    assert all(request.startswith(url(any_size_server)) for request in requested), requested
    page.close()


@needs_browser
def test_digits_drawn_on_a_canvas_of_any_size_get_the_lengths_the_server_answers(any_size_server,
                                                                                  shared_tiny_export, browser):
    page, _ = open_page(browser, any_size_server)
    page.fill("#height", "40")
    page.fill("#width", "100")
    page.click("#resize")
    box = page.locator("#canvas").bounding_box()
    scale = box["width"] / 100  # screen pixels per image pixel
    for start, strokes in (((12, 8), [(12, 32)]), ((40, 10), [(52, 10), (44, 20), (52, 30)])):  # a 1, then a 7-ish
        page.mouse.move(box["x"] + start[0] * scale, box["y"] + start[1] * scale)
        page.mouse.down()
        for x, y in strokes:
            page.mouse.move(box["x"] + x * scale, box["y"] + y * scale, steps=8)
        page.mouse.up()
    lengths, _ = shown(page)
    image = sent_pixels(page)
    assert image.shape == (1, 1, 40, 100) and image.max() == 1.0  # the strokes are in what was sent
    np.testing.assert_allclose(lengths, graph_probabilities(shared_tiny_export)(image)[0], rtol=0, atol=2e-3)
    page.close()


@needs_browser
def test_a_fixed_size_model_gets_the_image_fitted_and_shows_its_reconstruction(server, model_dir, browser, tmp_path):
    test = load_dataset("embedded").test
    path = tmp_path / "pair.png"
    Image.fromarray(np.concatenate([test.images[0][0], test.images[1][0]], axis=1)).save(path)
    page, _ = open_page(browser, server)
    page.set_input_files("#file", str(path))
    lengths, _ = shown(page)
    assert "resized from 28x56 to the model's 28x28, keeping its aspect ratio" in page.locator("#status").inner_text()
    image = sent_pixels(page)
    assert image.shape == (1, 1, 28, 28) and not image[0, 0, :6].any()  # a strip centred on black, not squashed
    np.testing.assert_allclose(lengths, graph_probabilities(model_dir)(image)[0], rtol=0, atol=2e-3)
    assert page.locator("#reconstruction-box").is_visible()
    page.close()


def test_the_page_is_one_file_that_fetches_nothing_elsewhere_and_no_ui_turns_it_off(server, model_dir):
    text = PAGE.read_text()
    assert "http://" not in text and "https://" not in text and "src=" not in text  # no external or other assets
    with urllib.request.urlopen(url(server), timeout=30) as answer:
        assert answer.status == 200 and answer.read() == PAGE.read_bytes()
        assert "default-src 'none'; connect-src 'self'" in answer.headers["Content-Security-Policy"]
    without = ServerThread(server_config(model_dir, ui=False))
    try:
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(url(without), timeout=30)
        assert raised.value.code == 404
    finally:
        without.stop()
