"""The page at / of the REST port, in Debian's headless Chromium driven by Playwright: an image of two digits
uploaded, or digits drawn, and what the page shows read back against what the exported graph answers."""

from __future__ import annotations

import json
import os
import platform
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from serving_helpers import ServerThread, graph_probabilities, metric, rest, scrape, server_config

from capsnet.serving.transports.kserve_http import ICON, PAGE
from capsnet.training.data import load_dataset

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


def pair_of_two_longest(model: Path, path: Path) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """The first seeded 28x56 pair of different test digits whose two longest capsules are its classes, saved as a
    PNG at `path`: (its pixels, the graph's lengths, (left digit, right digit))."""
    answer = graph_probabilities(model)
    test = load_dataset("embedded").test
    rng = np.random.default_rng(0)
    for _ in range(200):
        first, second = rng.integers(len(test.labels), size=2)
        pixels = np.concatenate([test.images[first][0], test.images[second][0]], axis=1)  # (28, 56) uint8
        lengths = answer(pixels[None, None].astype(np.float32) / 255)[0]
        digits = (int(test.labels[first]), int(test.labels[second]))
        if len(set(digits)) == 2 and set(np.argsort(-lengths)[:2].tolist()) == set(digits):
            Image.fromarray(pixels).save(path)
            return pixels, lengths, digits
    pytest.fail("no pair of 200 has its classes as the model's two longest capsules")


@needs_browser
def test_an_uploaded_pair_shows_both_digits_present(any_size_server, shared_tiny_export, browser, tmp_path):
    path = tmp_path / "pair.png"
    _, lengths, digits = pair_of_two_longest(shared_tiny_export, path)

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
    assert set(present) == set(digits) and len(page.locator(".present.name").all()) == 2
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


def test_the_favicon_is_served_and_counted_as_the_pages_own(server):
    def counts():
        samples = scrape(server.metrics_url)
        return (metric(samples, "capsnet_requests_total", api="kserve_http", method="Page", code="OK"),
                metric(samples, "capsnet_requests_total", code="UNIMPLEMENTED"))

    before = counts()
    with urllib.request.urlopen(url(server) + "favicon.ico", timeout=30) as answer:
        assert answer.status == 200 and answer.headers["Content-Type"] == "image/svg+xml"
        assert answer.read() == ICON.read_bytes()
    assert np.subtract(counts(), before).tolist() == [1, 0]
    assert '<link rel="icon" href="/favicon.ico"' in PAGE.read_text()


# --- the capsule explorer: the served decoder redraws a capsule's pose as it is moved ------------------------------

# Set, `capsnet serve`'s defaults serve this export for the explorer tests (a trained model), and the timings of its
# slider moves and grids are written to this report (docs/benchmarks/explorer.md); unset, the tiny export and no
# report.
EXPLORER_MODEL = os.environ.get("CAPSNET_EXPLORER_MODEL")
EXPLORER_REPORT = os.environ.get("CAPSNET_EXPLORER_REPORT")
TIMED_MOVES = 100 if EXPLORER_REPORT else 12
TIMED_GRIDS = 20 if EXPLORER_REPORT else 2
DECODER_INFER = "**/v2/models/capsnet-decoder/infer"


@pytest.fixture(scope="module")
def explorer(request, browser):
    """(server, its export folder, a page of it with a test digit classified and its reconstruction drawn)."""
    if EXPLORER_MODEL:
        served, folder = ServerThread(server_config(Path(EXPLORER_MODEL), max_batch_size=32, max_queue_delay_us=0,
                                                    threads=0)), Path(EXPLORER_MODEL)
    else:
        served, folder = request.getfixturevalue("server"), request.getfixturevalue("model_dir")
    path = request.getfixturevalue("tmp_path_factory").mktemp("explorer") / "digit.png"
    Image.fromarray(load_dataset("embedded").test.images[0][0]).save(path)
    page, _ = open_page(browser, served)
    page.set_input_files("#file", str(path))
    drawn_count(page, above=0)
    load = os.getloadavg()
    yield served, folder, page
    if EXPLORER_REPORT:
        write_report(Path(EXPLORER_REPORT), page.evaluate("window.explorerTimings"), browser.version, folder,
                     (load, os.getloadavg()), served_engines(served))
    page.close()
    if EXPLORER_MODEL:
        served.stop()


