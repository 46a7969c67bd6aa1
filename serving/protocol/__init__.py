"""What a request means, whatever carried it: the KServe v2 data plane, the CapsNet v1 API, images and the clients'
shared-memory regions, down to validated tensors for the engine."""
