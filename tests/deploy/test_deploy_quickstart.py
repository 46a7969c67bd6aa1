"""README command 1 (scripts/quickstart.sh) run as a newcomer would, but non-interactive and on the tiny preset:
it trains, exports and serves; a real `capsnet predict` gets the same answer as the exported checkpoint;
SIGTERM stops it cleanly; running the model step again reuses the model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import load_embedded
from deploy_support import REPO, free_port, local_stack, log_tail, requests_total, running, scrape, wait_for

pytestmark = pytest.mark.slow
VENV_BIN = Path(sys.executable).parent


def test_deploy_quickstart_trains_exports_serves_and_answers(tmp_path):
    model_dir = tmp_path / "models" / "quickstart"
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("CAPSNET_")}
    # Every port the server opens given, so the test never needs 8000-8002 free.
    env.update(CAPSNET_VENV=sys.prefix, CAPSNET_PRESET="tiny", CAPSNET_EPOCHS="1", CAPSNET_MODEL_DIR=str(model_dir),
               CAPSNET_GRPC_PORT=str(grpc_port), CAPSNET_HTTP_PORT=str(http_port),
               CAPSNET_METRICS_PORT=str(metrics_port))
    log = tmp_path / "quickstart.log"
    address = f"127.0.0.1:{grpc_port}"

    with running(["bash", str(REPO / "scripts" / "quickstart.sh")], log, env=env) as proc:
        # setup-env.sh's pip install, one epoch of `tiny`, the export with its parity check, then the server.
        wait_for("the quickstart's server to be SERVING", lambda: local_stack.grpc_status(address) == "SERVING",
                 timeout=420, interval=1, alive=proc, log=log)
        output = log.read_text()
        assert "training the 'tiny' preset for 1 epoch(s)" in output, log_tail(log)
        assert f"capsnet predict {model_dir}-samples/" in output and f"--server 127.0.0.1:{grpc_port}" in output

        # A digit of the test split, written as the PNG a user would send.
        test = load_embedded().test
        png = tmp_path / "digit.png"
        Image.fromarray(test.images[7, 0]).save(png)
        sample = sorted((model_dir.parent / "quickstart-samples").glob("*.png"))[0]
        predict = subprocess.run([str(VENV_BIN / "capsnet"), "predict", str(png), str(sample), "--server", address,
                                  "--json"], capture_output=True, text=True, timeout=60, env=env)
        assert predict.returncode == 0, predict.stderr
        answers = json.loads(predict.stdout)

        # The served model is the exported checkpoint: same class, same probabilities (within INT8's rounding where
        # `--precision auto` serves INT8: it does where the export's gate accepts it and it is faster here).
        served = {s.labels["precision"] for s in scrape(f"127.0.0.1:{metrics_port}")
                  if s.name == "capsnet_model_info" and s.labels["model"] == "capsnet"}
        tolerance = 1e-4 if served == {"fp32"} else 1e-2
        model = load_checkpoint(model_dir / "model.ckpt").build_model().eval()
        for answer, path in zip(answers, (png, sample)):
            pixels = np.asarray(Image.open(path), dtype=np.float32)[None, None] / 255.0
            with torch.no_grad():
                probabilities = model(torch.from_numpy(pixels)).probabilities.numpy()[0]
            assert answer["class"] == int(probabilities.argmax()), (answer, probabilities)
            np.testing.assert_allclose(answer["probabilities"], probabilities, atol=tolerance)

        # One Classify call (both images in it) on the metrics port the quickstart was given.
        assert requests_total(scrape(f"127.0.0.1:{metrics_port}"), "capsnet", "Classify", "OK") == 1

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_tail(log)

    # A second run finds the model: the model step (deploy/prepare-model.sh, as quickstart.sh runs it) reuses it.
    exported = (model_dir / "model.json").stat().st_mtime_ns
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env['PATH']}"
    again = subprocess.run(["bash", str(REPO / "deploy" / "prepare-model.sh"), str(model_dir)],
                           capture_output=True, text=True, timeout=60, env=env)
    assert again.returncode == 0 and "reusing the model" in again.stdout, again.stdout + again.stderr
    assert (model_dir / "model.json").stat().st_mtime_ns == exported
