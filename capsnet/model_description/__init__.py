"""model.json: the one description of an exported model (docs/artifacts.md), as Triton's model config is for
Triton. Export builds a ModelDescription (schema) and writes it; serving, bench and deployment read it back.
Beside it: the files an export writes (files), the image sizes a model takes (input_sizes), the precision gate
that reduced precisions answer to (precision_gate) and what the outputs say about the classes (classes).
Dependency-free (no torch, onnx or grpc), so every stage can import it."""
