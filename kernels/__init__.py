"""Model-specific specialisations of the locked IR, each switchable and tested for numeric
equivalence. Built by issue #7."""
