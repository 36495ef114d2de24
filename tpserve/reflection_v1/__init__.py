"""Generated stubs of gRPC server reflection v1 (do not edit; run tpserve/reflection_v1/compile.py)."""
