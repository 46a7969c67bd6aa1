"""What carries a request: gRPC (our API and KServe v2, through one interceptor), KServe v2 over HTTP/REST with its
body limits, and the server that listens on both ports with TLS. Each transport decodes into the protocol's neutral
request and encodes its answer; nothing below imports a transport."""
