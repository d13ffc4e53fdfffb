"""Schedules: the action IR, placement, order generators, lowering, checks, runtime."""
