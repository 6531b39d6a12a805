"""Worlds: tools, tasks and checkers a recipe names; the `opd` library names none of them."""
