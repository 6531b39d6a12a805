"""Reproducible runs of opd; `recipes.toolcalc` is the embedded toy world."""
