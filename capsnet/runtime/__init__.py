"""What export and serving share for running a model: the CPU's kind (cpu), the torch runners (torch_runner), the
TensorRT engine runner (tensorrt_runner) and the fused dynamic-routing kernels (fused_routing, fused_support).
Export checks its artifacts with the runners the server serves with, so the gate checks the code that serves."""
