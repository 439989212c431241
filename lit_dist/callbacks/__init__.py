"""Callbacks. Their YAML stacks live in the top-level ``callbacks/`` folder."""
