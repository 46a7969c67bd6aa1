"""What the server records: Prometheus metrics, Triton's per-version statistics, OpenTelemetry traces, access logs and
the GPUs' own metrics."""
