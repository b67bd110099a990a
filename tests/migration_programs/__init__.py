"""Three typical PyTorch Lightning programs and their jaxlight ports, written by following docs/migration.md.

Each ``*_lightning.py`` is the original (it runs with pytorch-lightning and torch), each ``*_jaxlight.py``
the port. Both expose ``main(root_dir, ...)`` returning plain Python data, so ``tests/test_migration_doc.py``
can run them side by side; ``python tests/migration_programs/<file>.py`` runs one as a script.
"""
