"""What export and serving share for running a model: the CPU's kind (cpu), the torch runners (torch_runner), the
TensorRT engine runner (tensorrt_runner), the fused dynamic-routing kernels (fused_routing, fused_support) and
convolutions in fp16/bf16 (reduced_precision). Export checks its artifacts with the runners the server serves
with, so the gate checks the code that serves. It builds on capsnet.models and imports no stage above it
(training, export, serving: pyproject.toml's import-linter contracts)."""
