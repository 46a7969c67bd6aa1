"""Export stage: a checkpoint to ONNX (+ INT8, FP16), a TensorRT engine and a Triton model repository."""
