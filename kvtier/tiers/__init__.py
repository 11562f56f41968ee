"""The storing half: tiers own bytes (arena memory, record files); they never decide policy."""
