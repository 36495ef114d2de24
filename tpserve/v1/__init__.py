"""Generated protobuf and gRPC stubs of proto/tpserve/v1 (do not edit; run proto/compile.py)."""
