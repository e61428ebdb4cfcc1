"""The ``inferline`` command: ``main`` builds the parser; one module per command group (``audit``, ``keys``,
``index``, ``run``, ``eval``, ``capacity``, ``schema``).

The top layer: may import anything of the project.
"""
