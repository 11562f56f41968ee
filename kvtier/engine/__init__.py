"""The store: the daemon's flows over the deciding units and the tiers (see docs/design.md)."""
