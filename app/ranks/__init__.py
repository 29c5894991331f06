"""The worker ranks of an engine of `kvplane run`: the scheduler's side (group), the protocol
(messages) and one rank's process (worker).
"""
