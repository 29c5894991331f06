"""The application layer: the ``kvplane`` command line and the main job.

Dependency direction: app -> connector -> transport, statemachines.  Nothing
below imports this package; an engine embeds ``kvplane.connector`` only.
"""
