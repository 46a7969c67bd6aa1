"""`capsnet bench`: every backend side by side, the CPU's limit and end-to-end gRPC, measured in one run."""
