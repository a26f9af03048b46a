"""A run on disk: its folder (created, refused, cleared, marked), the records it writes, and its metric loggers.

Nothing here imports torch: the command line checks and creates run folders before any worker starts.
"""
