"""`iq36 gate`: the paired performance gate bound to a correctness gate (SPEC §5)."""
