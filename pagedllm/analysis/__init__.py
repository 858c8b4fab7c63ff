"""Memory arithmetic and allocation simulation; no model run, no torch."""
