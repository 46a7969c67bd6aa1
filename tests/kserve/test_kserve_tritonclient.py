"""tritonclient.grpc, unchanged, against our server: live/ready/metadata/infer, run in a child process.

tritonclient is never imported here: its `inference` protos clash with ours in one protobuf pool.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from capsnet import __version__
from kserve_messages import images

SCRIPT = Path(__file__).with_name("tritonclient_calls.py")


def test_tritonclient_live_ready_metadata_and_infer(kserve_target, run_onnx, tmp_path):
    batch = images(4, seed=11)
    np.save(tmp_path / "images.npy", batch)
    completed = subprocess.run([sys.executable, str(SCRIPT), kserve_target, str(tmp_path / "images.npy")],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    calls = json.loads(completed.stdout)

    assert (calls["live"], calls["ready"], calls["model_ready"]) == (True, True, True)
    assert calls["server_metadata"] == {"name": "capsnet-serve", "version": __version__}
    metadata = calls["model_metadata"]
    assert (metadata["name"], metadata["versions"], metadata["platform"]) == ("capsnet", ["1"], "onnxruntime_onnx")
    assert metadata["inputs"] == [{"name": "images", "datatype": "FP32", "shape": ["-1", "1", "28", "28"]}]
    assert [output["name"] for output in metadata["outputs"]] == ["probabilities", "poses", "reconstruction"]

    infer = calls["infer"]
    assert (infer["id"], infer["model_name"], infer["model_version"]) == ("triton-1", "capsnet", "1")
    assert infer["output_names"] == ["poses", "probabilities"]
    expected = run_onnx(batch)
    for name in ("probabilities", "poses"):
        np.testing.assert_allclose(np.array(infer[name], dtype=np.float32), expected[name], rtol=1e-4, atol=1e-5)

    error = calls["unknown_model_error"]
    assert error["status"] == "StatusCode.NOT_FOUND" and "'no-such-model'" in error["message"]
