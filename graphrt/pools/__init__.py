"""Buffer pools and tiers, and memory probes: optional allocation strategies beside the static slots."""
