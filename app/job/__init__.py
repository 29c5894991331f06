"""The main job (`kvplane run`): options, placement, the orchestrator, the engine processes, their
messages, the workload, the bare READ and the report.
"""
