"""The batch schedulers of the facilities: one protocol (base), its implementations, a registry."""