REPORT_COMMAND = ("CAPSNET_EXPLORER_MODEL=MODEL_DIR CAPSNET_EXPLORER_REPORT=docs/benchmarks/explorer.md "
                  "python -m pytest tests/serving/transports/test_serving_page.py "
                  "-k 'keyboard or faster or picker or grid or refused'")


def served_engines(served: ServerThread) -> str:
    """What the server ran each model with, from its capsnet_model_info series, and on how many threads."""
    models = sorted(dict(labels) for (name, labels), _ in scrape(served.metrics_url).items()
                    if name == "capsnet_model_info")
    engines = "; ".join(f"{model['model']}: {model['backend']} {model['precision'].upper()}" for model in models)
    threads = served.server.config.intra_op_threads
    return f"{engines}; {threads} intra-op thread{'s' if threads > 1 else ''}"


def write_report(path: Path, measured: list[dict], chromium: str, folder: Path, load: tuple, engines: str) -> None:
    """The explorer's timings, as the page measured them (from the input event to the pixels drawn), as markdown and
    as JSON beside it."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
               platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    kinds = sorted({flag for flag in flags if flag.startswith(("avx", "amx")) or "vnni" in flag})
    machine = f"{cpu}, {os.cpu_count()} cores [{' '.join(kinds)}]"
    rows = {}
    for kind, target in (("slider", 50.0), ("grid", 150.0)):
        times = np.array([entry["ms"] for entry in measured if entry["kind"] == kind])
        rows[kind] = {"count": int(times.size), "p50_ms": float(np.percentile(times, 50)),
                      "p95_ms": float(np.percentile(times, 95)), "max_ms": float(times.max()), "target_ms": target}
    model = json.loads((folder / "model.json").read_text())
    summary = {"command": REPORT_COMMAND, "machine": machine, "engines": engines, "load_average_before_after": load,
               "chromium": chromium, "model": {"training_metrics": model.get("training_metrics", {}),
                                               "decoder": model["decoder"]}, "timings": rows}
    path.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    accuracy = model.get("training_metrics", {}).get("test_accuracy")
    lines = [f"| {kind} | {row['count']} | {row['p50_ms']:.1f} | {row['p95_ms']:.1f} | {row['max_ms']:.1f} | "
             f"{row['target_ms']:.0f} |" for kind, row in rows.items()]
    path.write_text("\n".join([
        "# The capsule explorer: a slider move and a perturbation grid, answered and drawn", "",
        "Measured by the page itself in Debian's headless Chromium (`window.explorerTimings`: from the input "
        "event to the pixels drawn, the served decoder's call over KServe REST in between), against `capsnet "
        f"serve`'s defaults with no queue delay ({engines}) on loopback, by the browser tests of "
        "`tests/serving/transports/test_serving_page.py`:", "", "```", REPORT_COMMAND, "```", "",
        "A slider move: the keyboard's arrow, one move at a time (each answered and drawn before the next: p95 of "
        "what a person holding the key waits for each step). A grid: 16 pose dimensions x 11 steps, 176 "
        "reconstructions from one batched call, drawn and ready to download.", "",
        "| what | n | p50 ms | p95 ms | max ms | target ms (p95) |", "|---|---|---|---|---|---|", *lines, "",
        f"Machine: {machine}; load average (1, 5, 15 min) before {', '.join(f'{v:.2f}' for v in load[0])}, after "
        f"{', '.join(f'{v:.2f}' for v in load[1])} (other work on the machine included). Chromium {chromium}.",
        f"Model: {model.get('training_metrics', {}).get('parameters', 0):,} parameters "
        f"({'%.2f%% test accuracy, ' % (100 * accuracy) if accuracy else ''}"
        f"poses {model['decoder']['inputs'][0]['shape']}), exported with `--reconstruction`.", ""]))


def drawn_count(page, above: int) -> int:
    """The number of reconstructions drawn, once it is above `above`."""
    # functions, not expressions: the page's Content-Security-Policy forbids the eval a polled expression needs
    page.wait_for_function(f"() => Number(document.getElementById('reconstruction').dataset.drawn) > {above}",
                           timeout=30_000)
    return int(page.locator("#reconstruction").get_attribute("data-drawn"))


def reset(page) -> int:
    """Click "reset pose" and wait until its redraw, and any still in flight before it, is drawn: the number drawn
    then (a count read before that would let the next wait pass on an earlier drawing)."""
    page.click("#reset")
    page.wait_for_function("() => !redraws.busy && redraws.wanted === null", timeout=30_000)
    return int(page.locator("#reconstruction").get_attribute("data-drawn"))


def drawn_pixels(page, canvas: str = "reconstruction") -> np.ndarray:
    """The canvas's red channel (the image's grey), (H, W) uint8."""
    values = page.evaluate(f"""() => {{ const c = document.getElementById({canvas!r});
        return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data); }}""")
    height, width = page.evaluate(f"[document.getElementById({canvas!r}).height, "
                                  f"document.getElementById({canvas!r}).width]")
    return np.array(values, dtype=np.uint8).reshape(height, width, 4)[..., 0]


def decoder_draws(folder: Path, page, pose_delta: np.ndarray, as_class: int) -> np.ndarray:
    """What decoder.onnx draws, as 8-bit grey (H, W), of the page's classified poses with the chosen capsule's pose
    moved by `pose_delta` and put in class `as_class`'s place."""
    import onnxruntime

    poses = np.array(page.evaluate("Array.from(state.poses)"), dtype=np.float32)
    source = page.evaluate("state.source")
    classes, dims = page.evaluate("[state.decoder.classes, state.decoder.dims]")
    poses = poses.reshape(1, classes, dims)  # (1, J, D)
    poses[0, as_class] = poses[0, source] + pose_delta
    session = onnxruntime.InferenceSession(str(folder / "decoder.onnx"), providers=["CPUExecutionProvider"])
    (drawn,) = session.run(["reconstruction"], {"poses": poses, "class_index": np.array([as_class])})
    side = int(np.sqrt(drawn.size))
    return np.round(drawn.reshape(side, side) * 255).astype(np.uint8)


