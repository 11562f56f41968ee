"""The deciding half: catalog, policy, planner. Pure Python; never touches bytes."""
