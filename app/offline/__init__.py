"""The commands that run no engine: replay, check-log, explore (with its progress line) and
diagrams.
"""
