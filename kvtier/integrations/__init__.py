"""Engine integrations (each imports its engine; `import kvtier` imports none)."""
