"""Prompt sources: what a recipe's `data.sources` names (registry.py), the file formats they come in (readers.py), the
one prompt record and row normaliser (rows.py), the sources made here (libcode.py, wordmath.py), and the choice of
training and evaluation prompts from them (prompts.py)."""
