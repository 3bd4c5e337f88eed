"""The test suite: test modules by tier (see conftest.py); shared rigs and helpers in ``tests.support``."""
