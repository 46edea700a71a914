"""Fuzzing of traingraph's file inputs: models, both checkpoint formats and ``.npz`` data.

``python -m tests.fuzz --cases N`` runs N cases of each kind (see ``__main__``);
``tests/fuzz/test_fuzz.py`` runs a fixed-seed sample in the default test run.
"""
