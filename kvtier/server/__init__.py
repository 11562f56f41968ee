"""The daemon: store (tiers + catalog), gRPC servicer, process main."""
