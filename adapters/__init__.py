"""Cloud adapters: each turns one cloud's APIs into offers and capacity signals."""
