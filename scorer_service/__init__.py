"""The public Kev scoring service (`python -m scorer_service`): see server.py for the request flow,
batcher.py for the cross-request row batcher, bank_link.py for handles and the bank attachment,
config.py for its settings. Settings loading, errors with their gRPC status and the gRPC server are
kev/serving's (shared with the bank)."""
