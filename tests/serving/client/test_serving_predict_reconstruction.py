"""`capsnet predict --reconstruction`: the server's reconstructions written as PNG files, without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from PIL import Image

from capsnet.cli import main
from capsnet.client.api import CapsNetClient


def write_digits(directory, count: int) -> list[str]:
    paths = []
    for index in range(count):
        path = directory / f"digit{index}.png"
        Image.fromarray(np.random.default_rng(10 + index).integers(0, 256, (28, 28), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths


def served_reconstructions(server, paths) -> list[np.ndarray]:
    """What the server returns, as the 8-bit grey levels a PNG holds: (28, 28) each."""
    with CapsNetClient(server.target) as client:
        predictions = client.classify(paths, reconstruction=True)
    return [np.rint(np.clip(p.reconstruction[0], 0, 1) * 255).astype(np.uint8) for p in predictions]


def test_several_images_write_numbered_pngs_without_importing_torch(server, tmp_path):
    paths = write_digits(tmp_path, 2)
    script = ("import sys; from capsnet.cli import main; code = main(sys.argv[1:]); "
              "print('torch imported' if 'torch' in sys.modules else 'torch not imported'); sys.exit(code)")
    run = subprocess.run([sys.executable, "-c", script, "predict", *paths, "--server", server.target,
                          "--reconstruction", str(tmp_path / "out.png")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "torch not imported"
    written = [str(tmp_path / "out-0.png"), str(tmp_path / "out-1.png")]
    reported = [line for line in lines if line.startswith("  reconstruction: ")]
    assert reported == [f"  reconstruction: {p}" for p in written]
    assert not (tmp_path / "out.png").exists()
    for png, expected in zip(written, served_reconstructions(server, paths)):
        with Image.open(png) as image:
            assert (image.format, image.mode, image.size) == ("PNG", "L", (28, 28))
            np.testing.assert_array_equal(np.asarray(image), expected)


def test_one_image_writes_the_given_file_and_json_names_it(server, tmp_path, capsys):
    paths = write_digits(tmp_path, 1)
    target = tmp_path / "recon.png"
    assert main(["predict", *paths, "--server", server.target, "--reconstruction", str(target), "--json"]) == 0
    items = json.loads(capsys.readouterr().out)
    assert items[0]["reconstruction"] == str(target)
    with Image.open(target) as image:
        np.testing.assert_array_equal(np.asarray(image), served_reconstructions(server, paths)[0])


def test_unwritable_target_is_a_one_line_error(server, tmp_path, capsys):
    paths = write_digits(tmp_path, 1)
    target = tmp_path / "missing-folder" / "recon.png"
    assert main(["predict", *paths, "--server", server.target, "--reconstruction", str(target)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"capsnet predict: error: cannot write {target}: No such file or directory")
