"""The application layer: the ``kvplane`` command line (``cli``, the entry
point) and one subpackage per family: ``job`` (``kvplane run``), ``ranks``
(its engines' worker ranks), ``vllm`` (the vLLM job, ``proxy``, ``attack``),
``sequence_diagrams`` (``kvplane sequence``) and ``offline`` (``replay``,
``check-log``, ``explore``, ``diagrams``).

Dependency direction: app -> connector -> transport, statemachines.  Nothing
below imports this package; an engine embeds ``kvplane.connector`` only.
"""
