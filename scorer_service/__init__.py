"""The public Kev scoring service (`python -m scorer_service`): see server.py for the request flow,
batcher.py for the cross-request row batcher, bank_link.py for handles and the bank attachment."""
