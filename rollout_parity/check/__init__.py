"""What ``rollout-parity check`` ships: the shared cross-framework batch, its frozen numbers and
the drivers that run it through each framework's own code (used by the suite too)."""
