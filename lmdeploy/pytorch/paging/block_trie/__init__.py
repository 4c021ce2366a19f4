"""Prefix cache: block trie with exact-step state checkpoints (see README.md)."""
