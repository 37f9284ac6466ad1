import qworker  # noqa: F401  (before torch: the worker's OpenMP settings, see qworker/__init__.py)
