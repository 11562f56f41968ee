"""Generated gRPC/protobuf modules (see scripts/gen_proto.py)."""
