"""capsnet-serve: Capsule Networks from training to a production gRPC service."""

__version__ = "0.1.0"
