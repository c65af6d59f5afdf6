"""The invariant checker: its rules, the shadow model, the pool views and one
checked call."""
