"""Putting a model's stages on hosts: plan, ship slices, start."""
