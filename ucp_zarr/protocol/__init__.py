"""The protocol: save planning, fragments, the transaction, staging, the boundary exchange, collectives, saving, reading and loading."""
