"""The server, in layers that import only downward (pyproject.toml's `serving-layers` contract):

- processes: one server as several front-end processes around one engine process (`capsnet serve --workers N`);
- transports: gRPC, REST, the interceptor and the server that listens on them;
- protocol: what a request means, whatever carried it (KServe v2, the CapsNet v1 API, images, shared memory);
- engine: the model versions, their batchers and backends, and the checks before a version serves;
- observability: metrics, statistics, traces and the GPUs' metrics, which every layer above records to;

beside the settings (config), the server's phase (lifecycle) and the transport-free errors, which all of them read.
"""
