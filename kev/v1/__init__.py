"""Generated gRPC/protobuf code for `kev.v1` (from proto/kev/v1/*.proto; regenerate with
scripts/gen_proto.sh, never edit by hand: tests/rpc/test_proto_generated.py checks they match)."""