def timings(page, kind: str) -> list[float]:
    return [entry["ms"] for entry in page.evaluate("window.explorerTimings") if entry["kind"] == kind]


@needs_browser
def test_a_slider_moved_by_the_keyboard_redraws_what_the_decoder_draws(explorer):
    _, folder, page = explorer
    count = reset(page)
    before = drawn_pixels(page)
    dims = page.evaluate("state.decoder.dims")
    assert page.locator("#dims input[type=range]").count() == dims
    assert page.locator("label[for=dim-0]").inner_text() == "dimension 1"  # each slider named for screen readers
    page.focus("#dim-0")
    page.keyboard.press("ArrowRight")
    count = drawn_count(page, above=count)
    delta = np.zeros(dims, dtype=np.float32)
    delta[0] = float(page.locator("#dim-0").input_value())
    assert delta[0] == pytest.approx(0.01) and "+0.01" in page.locator("#dim-0").get_attribute("aria-valuetext")
    after = drawn_pixels(page)
    assert np.abs(after.astype(int) - before).max() > 0  # the move changed the drawn pixels
    source = page.evaluate("state.source")
    assert np.abs(after.astype(int) - decoder_draws(folder, page, delta, source)).max() <= 1
    for press in range(TIMED_MOVES):  # one move at a time, each answered and drawn before the next
        page.keyboard.press("ArrowLeft" if press % 40 >= 20 else "ArrowRight")
        count = drawn_count(page, above=count)
    assert len(timings(page, "slider")) >= TIMED_MOVES


