"""Simulators over the deciding half: a trace replayed through kvtier.index's catalog, policy
and planner, on one node (`replay`) or a routed fleet (`fleet`). Pure Python, no bytes; their
command lines are in kvtier/bench/."""
