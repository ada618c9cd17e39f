"""The ops teams' policy file: model, loader and evaluation."""