@needs_browser
def test_moves_faster_than_the_server_answers_keep_one_call_in_flight_and_draw_the_last(explorer):
    _, folder, page = explorer
    count = reset(page)
    # the page's own decoder calls, counted where they are made: the browser's request events reach this process
    # asynchronously, and a wait on the page can return before they do
    page.evaluate("""() => {
        const fetched = window.fetch, calls = window.decoderCalls = {inFlight: 0, most: 0, made: 0};
        window.fetch = async (path, options) => {
            const decoder = String(path).endsWith("/v2/models/capsnet-decoder/infer");
            if (decoder) { calls.inFlight += 1; calls.made += 1; calls.most = Math.max(calls.most, calls.inFlight); }
            try { return await fetched(path, options); } finally { if (decoder) calls.inFlight -= 1; }
        };
        window.restoreFetch = () => { window.fetch = fetched; };
    }""")
    page.focus("#dim-1")
    for _ in range(15):
        page.keyboard.press("ArrowRight")
    page.wait_for_function("() => !redraws.busy && redraws.wanted === null", timeout=30_000)
    calls = page.evaluate("() => { window.restoreFetch(); return window.decoderCalls; }")
    dims = page.evaluate("state.decoder.dims")
    delta = np.zeros(dims, dtype=np.float32)
    delta[1] = float(page.locator("#dim-1").input_value())
    assert calls["most"] == 1 and 1 <= calls["made"] <= 15
    assert drawn_count(page, above=count) <= count + 15
    assert np.abs(drawn_pixels(page).astype(int) - decoder_draws(folder, page, delta, page.evaluate("state.source"))
                  ).max() <= 1  # the latest value won


@needs_browser
def test_the_class_picker_redraws_the_same_pose_as_another_class(explorer):
    _, folder, page = explorer
    count = reset(page)
    page.focus("#dim-0")
    page.keyboard.press("End")  # the pose moved as far as it goes: a long capsule even where the model is untrained
    count = drawn_count(page, above=count)
    source = page.evaluate("state.source")
    before = drawn_pixels(page)
    other = (source + 1) % page.evaluate("state.decoder.classes")
    page.select_option("#draw-as", str(other))
    drawn_count(page, above=count)
    after = drawn_pixels(page)
    assert np.abs(after.astype(int) - before).max() > 0
    moved = np.zeros(page.evaluate("state.decoder.dims"), dtype=np.float32)
    moved[0] = float(page.locator("#dim-0").input_value())
    assert np.abs(after.astype(int) - decoder_draws(folder, page, moved, other)).max() <= 1
    assert page.locator("#reconstruction").get_attribute("aria-label").endswith(f"drawn as {other}")
    page.select_option("#draw-as", str(source))


@needs_browser
def test_the_grid_comes_from_one_call_and_downloads_as_a_png_of_its_size(explorer, tmp_path):
    _, _, page = explorer
    reset(page)
    calls = []
    page.on("request", lambda request: calls.append(request.url) if request.url.endswith("decoder/infer") else None)
    for grids in range(1, TIMED_GRIDS + 1):
        page.click("#grid-make")
        page.wait_for_function(f"() => window.explorerTimings.filter((t) => t.kind === 'grid').length >= {grids}",
                               timeout=30_000)
    assert len(calls) == TIMED_GRIDS  # each grid one decoder call
    dims, (height, width) = page.evaluate("state.decoder.dims"), page.evaluate("state.fixed")
    with page.expect_download() as downloading:
        page.click("#grid-download")
    path = tmp_path / "grid.png"
    downloading.value.save_as(path)
    with Image.open(path) as grid:
        assert grid.format == "PNG" and grid.size == (11 * width, dims * height)
        pixels = np.array(grid.convert("L"))
    # the middle column is the pose unmoved: what the reconstruction shows
    for row in (0, dims - 1):
        tile = pixels[row * height:(row + 1) * height, 5 * width:6 * width]
        assert np.abs(tile.astype(int) - drawn_pixels(page)).max() <= 1
    assert np.abs(pixels[:height, :width].astype(int) - pixels[:height, 10 * width:]).max() > 0  # -0.25 vs +0.25


@needs_browser
def test_a_refused_call_shows_the_servers_message(explorer):
    served, _, page = explorer
    # the page's call, sent to a version the decoder does not have: the server's own refusal comes back
    page.route(DECODER_INFER, lambda route: route.continue_(url=route.request.url.replace(
        "/capsnet-decoder/infer", "/capsnet-decoder/versions/9/infer")))
    page.focus("#dim-2")
    page.keyboard.press("ArrowRight")
    page.wait_for_selector("#explorer-status.error", timeout=30_000)
    shown_message = page.locator("#explorer-status").inner_text()
    status, answer = rest(served, "POST", "/v2/models/capsnet-decoder/versions/9/infer", {})
    assert status == 404 and shown_message == f"capsnet-decoder refused: {answer['error']}"
    page.unroute(DECODER_INFER)
    page.keyboard.press("ArrowLeft")
    page.wait_for_selector("#explorer-status:not(.error)", timeout=30_000)


