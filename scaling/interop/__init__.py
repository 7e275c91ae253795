"""Checkpoint formats of other libraries (Hugging Face transformers)."""
