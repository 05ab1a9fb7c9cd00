"""Exports of a finished run into the formats trainers read (SpecForge, vLLM speculators)."""