def moved_drawing(page, dim: int, key: str, count: int) -> tuple[np.ndarray, int]:
    """The decoder's drawing (float, as the page received it) after `key` on dimension `dim`'s slider."""
    page.focus(f"#dim-{dim}")
    page.keyboard.press(key)
    count = drawn_count(page, above=count)
    return np.array(page.evaluate("Array.from(state.drawn.image)")), count


@needs_browser
def test_the_page_says_how_far_the_poses_show_with_the_figures_the_export_recorded(explorer):
    _, folder, page = explorer
    pose = json.loads((folder / "model.json").read_text())["decoder"]["pose"]
    note = page.locator("#pose-note")
    assert note.is_visible()
    dims = len(pose["sensitivity"])
    shows = 2 * pose["visible_dimensions"] >= dims
    assert note.get_attribute("data-shows") == str(shows).lower()
    text = note.inner_text()
    assert text.startswith("This decoder follows the pose" if shows else "This decoder barely follows the pose")
    levels = sorted(pose["sensitivity"])
    for figure in (f"{levels[0]:.1f} to {levels[-1]:.1f} grey levels", f"{pose['visible_dimensions']} of {dims}",
                   f"{pose['fidelity']:.2f}×", f"on {pose['images']} held-out digits"):
        assert figure in text


@needs_browser
def test_the_thumbs_of_untouched_sliders_stay_put_as_the_capsule_nears_its_longest(explorer):
    _, _, page = explorer
    # the chosen capsule made 0.99 long, then its first dimension pushed as far as it goes
    page.evaluate("""() => { window.classifiedPoses = Float32Array.from(state.poses);
        const d = state.decoder.dims, s = state.source;
        const pose = state.poses.subarray(s * d, (s + 1) * d), length = norm(pose);
        for (let k = 0; k < d; k++) pose[k] *= 0.99 / length; }""")
    count = reset(page)
    dims = page.evaluate("state.decoder.dims")

    def thumbs():  # what places each slider's thumb: its range and value
        return [(page.locator(f"#dim-{k}").get_attribute("min"), page.locator(f"#dim-{k}").get_attribute("max"),
                 page.locator(f"#dim-{k}").input_value()) for k in range(dims)]

    assert set(thumbs()) == {("-0.25", "0.25", "0")}
    held = []
    for key in ("End", "Home"):
        _, count = moved_drawing(page, 0, key, count)
        held.append(abs(float(page.locator("#dim-0").input_value())))
        assert page.evaluate("norm(currentPose())") <= page.evaluate("state.decoder.maxLength")
        assert thumbs()[1:] == [("-0.25", "0.25", "0")] * (dims - 1)  # the others' ranges and values as they were
        assert "+0.00" in page.locator("#dim-1-value").inner_text()
    assert min(held) < 0.25  # one way at least, the move stopped where the capsule reached its longest
    page.evaluate("() => { state.poses = window.classifiedPoses; }")
    reset(page)


@needs_browser
def test_the_difference_view_is_the_drawing_minus_the_drawing_at_the_own_pose_amplified(explorer):
    _, folder, page = explorer
    count = reset(page)
    assert page.locator("#difference").get_attribute("data-change") == "0.000"
    assert page.locator("#change").inner_text() == "no change"
    moved, count = moved_drawing(page, 2, "End", count)
    dims, source = page.evaluate("state.decoder.dims"), page.evaluate("state.source")
    delta = np.zeros(dims, dtype=np.float32)
    delta[2] = float(page.locator("#dim-2").input_value())
    original = page.evaluate("Array.from(state.drawn.original)")
    change = np.asarray(moved) - np.asarray(original)
    np.testing.assert_allclose(np.round(np.asarray(moved).reshape(28, 28) * 255),
                               decoder_draws(folder, page, delta, source), atol=1)
    assert float(page.locator("#difference").get_attribute("data-change")) == pytest.approx(
        255 * np.abs(change).mean(), abs=1e-3)
    for gain in ("1", "32"):
        page.select_option("#gain", gain)
        red = drawn_pixels(page, "difference").astype(float)
        expected = np.clip(255 * float(gain) * change, 0, 255).reshape(28, 28)
        assert np.abs(red - expected).max() <= 1
    page.select_option("#gain", "8")


