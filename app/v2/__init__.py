"""The Open Inference Protocol (KServe v2) shared by HTTP and gRPC."""
