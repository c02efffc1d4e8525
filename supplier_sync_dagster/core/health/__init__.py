"""How the sync is doing: the health figures operators are judged by, and alerts that fire
once and clear."""