@needs_browser
def test_a_slider_on_a_trained_model_moves_the_drawing_by_the_figure_the_export_recorded(request, browser, tmp_path):
    """Moving one pose dimension from -0.25 to +0.25 on the page changes the decoder's drawing as much as the
    export's measurement says, for the same digits: the page moves poses as the figures are measured. The trained
    tiny model, or CAPSNET_EXPLORER_MODEL's (the quickstart's: its dimensions must then reach the visible level)."""
    from capsnet.models.checkpoint import load_checkpoint
    from capsnet.training.data import Dataset, Split
    from capsnet.training.pose import measure_pose

    folder = Path(EXPLORER_MODEL) if EXPLORER_MODEL else request.getfixturevalue("full_tiny_export") / "model"
    description = json.loads((folder / "model.json").read_text())
    pose = description["decoder"]["pose"]
    dim = int(np.argmax(pose["sensitivity"]))
    test = load_dataset("embedded").test
    model = load_checkpoint(folder / description["artifacts"]["checkpoint"]).build_model()
    served = ServerThread(server_config(folder, precision="fp32"))  # the poses PyTorch's FP32 model gives
    try:
        page, _ = open_page(browser, served)
        changes, measured_on = [], []
        for index in range(len(test.labels)):
            if len(changes) == 4:
                break
            path = tmp_path / f"digit-{index}.png"
            Image.fromarray(test.images[index][0]).save(path)
            count = int(page.locator("#reconstruction").get_attribute("data-drawn"))
            page.set_input_files("#file", str(path))
            count = drawn_count(page, above=count)
            if page.evaluate("state.source") != test.labels[index]:
                continue  # the page draws the longest capsule; the figures, the true class's
            low, count = moved_drawing(page, dim, "Home", count)
            high, count = moved_drawing(page, dim, "End", count)
            changes.append(255 * np.abs(high - low).mean())
            measured_on.append(index)
        page.close()
    finally:
        served.stop()
    digits = Dataset("embedded-mnist-5k", load_dataset("embedded").train,
                     Split(test.images[measured_on], test.labels[measured_on]), tuple(str(k) for k in range(10)))
    expected = measure_pose(model, digits, images=len(measured_on)).sensitivity[dim]
    assert np.mean(changes) == pytest.approx(expected, rel=0.05)  # the same measurement, end to end
    assert np.mean(changes) >= 0.5 * pose["sensitivity"][dim] > 0  # and of the size recorded over 1,000 digits
    if EXPLORER_MODEL and 2 * pose["visible_dimensions"] >= len(pose["sensitivity"]):  # a model whose poses show
        assert np.mean(changes) >= pose["visible_grey_levels"]


@needs_browser
def test_a_model_of_any_size_says_it_has_no_decoder_and_marks_each_present_class(any_size_server,
                                                                                  shared_tiny_export, browser,
                                                                                  tmp_path):
    path = tmp_path / "pair.png"
    _, lengths, (left, right) = pair_of_two_longest(shared_tiny_export, path)
    page, requested = open_page(browser, any_size_server)
    note = page.locator("#decoder-note")
    assert note.is_visible() and "takes images of any size and has no decoder" in note.inner_text()
    assert not page.locator("#explorer-controls").is_visible()
    ranked = np.sort(lengths)[::-1]
    page.fill("#threshold", f"{(ranked[1] + ranked[2]) / 2:.4f}")  # exactly the two digits present
    page.set_input_files("#file", str(path))
    _, present = shown(page)
    assert set(present) == {left, right} and page.locator("#marks").get_attribute("data-classes") == ",".join(
        map(str, present))
    places = {int(item.get_attribute("data-class")): item.inner_text() for item in page.locator("#marks-list li").all()}
    assert all(": columns " in place for place in places.values())
    first_column = {digit: int(place.split()[2]) for digit, place in places.items()}  # "7: columns 0 to 27"
    assert first_column[left] < first_column[right]  # each digit marked where it is
    assert not any("decoder" in url for url in requested)
    page.close()

